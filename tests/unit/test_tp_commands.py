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

    def broadcast(tensor, src):
        sizes.append(tensor.numel())
        tensor[:8] = torch.frombuffer(bytearray(header), dtype=torch.uint8)

    monkeypatch.setattr(tp_group.dist, "broadcast", broadcast)
    with pytest.raises(ValueError, match="exceeds"):
        tp_group._broadcast_bytes(None)
    assert sizes == [tp_group.HEADER_BYTES]
