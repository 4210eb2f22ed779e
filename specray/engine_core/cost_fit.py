"""Cost models fitted to measured samples: non-negative least squares over a few columns,
with the prior filling the directions the samples cannot identify (used by
:mod:`specray.engine_core.costs`; the models themselves are in :mod:`~specray.engine_core.policy`).
Pure stdlib."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from specray.engine_core.policy import DraftCost, VerifyCost, _check

_PIVOT_TOL = 1e-10  # on a unit-diagonal Gram matrix: below this the design is rank-deficient


def _dot(left: Sequence[float], right: Sequence[float]) -> float:
    if len(left) != len(right):
        raise ValueError(f"_dot of lengths {len(left)} and {len(right)}")
    return math.fsum(map(operator.mul, left, right))


@dataclass(frozen=True)
class _Gram:
    """What a least-squares fit reads from its samples: the columns' Gram matrix ``x``, their
    products with the targets ``xy`` and the targets' sum of squares ``yy``. Formed once per
    fit (O(samples)); every support and its residual is then O(1) in the samples, so a refit
    over hundreds of samples stays well under a millisecond on the round loop."""

    x: tuple[tuple[float, ...], ...]
    xy: tuple[float, ...]
    yy: float

    @classmethod
    def of(cls, columns: list[list[float]], ys: list[float]) -> _Gram:
        x = tuple(tuple(_dot(a, b) for b in columns) for a in columns)
        return cls(x, tuple(_dot(a, ys) for a in columns), _dot(ys, ys))

    def subset(self, support: Sequence[int]) -> _Gram:
        x = tuple(tuple(self.x[i][j] for j in support) for i in support)
        return _Gram(x, tuple(self.xy[i] for i in support), self.yy)

    def combine(self, free: Sequence[int], tied: Sequence[int], weights: Sequence[float]):
        """The Gram of the ``free`` columns and one more, ``Σ weights[t]·column[tied[t]]``."""
        pairs = list(zip(tied, weights, strict=True))
        comb_x = [math.fsum(w * self.x[i][j] for j, w in pairs) for i in free]
        comb_comb = math.fsum(u * w * self.x[i][j] for i, u in pairs for j, w in pairs)
        x = [[self.x[i][j] for j in free] + [c] for i, c in zip(free, comb_x, strict=True)]
        x.append([*comb_x, comb_comb])
        xy = [self.xy[i] for i in free] + [math.fsum(w * self.xy[j] for j, w in pairs)]
        return _Gram(tuple(tuple(row) for row in x), tuple(xy), self.yy)

    def sse(self, coefs: Sequence[float]) -> float:
        """Σ (y - coefs·row)² = yy - 2 coefs·xy + coefs' x coefs."""
        size = len(coefs)
        quadratic = math.fsum(
            coefs[i] * coefs[j] * self.x[i][j] for i in range(size) for j in range(size)
        )
        return max(self.yy - 2 * _dot(coefs, self.xy) + quadratic, 0.0)


def _least_squares(gram: _Gram) -> list[float] | None:
    """Normal equations by Gaussian elimination; None if the columns are linearly dependent."""
    # Unit-norm columns: features span 1 .. batch*tokens, and the pivot test needs one scale.
    size = len(gram.xy)
    norms = [math.sqrt(gram.x[i][i]) for i in range(size)]
    if min(norms) == 0.0:
        return None
    rows = [  # the augmented Gram matrix of the unit columns
        [gram.x[i][j] / (norms[i] * norms[j]) for j in range(size)] + [gram.xy[i] / norms[i]]
        for i in range(size)
    ]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= _PIVOT_TOL:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col], strict=True)]
    solution = [0.0] * size
    for r in reversed(range(size)):
        solution[r] = (rows[r][size] - _dot(rows[r][r + 1 : size], solution[r + 1 :])) / rows[r][r]
    return [s / n for s, n in zip(solution, norms, strict=True)]


def _nnls(gram: _Gram) -> list[float]:
    """Exact non-negative least squares for a few columns: the NNLS optimum is the
    unconstrained fit on its support, so it is the best feasible fit over all supports."""
    width, best, best_sse = len(gram.xy), [0.0] * len(gram.xy), math.inf
    # Residuals come from the Gram matrix (a difference of sums): a smaller support must
    # beat a larger one by more than that rounding to count as better.
    margin = 1e-12 * gram.yy
    for size in range(width, 0, -1):  # larger supports first: they win ties
        for support in combinations(range(width), size):
            coefs = _least_squares(gram.subset(support))
            if coefs is None or min(coefs) < 0.0:
                continue
            full = [coefs[support.index(j)] if j in support else 0.0 for j in range(width)]
            sse = gram.sse(full)
            if sse < best_sse - margin:
                best, best_sse = full, sse
    return best


def _fit_linear(columns: list[list[float]], ys: list[float], prior: list[float]) -> list[float]:
    """Non-negative least squares; directions the samples cannot identify keep the prior's
    shape. E.g. verify samples all at t = 3 tokens confound per_request_s and per_token_s (the
    data only sees per_request_s + 3 * per_token_s), so that pair is fitted as one multiplier on
    the prior's pair; with one distinct point everything is confounded: the prior is scaled."""
    if not ys:
        return list(prior)
    gram = _Gram.of(columns, ys)
    width = len(prior)
    if _least_squares(gram) is not None:
        return _nnls(gram)
    # Coefficient j is confounded when the other columns alone are still independent.
    others = [[i for i in range(width) if i != j] for j in range(width)]
    tied = [j for j in range(width) if _least_squares(gram.subset(others[j])) is not None]
    tied = tied or list(range(width))
    weights = [prior[j] for j in tied]
    if not any(weights):  # a zero prior has no shape to keep: put it on one coefficient
        weights = [1.0] + [0.0] * (len(tied) - 1)
    free = [j for j in range(width) if j not in tied]
    *free_coefs, scale = _nnls(gram.combine(free, tied, weights))
    fitted = dict(zip(free, free_coefs, strict=True))
    fitted.update({j: scale * w for j, w in zip(tied, weights, strict=True)})
    return [fitted[j] for j in range(width)]


def fit_verify_cost(samples: Sequence[tuple[int, int, float]], prior: VerifyCost) -> VerifyCost:
    """Fit (batch, tokens_per_request, seconds) samples, coefficients >= 0; exact least squares
    when batches and token counts vary enough, else the prior fills the unidentified directions.
    E.g. every sample at (batch 4, tokens 3) with mean 0.0132 s, prior (0.01, 0.001, 0.0)
    (0.014 s there): the prior scaled by 0.0132 / 0.014 ≈ 0.943, i.e. (0.00943, 0.000943, 0)."""
    plain = all(
        type(b) is int and type(t) is int and type(y) is float and b >= 1 and t >= 1
        and 0.0 <= y < math.inf
        for b, t, y in samples
    )  # fmt: skip
    if not plain:  # the slow path names the first bad value (and converts ints to floats)
        samples = [
            (
                _check(f"samples[{i}] batch", batch, 1, integer=True),
                _check(f"samples[{i}] tokens_per_request", tokens, 1, integer=True),
                float(_check(f"samples[{i}] seconds", seconds, 0)),
            )
            for i, (batch, tokens, seconds) in enumerate(samples)
        ]
    columns = [
        [1.0] * len(samples),
        [float(b) for b, _, _ in samples],
        [float(b * t) for b, t, _ in samples],
    ]
    ys = [y for _, _, y in samples]
    coefs = _fit_linear(columns, ys, [prior.fixed_s, prior.per_request_s, prior.per_token_s])
    return VerifyCost(*coefs)


def fit_draft_cost(samples: Sequence[tuple[int, float]], prior: DraftCost) -> DraftCost:
    """Fit (batch, seconds per step) samples; a single distinct batch scales the prior."""
    plain = all(type(b) is int and type(y) is float and b >= 1 and 0.0 <= y < math.inf
                for b, y in samples)  # fmt: skip
    if plain:
        batches, ys = [b for b, _ in samples], [y for _, y in samples]
    else:  # the slow path names the first bad value (and converts ints to floats)
        batches = [
            _check(f"samples[{i}] batch", s[0], 1, integer=True) for i, s in enumerate(samples)
        ]
        ys = [float(_check(f"samples[{i}] seconds", s[1], 0)) for i, s in enumerate(samples)]
    columns = [[1.0] * len(ys), [float(batch) for batch in batches]]
    return DraftCost(*_fit_linear(columns, ys, [prior.fixed_s, prior.per_request_s]))
