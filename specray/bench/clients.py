"""Closed-loop load for the benchmarks: one thread per simulated client."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_clients(concurrency: int, client: Callable[[int], None]) -> None:
    """Run ``client(0) .. client(concurrency - 1)`` on threads of their own until all return;
    the first error any of them raised is raised here (not lost in its thread)."""
    errors: list[BaseException] = []

    def guarded(number: int) -> None:
        try:
            client(number)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
