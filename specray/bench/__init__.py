"""``specray bench``: the benchmarks behind the numbers in README.md and docs/bench/.

One module per question, each imported by ``specray.cli`` only when its flag is given (they pull
in torch, transformers or Ray): ``main`` (specray against transformers in one process),
``drafters`` (every drafter, ``--drafters``), ``serving`` (the coordinator under concurrent load,
``--concurrency``), ``overhead`` (what the serving layers cost, ``--overhead``) and ``steps`` (one
target forward, ``--steps``). This package re-exports nothing, so importing it stays free.
"""
