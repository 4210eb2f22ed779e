"""Reading and changing a running engine core from a benchmark script: functions run inside
the target's rank-0 actor through Ray's ``__ray_call__`` (``scripts/coordinator-ab.py``,
``scripts/draft-ahead-ab.py``), so one engine core can be measured at two settings in turn."""

from __future__ import annotations


def set_coordinator_field(worker, field: str, value):
    """Replace one ``CoordinatorConfig`` field of ``worker``'s engine core (the draft pool's
    copy too); returns the value now set."""
    import dataclasses

    core = worker.engine_core

    async def change():
        coordinator = core.coordinator
        coordinator.config = dataclasses.replace(coordinator.config, **{field: value})
        if coordinator._pool is not None:
            coordinator._pool.config = coordinator.config
        return getattr(coordinator.config, field)

    return core.call(change())


def coordinator_stats(worker) -> dict:
    """The engine core's coordinator stats, as a dict."""
    core = worker.engine_core

    async def read():
        return dict(core.coordinator.stats.__dict__)

    return core.call(read())
