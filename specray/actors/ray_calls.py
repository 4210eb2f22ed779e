"""Counting what reaches a worker through Ray: only the control plane should.

A worker class becomes a Ray actor as :func:`counted` (``ray.remote(counted(TargetWorker))``):
every public method then counts its calls in ``self.ray_calls``, except calls made on the
process's own round-path threads (the engine core's loop and target thread, a draft worker's
command thread), which mark themselves with :func:`mark_round_path_thread`. A steady round
therefore adds nothing to these counts (tested).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import Counter

_thread = threading.local()
_lock = threading.Lock()


def mark_round_path_thread() -> None:
    """Calls from this thread are the process's own, not Ray's."""
    _thread.round_path = True


def count_call(worker, name: str) -> None:
    """One call of ``name`` on ``worker``, unless made on a round-path thread."""
    if not getattr(_thread, "round_path", False):
        with _lock:
            worker.ray_calls[name] += 1


def _counting(name: str, method):
    # The class is made at run time, so Ray pickles it by value: the wrapper refers to this
    # module's state only through count_call, which pickles by reference.
    @functools.wraps(method)  # keeps Ray's method options (concurrency groups)
    def counted(self, *args, **kwargs):
        count_call(self, name)
        return method(self, *args, **kwargs)

    return counted


def counted(cls: type) -> type:
    """``cls`` with its public methods counting the calls Ray delivers (``ray_calls``)."""

    def init(self, *args, **kwargs):
        self.ray_calls = Counter()
        cls.__init__(self, *args, **kwargs)

    namespace = {
        name: _counting(name, member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }
    namespace["__init__"] = init
    return type(cls.__name__, (cls,), namespace)
