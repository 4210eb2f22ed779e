"""Feature-conditioned drafting (EAGLE: Li et al. 2024): the draft also reads the target's
final-norm hidden state.

Features. h_i is the target's final-norm hidden state at committed position i (the row its
head turns into the logits for token i + 1). The draft at position i reads the token x_i and
f_{i-1}: h_{i-1} where the target has computed it, zeros at i = 0, else g_{i-1}, the draft's
own final-norm output at i - 1 ("chained"). Its logits at i give q for token i + 1.

Sync rule. Each call carries the committed tokens and h_0 .. h_{T-2} (the target runs a token
once it is pending, so the last committed token has no h yet). The drafter keeps the longest
prefix of its cache that matches the committed tokens *and* was computed from target features;
it re-feeds the rest of the committed tokens with target features (drafts the target accepted
were cached with chained features: they are recomputed, as EAGLE does), then drafts k tokens
chained. Example, prompt of 4 tokens (h_0..h_2 from prefill), k = 3:
  round 1: feed x_0..x_3 with [0, h_0, h_1, h_2]; draft d_1 (from x_3), d_2, d_3 chained.
  the target accepts d_1 and emits t: committed x_0..x_3 d_1 t, features h_0..h_4.
  round 2: keep x_0..x_3 (cached from target features), drop d_1..d_3, feed d_1 and t with
  [h_3, h_4]; draft chained from t.
Sampling, q and the keyed draws are ModelDrafter's, unchanged: the draft samples from exactly
the q it returns, so verification stays exact whatever the features are.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from specray.drafters.base import DraftBlock, DraftRequest
from specray.drafters.model import ModelDrafter, _common_prefix
from specray.models.runner import ModelRunner
from specray.sampling import DraftProbsEncoding


class FeatureDrafter(ModelDrafter):
    """A :class:`ModelDrafter` whose model reads a feature per token (``embed_with_features``,
    e.g. :class:`specray.distill.student.FeatureDraftModel`)."""

    needs_target_features = True  # the engine keeps h per request and sends it in DraftRequest

    def __init__(
        self, runner: ModelRunner, encoding: DraftProbsEncoding, *, keep_encoded: bool = False
    ):
        if not hasattr(runner.model, "embed_with_features"):
            raise ValueError(
                "FeatureDrafter needs a model that reads features (embed_with_features)"
            )
        super().__init__(runner, encoding, keep_encoded=keep_encoded)
        self.feature_size = int(runner.model.config.hidden_size)
        # Leading cached positions computed from target features, per request.
        self._num_from_target: dict[Hashable, int] = {}
        self._next_features: dict[Hashable, torch.Tensor] = {}  # [len(next feed), hidden]
        self.target_rows_fed = 0  # target feature rows fed, over the drafter's life (tests)

    def prefill(self, requests: Sequence[DraftRequest], source=None) -> None:
        """Nothing ahead of time: the first :meth:`propose` feeds the prompt, which needs the
        target's features of the prompt."""

    def _sync(self, request: DraftRequest) -> list[int]:
        """Roll back to the committed prefix cached from target features; return the committed
        tokens to feed (>= 1) and stage their features f_{i-1}."""
        request_id, committed = request.request_id, request.token_ids
        features = request.target_features  # [T - 1, hidden]
        expected = (len(committed) - 1, self.feature_size)
        if features is None or tuple(features.shape) != expected:
            got = None if features is None else tuple(features.shape)
            raise ValueError(
                f"target_features of request {request_id!r} must have shape {expected} (one "
                f"target hidden state per committed position but the last), got {got}; a "
                "feature-conditioned draft runs in process only (Engine without cluster)"
            )
        cached = self._cached.setdefault(request_id, [])
        keep = min(
            _common_prefix(cached, committed),
            self._num_from_target.get(request_id, 0),
            len(committed) - 1,  # feed >= 1 token
        )
        if request_id in self.runner:
            self.runner.rollback(request_id, len(cached) - keep)
        del cached[keep:]
        # Position i reads f_{i-1} = h_{i-1}; position 0 reads zeros.
        rows = features[max(keep - 1, 0) :]  # [T - max(keep - 1, 0) - 1, hidden]
        self.target_rows_fed += len(rows)
        if keep == 0:
            rows = torch.cat([rows.new_zeros(1, self.feature_size), rows])
        self._next_features[request_id] = rows  # [T - keep, hidden]
        self._num_from_target[request_id] = len(committed)
        return committed[keep:]

    def _forward(self, feeds: dict[Hashable, list[int]]) -> dict[Hashable, torch.Tensor]:
        ones = {request_id: 1 for request_id in feeds}
        features = {request_id: self._next_features[request_id] for request_id in feeds}
        logits, hidden = self.runner.forward(feeds, ones, num_hidden=ones, features=features)
        # Chained: the next position (this step's draft token) reads this one's output g.
        self._next_features.update(hidden)  # each [1, hidden]
        return logits

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftBlock]:
        try:
            return super().propose(requests)
        finally:
            self._next_features.clear()  # staged rows are per call

    def release(self, request_ids: Sequence[Hashable]) -> None:
        super().release(request_ids)
        for request_id in request_ids:
            self._num_from_target.pop(request_id, None)
