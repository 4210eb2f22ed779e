"""``cluster="auto"`` (and ``specray serve`` without ``--address``) start a Ray of their own,
even with another Ray cluster running on the machine and ``RAY_ADDRESS`` naming it: joining it
would fail ("resources must not be provided") or borrow someone else's cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import ray
    from specray import Engine, SamplingParams

    target, draft = sys.argv[1:3]
    engine = Engine(target, draft=draft, cluster="auto", num_speculative_tokens=2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    [output] = engine.generate([[1, 2, 3]], params)
    gcs = ray.get_runtime_context().gcs_address
    engine.shutdown()
    ray.shutdown()
    in_process = Engine(target, draft=None).generate([[1, 2, 3]], params)[0]
    print(json.dumps({"gcs": gcs, "tokens": output.token_ids, "reference": in_process.token_ids}))
    """
)


def test_auto_starts_its_own_ray_beside_another(cluster, tiny_pair):
    other = cluster[0].address  # a running cluster, and RAY_ADDRESS naming it
    _, target, draft = tiny_pair
    env = {**os.environ, "RAY_ADDRESS": other}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, target, draft],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["gcs"] != other  # its own cluster
    assert report["tokens"] == report["reference"]  # and a working one
