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

Tolerant mode (a draft worker, whose rows arrive with the target's verdicts, over the network):
a call may carry fewer rows than the committed tokens need, h_0 .. h_{m-1} with m <= T - 1
(a verdict not yet arrived or lost; the worker's own drafts past the committed tokens). Position
i then reads h_{i-1} when i - 1 < m, else g_{i-1} when the cache held that position with the
same token (chained, as when it was drafted), else zeros. Positions past m are not "from target
features": they are recomputed once their rows arrive, and only then (recomputing without new
rows would change nothing). With every row present this is the strict rule above, step for step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from specray.drafters.base import DraftBlock, DraftRequest
from specray.drafters.model import ModelDrafter, _common_prefix
from specray.feature_rows import FeatureRows
from specray.models.runner import ModelRunner
from specray.sampling import DraftProbsEncoding


class FeatureDrafter(ModelDrafter):
    """A :class:`ModelDrafter` whose model reads a feature per token (``embed_with_features``,
    e.g. :class:`specray.distill.student.FeatureDraftModel`)."""

    needs_target_features = True  # the engine keeps h per request and sends it in DraftRequest

    def __init__(
        self,
        runner: ModelRunner,
        encoding: DraftProbsEncoding,
        *,
        keep_encoded: bool = False,
        tolerant: bool = False,  # accept fewer target rows than committed (a draft worker)
    ):
        if not hasattr(runner.model, "embed_with_features"):
            raise ValueError(
                "FeatureDrafter needs a model that reads features (embed_with_features)"
            )
        super().__init__(runner, encoding, keep_encoded=keep_encoded)
        self.feature_size = int(runner.model.config.hidden_size)
        self.tolerant = tolerant
        # Leading cached positions computed from target features, per request.
        self._num_from_target: dict[Hashable, int] = {}
        # g_i, the draft's own final-norm output at each cached position: [len(cached), hidden].
        self._chained: dict[Hashable, FeatureRows] = {}
        self._next_features: dict[Hashable, torch.Tensor] = {}  # [len(next feed), hidden]
        self.target_rows_fed = 0  # target feature rows fed, over the drafter's life (tests)
        self.rows_without_target = 0  # positions fed with chained features or zeros instead

    def prefill(self, requests: Sequence[DraftRequest], source=None) -> None:
        """Nothing ahead of time: the first :meth:`propose` feeds the prompt, which needs the
        target's features of the prompt."""

    def _sync(self, request: DraftRequest) -> list[int]:
        """Roll back to the committed prefix cached from target features (where newer rows can
        improve it); return the committed tokens to feed (>= 1) and stage their features."""
        request_id, committed = request.request_id, request.token_ids
        features = request.target_features  # [m, hidden], m = T - 1 unless tolerant
        full = len(committed) - 1
        num_rows = 0 if features is None else len(features)
        strict_ok = features is not None and tuple(features.shape) == (full, self.feature_size)
        tolerant_ok = features is None or (
            features.dim() == 2 and features.shape[1] == self.feature_size and num_rows <= full
        )
        if not (strict_ok or (self.tolerant and tolerant_ok)):
            got = None if features is None else tuple(features.shape)
            raise ValueError(
                f"target_features of request {request_id!r} must have shape "
                f"{(full, self.feature_size)} (one target hidden state per committed position "
                f"but the last), got {got}"
            )
        cached = self._cached.setdefault(request_id, [])
        chained = self._chained.setdefault(request_id, FeatureRows(self.feature_size))
        from_target = self._num_from_target.get(request_id, 0)
        common = _common_prefix(cached, committed)
        keep = min(common, full)  # feed >= 1 token
        if num_rows >= from_target:  # position from_target's row (h_{from_target-1}) is here
            keep = min(keep, from_target)
        if request_id in self.runner:
            self.runner.rollback(request_id, len(cached) - keep)
        del cached[keep:]
        # Position i reads f_{i-1}: h_{i-1} (i - 1 < m), else g_{i-1} if cached with the same
        # token before this call, else zeros (always at i = 0).
        staged = torch.zeros(len(committed) - keep, self.feature_size)  # [T - keep, hidden]
        first, from_rows = max(keep, 1), min(len(committed), num_rows + 1)
        if from_rows > first:
            staged[first - keep : from_rows - keep] = features[first - 1 : from_rows - 1]
        self.target_rows_fed += max(from_rows - first, 0)
        first_chained = max(first, from_rows)
        end_chained = min(len(committed), common + 1, len(chained) + 1)
        if end_chained > first_chained:
            g_rows = chained.view()[first_chained - 1 : end_chained - 1]
            staged[first_chained - keep : end_chained - keep] = g_rows
        self.rows_without_target += len(committed) - max(first, from_rows)
        chained.truncate(keep)
        self._next_features[request_id] = staged
        if keep <= from_target:  # the prefix from target features continues through the feed
            self._num_from_target[request_id] = max(keep, from_rows)
        return committed[keep:]

    def _forward(self, feeds: dict[Hashable, list[int]]) -> dict[Hashable, torch.Tensor]:
        ones = {request_id: 1 for request_id in feeds}
        sizes = {request_id: len(tokens) for request_id, tokens in feeds.items()}
        features = {request_id: self._next_features[request_id] for request_id in feeds}
        logits, hidden = self.runner.forward(feeds, ones, num_hidden=sizes, features=features)
        for request_id, rows in hidden.items():  # each [len(feed), hidden]
            chained = self._chained[request_id]
            chained.write(len(chained), rows)
            # Chained: the next position (this step's draft token) reads this one's output g.
            self._next_features[request_id] = rows[-1:]
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
            self._chained.pop(request_id, None)
