"""Who is where in one served application: target groups, their coordinators, draft workers.

Serve replicas cannot call each other's methods directly, and a coordinator must talk to one
particular target group and to the draft workers feeding it. So each replica registers the
Ray actors it owns here: a ``TargetWorker`` replica its group's rank 0, a ``DraftWorker``
replica its worker; a ``Coordinator`` replica claims one unclaimed target group and reads the
draft pool of that group. A draft worker is assigned to the group with the fewest drafts, so
the pool the autoscaler grows or shrinks spreads evenly over target groups.

The registry is a named detached actor per application (0 CPUs); its state is rebuilt by the
replicas' periodic re-registration if it restarts.
"""

from __future__ import annotations

import contextlib
import time

REGISTRY_NAMESPACE = "specray"
# A coordinator that has not renewed its claim this long (five missed heartbeats) lost it: a
# replacement for a killed one claims the group then.
CLAIM_TTL_S = 10.0
DRAFT_TTL_S = 10.0  # a draft worker that has not renewed this long is out of the pool


def registry_name(app_name: str) -> str:
    return f"specray-registry-{app_name}"


class Registry:
    def __init__(self):
        # group id -> {leader, address (draft workers'), session_address (front ends'), info,
        # claimed_by}
        self.targets: dict[str, dict] = {}
        self.claims: dict[str, float] = {}  # coordinator id -> last renewal (monotonic)
        self.drafts: dict[str, dict] = {}  # worker id -> {handle, group}
        self.metrics: dict[str, bytes] = {}  # coordinator id -> its latest exposition text

    # ---- target groups -------------------------------------------------------------
    def add_target(
        self, group_id: str, leader, address: str, info: dict, session_address: str
    ) -> None:
        previous = self.targets.get(group_id, {})
        self.targets[group_id] = {
            "leader": leader,
            "address": address,
            "session_address": session_address,
            "info": info,
            "claimed_by": previous.get("claimed_by"),
        }

    def remove_target(self, group_id: str) -> None:
        self.targets.pop(group_id, None)
        for draft in self.drafts.values():
            if draft["group"] == group_id:
                draft["group"] = None  # reassigned on its next registration

    def claim_target(self, coordinator_id: str) -> dict | None:
        """The group this coordinator holds, else an unclaimed one (or one whose coordinator
        stopped renewing); None while there is none."""
        now = time.monotonic()
        self.claims[coordinator_id] = now
        stale = {c for c, at in self.claims.items() if now - at > CLAIM_TTL_S}
        chosen = None
        for group_id, group in self.targets.items():
            if group["claimed_by"] == coordinator_id:
                chosen = group_id
                break
            if chosen is None and (group["claimed_by"] is None or group["claimed_by"] in stale):
                chosen = group_id
        if chosen is None:
            return None
        group = self.targets[chosen]
        group["claimed_by"] = coordinator_id
        return {"group_id": chosen, **{k: group[k] for k in ("leader", "address", "info")}}

    def release_claim(self, coordinator_id: str) -> None:
        self.claims.pop(coordinator_id, None)
        self.metrics.pop(coordinator_id, None)
        for group in self.targets.values():
            if group["claimed_by"] == coordinator_id:
                group["claimed_by"] = None

    # ---- metrics of several coordinators ---------------------------------------------
    def put_metrics(self, coordinator_id: str, text: bytes) -> None:
        self.metrics[coordinator_id] = text

    def all_metrics(self) -> dict[str, bytes]:
        """The latest exposition of each coordinator that still renews its claim."""
        now = time.monotonic()
        live = {c for c, at in self.claims.items() if now - at <= CLAIM_TTL_S}
        return {c: text for c, text in self.metrics.items() if c in live}

    # ---- draft workers -------------------------------------------------------------
    def add_draft(self, worker_id: str, handle) -> dict | None:
        """Register (or renew) a draft worker; returns its group ``{group_id, address}``, kept
        while that group exists, else the group with the fewest drafts (None: no group yet)."""
        entry = self.drafts.setdefault(worker_id, {"handle": None, "group": None})
        entry["handle"], entry["renewed"] = handle, time.monotonic()  # None: not ready yet
        if entry["group"] not in self.targets:
            entry["group"] = None
            load = {group_id: 0 for group_id in self.targets}
            for draft in self.drafts.values():
                if draft["group"] in load:
                    load[draft["group"]] += 1
            if not load:
                return None
            entry["group"] = min(load, key=load.__getitem__)
        group_id = entry["group"]
        return {"group_id": group_id, "address": self.targets[group_id]["address"]}

    def remove_draft(self, worker_id: str) -> None:
        self.drafts.pop(worker_id, None)

    def drafts_of(self, group_id: str) -> dict:
        """Worker id -> actor handle of the ready, live drafts assigned to a group."""
        now = time.monotonic()
        return {
            worker_id: draft["handle"]
            for worker_id, draft in self.drafts.items()
            if draft["group"] == group_id
            and draft["handle"] is not None
            and now - draft["renewed"] <= DRAFT_TTL_S
        }

    def endpoints(self) -> dict:
        """group id -> ``{leader, address}``: where front ends open their sessions."""
        return {
            group_id: {"leader": target["leader"], "address": target["session_address"]}
            for group_id, target in self.targets.items()
        }

    def workers(self) -> dict:
        """Actor handles: ``targets`` (group id -> rank 0), ``drafts`` (worker id -> worker),
        e.g. to check that finished requests left no state behind."""
        return {
            "targets": {g: t["leader"] for g, t in self.targets.items()},
            "drafts": {w: d["handle"] for w, d in self.drafts.items() if d["handle"] is not None},
        }

    def summary(self) -> dict:
        return {
            "targets": {g: t["claimed_by"] for g, t in self.targets.items()},
            "drafts": {w: d["group"] for w, d in self.drafts.items()},
        }


def get_registry(app_name: str):
    """The application's registry actor, created by whoever asks first."""
    import ray

    return (
        ray.remote(Registry)
        .options(
            name=registry_name(app_name),
            namespace=REGISTRY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            # Heartbeats and polls call it several times a second for the life of the app:
            # each call's task events would be kept by the GCS (docs/bench/soak-2026-12-03.md)
            enable_task_events=False,
        )
        .remote()
    )


def kill_registry(app_name: str) -> None:
    import ray

    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(registry_name(app_name), namespace=REGISTRY_NAMESPACE))
