"""The tensor-parallel command channel (``tp_group._broadcast_bytes``) between two real gloo
processes: a command that fits the first broadcast's header, one that exactly fills it, one a
byte over and a long one (a long prompt's prefill) all arrive whole on the follower, in order."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specray.actors import tp_group
from specray.models.tp import init_process_group_cpu

INLINE = tp_group.HEADER_BYTES - 8  # what fits beside the length
PAYLOADS = [b"", b"x", bytes(range(256)) * (INLINE // 256) + b"y" * (INLINE % 256)]
PAYLOADS += [PAYLOADS[-1] + b"z", bytes(i % 251 for i in range(300_000))]


def _worker(rank: int, init_method: str, out_dir: str) -> None:
    init_process_group_cpu(rank, 2, init_method)
    try:
        received = [tp_group._broadcast_bytes(p if rank == 0 else None) for p in PAYLOADS]
        with open(f"{out_dir}/rank{rank}.bin", "wb") as out:
            for payload in received:
                out.write(len(payload).to_bytes(8, "little") + payload)
    finally:
        dist.destroy_process_group()


def _read(path) -> list[bytes]:
    data, payloads = path.read_bytes(), []
    while data:
        size = int.from_bytes(data[:8], "little")
        payloads.append(data[8 : 8 + size])
        data = data[8 + size :]
    return payloads


@pytest.mark.slow  # spawns two processes that talk over gloo
@pytest.mark.timeout(120)
def test_commands_of_every_size_arrive_whole(tmp_path):
    assert len(PAYLOADS[2]) == INLINE and len(PAYLOADS[3]) == INLINE + 1
    mp.spawn(_worker, args=(f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2)
    assert _read(tmp_path / "rank0.bin") == PAYLOADS
    assert _read(tmp_path / "rank1.bin") == PAYLOADS


@pytest.mark.parametrize("count", [tp_group.MAX_COMMAND_BYTES + 1, -1])
def test_a_header_announcing_a_bad_length_is_refused(monkeypatch, count):
    """What a follower does with a header whose length is out of bounds: refuse it before any
    second broadcast (the collective is replaced by one that writes that header)."""
    header = count.to_bytes(8, "little", signed=True)
    sizes = []

    def broadcast(tensor, src, group=None):
        sizes.append(tensor.numel())
        tensor[:8] = torch.frombuffer(bytearray(header), dtype=torch.uint8)

    monkeypatch.setattr(tp_group.dist, "broadcast", broadcast)
    with pytest.raises(ValueError, match="exceeds"):
        tp_group._broadcast_bytes(None)
    assert sizes == [tp_group.HEADER_BYTES]


class _Runner:
    """A follower's runner that only counts (the channel is what is tested here)."""

    model, vocab_size, device = None, 0, torch.device("cpu")

    def __init__(self):
        self.forwards = 0

    def forward(self, feeds, num_logits):
        self.forwards += 1


def _heartbeat_worker(rank: int, init_method: str, out_dir: str) -> None:
    """Rank 0 sends one forward, idles 2 s (pinging every 0.25 s), then goes silent as a hung
    leader would; rank 1 follows on a command group with a 1.5 s timeout and records how its
    loop ended and when."""
    import json
    import time

    init_process_group_cpu(rank, 2, init_method)
    commands = tp_group.command_group(timeout_s=1.5)
    try:
        if rank == 0:
            leader = tp_group.LeaderRunner(_Runner(), commands, heartbeat_s=0.25)
            leader._send(tp_group.msgpack.packb({"op": "forward", "ops": [], "feeds": {}}))
            time.sleep(2.0)
            leader.stop_heartbeat()
            silent = time.monotonic()
            time.sleep(3.0)  # silent: the follower must give up meanwhile
            with open(f"{out_dir}/leader.json", "w") as out:
                json.dump({"silent_at": silent}, out)
            return
        runner, started = _Runner(), time.monotonic()
        try:
            tp_group.follow(runner, commands)
            outcome = "stopped"
        except RuntimeError as error:  # gloo's timeout
            outcome = f"failed: {type(error).__name__}"
        with open(f"{out_dir}/follower.json", "w") as out:
            json.dump(
                {
                    "outcome": outcome,
                    "after_s": time.monotonic() - started,
                    "forwards": runner.forwards,
                },
                out,
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two processes that talk over gloo
@pytest.mark.timeout(120)
def test_an_idle_leader_pings_and_a_silent_one_fails_its_followers_in_seconds(tmp_path):
    """Idle for 2 s (past the follower's timeout) the follower keeps waiting, on pings; once
    the leader falls silent, the follower's loop fails within its 1.5 s timeout (plus
    scheduling), not after the 365 days a collective used to wait."""
    import json

    mp.spawn(_heartbeat_worker, args=(f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2)
    follower = json.loads((tmp_path / "follower.json").read_text())
    assert follower["outcome"].startswith("failed")
    assert follower["forwards"] == 1
    assert 2.0 + 1.2 < follower["after_s"] < 2.0 + 1.5 + 1.8
