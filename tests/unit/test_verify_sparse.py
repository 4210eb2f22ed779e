"""The sparse-q rules (verify_blocks) commit the tokens of the reference verify_batch.

The reference runs as the core ran it before: q decoded dense and every block padded into
``[batch, k, vocab]`` / ``[batch, k + 1, vocab]`` tensors, p renormalised in float64 and
sampled from a float64 cumulative sum of the whole row. The two differ only where a uniform
lies within float32 rounding (~1e-7) of a threshold, which none of these seeded draws does:
both get the same uniforms, and every batch must commit identical token ids and acceptance
counts, for dense fp32 q and top-M q, with empty blocks, rejections, degenerate residuals
(p == q up to rounding) and bonus tokens; rows read in place (consecutive rows of one tensor,
as the pipeline returns them) or one request at a time.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specray.sampling import (
    DraftProbsEncoding,
    VerifyUniforms,
    decode_draft_probs,
    encode_draft_probs,
    verify_batch,
)
from specray.sampling.encoding import SparseDraftProbs, decode_sparse_draft_probs
from specray.sampling.rows import Workspace, consecutive_rows
from specray.sampling.verify_sparse import verify_blocks

NUM_BATCHES = 200
ENCODINGS = ["fp32", "top1", "top4", "top64"]


def _block_q(probs: torch.Tensor, encoding: str):
    """q as the draft samples from it (dense) and as the rules receive it, row by row."""
    parsed = DraftProbsEncoding.parse(encoding)
    if not parsed.sparse:
        return probs.float(), probs.float()
    rows = [encode_draft_probs(probs[j : j + 1], parsed) for j in range(probs.shape[0])]
    if not rows:
        return torch.zeros(0, probs.shape[-1]), torch.zeros(0, probs.shape[-1])
    dense = torch.cat([decode_draft_probs(row) for row in rows])  # [n, vocab]
    sparse = [decode_sparse_draft_probs(row) for row in rows]
    ids = torch.cat([row.token_ids for row in sparse])
    values = torch.cat([row.values for row in sparse])
    return dense, SparseDraftProbs(ids, values, probs.shape[-1])


def _random_round(generator, encoding, vocab, batch, k, scale, full=False):
    """A round's inputs: per request n <= k drafted tokens sampled from q, and p near q;
    request 0 drafted nothing unless ``full`` (every request drafted k)."""
    num_draft = torch.randint(0, k + 1, (batch,), generator=generator)
    num_draft[0] = 0
    if full:
        num_draft[:] = k
    draft_ids = torch.zeros(batch, k, dtype=torch.int64)
    dense_q, received_q, targets = [], [], []
    for b in range(batch):
        n = int(num_draft[b])
        logits = torch.randn(n + 1, vocab, generator=generator) * scale  # [n+1, vocab]
        target = torch.softmax(logits, dim=-1)
        if b % 3 == 1:  # a truncated target (top-k style zeros), as the pipeline makes
            kth = torch.topk(target, min(8, vocab), dim=-1).values[:, -1:]
            target = torch.softmax(logits.masked_fill(target < kth, float("-inf")), dim=-1)
        noise = torch.randn(n, vocab, generator=generator) * (0.3 if b % 2 else 2.0)
        dense, received = _block_q(torch.softmax(logits[:n] + noise, dim=-1), encoding)
        if n:
            draft_ids[b, :n] = torch.multinomial(dense, 1, generator=generator)[:, 0]
        dense_q.append(dense)
        received_q.append(received)
        targets.append(target)
    uniforms = VerifyUniforms(
        torch.rand(batch, k, generator=generator, dtype=torch.float64),
        torch.rand(batch, k, generator=generator, dtype=torch.float64),
        torch.rand(batch, generator=generator, dtype=torch.float64),
    )
    return draft_ids, num_draft, dense_q, received_q, targets, uniforms


def _reference(draft_ids, num_draft, dense_q, targets, uniforms):
    """verify_batch on padded dense tensors, as TargetCore._verify_sampled did before."""
    batch, k = draft_ids.shape
    vocab = targets[0].shape[-1]
    padded_target = torch.zeros(batch, k + 1, vocab, dtype=targets[0].dtype)
    padded_draft = torch.zeros(batch, k, vocab)
    for b in range(batch):
        n = int(num_draft[b])
        padded_target[b, : n + 1] = targets[b]
        padded_draft[b, :n] = dense_q[b]
    return verify_batch(draft_ids, num_draft, padded_draft, padded_target, uniforms)


def _assert_same(result, expected):
    assert torch.equal(result.num_accepted, expected.num_accepted)
    assert torch.equal(result.token_ids, expected.token_ids)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_sparse_rules_commit_the_reference_tokens(encoding):
    generator = torch.Generator().manual_seed(1000 + len(encoding))
    outcomes = {"rejected": 0, "bonus": 0, "empty": 0}
    for index in range(NUM_BATCHES):
        scale = (0.5, 3.0, 12.0)[index % 3]  # flat to peaked
        inputs = _random_round(generator, encoding, 50, 5, 4, scale)
        draft_ids, num_draft, dense_q, received_q, targets, uniforms = inputs
        expected = _reference(draft_ids, num_draft, dense_q, targets, uniforms)
        result = verify_blocks(draft_ids, num_draft, received_q, targets, uniforms)
        _assert_same(result, expected)
        rejected = expected.num_accepted < num_draft
        outcomes["rejected"] += int(rejected.sum())
        outcomes["bonus"] += int((~rejected & (num_draft > 0)).sum())
        outcomes["empty"] += int((num_draft == 0).sum())
    # every branch of the rule was exercised many times
    assert min(outcomes.values()) >= 50, outcomes


@pytest.mark.parametrize("encoding", ["fp32", "top64"])
def test_full_vocabulary_round(encoding):
    generator = torch.Generator().manual_seed(7)
    for scale in (1.0, 4.0):
        inputs = _random_round(generator, encoding, 128256, 2, 4, scale)
        draft_ids, num_draft, dense_q, received_q, targets, uniforms = inputs
        expected = _reference(draft_ids, num_draft, dense_q, targets, uniforms)
        _assert_same(verify_blocks(draft_ids, num_draft, received_q, targets, uniforms), expected)


@pytest.mark.parametrize("encoding", ["fp32", "top64"])
def test_consecutive_rows_are_read_in_place(encoding):
    """The pipeline's rows are views of one tensor: read through one view, with a workspace
    kept across rounds, they commit what separate row sets commit."""
    generator = torch.Generator().manual_seed(17)
    workspace = Workspace()
    for index in range(30):
        inputs = _random_round(generator, encoding, 600, 6, 4, (0.5, 3.0, 12.0)[index % 3])
        draft_ids, num_draft, dense_q, received_q, targets, uniforms = inputs
        one = torch.cat(targets)  # [rows, vocab]
        views = list(one.split([t.shape[0] for t in targets]))
        assert consecutive_rows(views) is not None
        expected = _reference(draft_ids, num_draft, dense_q, targets, uniforms)
        result = verify_blocks(
            draft_ids, num_draft, received_q, views, uniforms, workspace=workspace
        )
        _assert_same(result, expected)
    assert consecutive_rows([one[:2], one[3:5]]) is None  # a gap: read request by request


def _degenerate_round(encoding: str):
    """p == q but for 2^-43 moved from the drafted token d to another: d is rejected (with a
    uniform near 1), and the residual's mass (2^-43) is below the degenerate threshold, so the
    recovered token comes from p, not from the residual (a point mass on token 4)."""
    vocab = 50
    q = torch.zeros(1, vocab, dtype=torch.float64)
    q[0, [0, 1, 3, 4]] = torch.tensor([0.5, 0.5 - 2**-19, 2**-20, 2**-20], dtype=torch.float64)
    dense, received = _block_q(q, encoding)
    target = torch.cat([dense, dense]).clone()  # [2, vocab]: p == q, then a bonus row
    target[0, 3] -= 2**-43
    target[0, 4] += 2**-43
    draft_ids = torch.tensor([[3]])
    uniforms = VerifyUniforms(
        torch.tensor([[1 - 2**-30]], dtype=torch.float64),
        torch.tensor([[0.1]], dtype=torch.float64),
        torch.tensor([0.9], dtype=torch.float64),
    )
    return draft_ids, torch.tensor([1]), [dense], [received], [target], uniforms


@pytest.mark.parametrize("encoding", ["fp32", "top4"])
def test_degenerate_residual_samples_from_target(encoding):
    draft_ids, num_draft, dense_q, received_q, targets, uniforms = _degenerate_round(encoding)
    expected = _reference(draft_ids, num_draft, dense_q, targets, uniforms)
    result = verify_blocks(draft_ids, num_draft, received_q, targets, uniforms)
    _assert_same(result, expected)
    # rejected at once; from p with u = 0.1 the token is 0 (the residual would give 4)
    assert result.token_ids.tolist() == [[0, -1]]


def test_mixed_dense_and_sparse_blocks_in_one_round():
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        dense_inputs = _random_round(generator, "fp32", 50, 3, 4, 3.0)
        sparse_inputs = _random_round(generator, "top4", 50, 3, 4, 3.0)
        merged = [
            torch.cat([dense_inputs[0], sparse_inputs[0]]),
            torch.cat([dense_inputs[1], sparse_inputs[1]]),
            *[dense_inputs[i] + sparse_inputs[i] for i in (2, 3, 4)],
            VerifyUniforms(
                *[
                    torch.cat([getattr(dense_inputs[5], name), getattr(sparse_inputs[5], name)])
                    for name in ("accept", "residual", "bonus")
                ]
            ),
        ]
        draft_ids, num_draft, dense_q, received_q, targets, uniforms = merged
        expected = _reference(draft_ids, num_draft, dense_q, targets, uniforms)
        _assert_same(verify_blocks(draft_ids, num_draft, received_q, targets, uniforms), expected)


class _Recorder(TorchDispatchMode):
    """Records every tensor an op creates (shape, device) and counts host synchronisations;
    on the meta device a synchronisation reads 0 (no data there)."""

    def __init__(self):
        super().__init__()
        self.created: list[tuple[tuple[int, ...], str]] = []
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
            if args[0].device.type == "meta":
                return 0
        out = func(*args, **kwargs)
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.created.append((tuple(tensor.shape), tensor.device.type))
        return out


def _recorded(run):
    with _Recorder() as recorder:
        run()
    return recorder


def test_sparse_rules_never_build_a_batch_of_dense_q():
    batch, k, vocab = 4, 4, 1000
    generator = torch.Generator().manual_seed(11)
    inputs = _random_round(generator, "top64", vocab, batch, k, 2.0, full=True)
    draft_ids, num_draft, dense_q, received_q, targets, uniforms = inputs
    recorder = _recorded(lambda: verify_blocks(draft_ids, num_draft, received_q, targets, uniforms))
    largest = max(torch.Size(shape).numel() for shape, _ in recorder.created)
    # the scratch rows of one request [k + 1, vocab] and the final rows [batch, vocab] at most
    assert largest <= max(batch, k + 1) * vocab, f"a tensor of {largest} elements was built"
    assert recorder.syncs <= 2  # validate=True: one check, one read of the sampling flag
    # Negative control: the reference pads dense q, and the same check catches it.
    reference = _recorded(lambda: _reference(draft_ids, num_draft, dense_q, targets, uniforms))
    assert max(torch.Size(s).numel() for s, _ in reference.created) >= batch * k * vocab


@pytest.mark.parametrize("encoding", ["fp32", "top4"])
def test_rules_stay_on_the_target_device_with_one_synchronisation(encoding):
    """Inputs on the meta device: any tensor made without ``device=`` would land on the CPU."""
    generator = torch.Generator().manual_seed(5)
    draft_ids, num_draft, _, received_q, targets, uniforms = _random_round(
        generator, encoding, 50, 4, 3, 2.0
    )

    def meta(tensor):
        return tensor.to("meta")

    if encoding == "fp32":
        received_q = [meta(q) for q in received_q]
    else:
        received_q = [
            SparseDraftProbs(meta(q.token_ids), meta(q.values), q.vocab_size)
            if isinstance(q, SparseDraftProbs)
            else meta(q)
            for q in received_q
        ]
    uniforms = VerifyUniforms(meta(uniforms.accept), meta(uniforms.residual), meta(uniforms.bonus))
    recorder = _recorded(
        lambda: verify_blocks(
            meta(draft_ids),
            meta(num_draft),
            received_q,
            [meta(t) for t in targets],
            uniforms,
            validate=False,
        )
    )
    devices = {device for _, device in recorder.created}
    assert devices == {"meta"}, devices
    assert recorder.syncs == 1


def test_validation_names_the_bad_input():
    generator = torch.Generator().manual_seed(2)
    draft_ids, num_draft, _, received_q, targets, uniforms = _random_round(
        generator, "top4", 50, 4, 3, 2.0
    )
    full = next(b for b in range(4) if int(num_draft[b]) > 0)
    bad_ids = draft_ids.clone()
    bad_ids[full, 0] = 50
    with pytest.raises(ValueError, match="draft_token_ids must be in"):
        verify_blocks(bad_ids, num_draft, received_q, targets, uniforms)
    unsupported = draft_ids.clone()
    block = received_q[full]
    outside = next(t for t in range(50) if t not in block.token_ids[0].tolist())
    unsupported[full, 0] = outside
    with pytest.raises(ValueError, match=r"q\(d\) > 0"):
        verify_blocks(unsupported, num_draft, received_q, targets, uniforms)
    wrong_count = num_draft.clone()
    wrong_count[full] -= 1
    with pytest.raises(ValueError, match="lengths"):
        verify_blocks(draft_ids, wrong_count, received_q, targets, uniforms)
    with pytest.raises(ValueError, match="target_probs must be"):
        verify_blocks(draft_ids, num_draft, received_q, [t[:1] for t in targets], uniforms)
