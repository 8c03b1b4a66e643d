"""Pure metric functions of the evaluation: pass@k, maj@k, answer extraction, bootstrap CIs.

Dimension key (docs/design.md §5.4, as in training: a problem is a prompt, its samples a group): `N` problems,
`G` samples of one problem, `L` values of k, `R` resamples (bootstrap draws or vote subsets), `E` metric
columns; a lower-case suffix is a size held in a local variable (`k` samples per vote subset, `m` distinct
answers).

Definitions (per problem with `n` samples of which `c` are verified correct):

- pass@k = `1 - C(n-c, k) / C(n, k)`: the probability that at least one of `k` samples drawn
  without replacement from the `n` is correct (the unbiased estimator of Chen et al. 2021).
- mean@n = `c / n`, the mean accuracy of the samples; it equals pass@1 exactly.
- maj@k: the expected accuracy of a majority vote over the final answers of a uniformly random
  subset of `k` of the `n` samples (see `majority_at_k` for the vote and its tie-break).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Bound on the size of the temporary [rows, c_max] matrix in `pass_at_k` (float64 elements).
_MAX_CHUNK_ELEMS = 1 << 22


def _as_int_array(name: str, x) -> np.ndarray:
    """`x` as an int64 array, or a ValueError when it holds a non-integer value."""
    a = np.asarray(x)
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    if a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a)):
        return a.astype(np.int64)
    raise ValueError(f"pass_at_k: {name} must hold integers, got {a!r}")


def pass_at_k(n, c, k):
    """Unbiased pass@k `1 - C(n-c, k) / C(n, k)`, broadcast over numpy arrays `n`, `c`, `k`.

    Computed as `1 - prod_{i=n-c+1}^{n} (1 - k/i)` in log space (`-expm1(sum log1p(-k/i))`),
    which never forms a binomial coefficient, so it cannot overflow and stays within ~1e-13 of
    the exact rational value for n up to several thousand. `c = 0` gives 0 and `n - c < k`
    gives 1 exactly. Raises ValueError unless `0 <= c <= n` and `1 <= k <= n`.
    Returns a float64 array of the broadcast shape (a numpy scalar for scalar inputs).
    """
    n_a, c_a, k_a = np.broadcast_arrays(
        _as_int_array("n", n), _as_int_array("c", c), _as_int_array("k", k)
    )
    if np.any(k_a < 1):
        raise ValueError(f"pass_at_k: k must be >= 1, got k={k_a[k_a < 1].ravel()[:5]}")
    if np.any(k_a > n_a):
        bad = np.argwhere(k_a > n_a)[0]
        raise ValueError(
            f"pass_at_k: k must be <= n (cannot draw {k_a[tuple(bad)]} of {n_a[tuple(bad)]} samples)"
        )
    if np.any((c_a < 0) | (c_a > n_a)):
        raise ValueError("pass_at_k: the correct count c must satisfy 0 <= c <= n")
    shape = n_a.shape
    triples = np.stack([n_a.ravel(), c_a.ravel(), k_a.ravel()], axis=-1)
    if triples.shape[0] == 0:
        return np.zeros(shape, np.float64)
    # Many (problem, k) pairs share a triple; compute each distinct one once.
    uniq, inverse = np.unique(triples, axis=0, return_inverse=True)
    values = _pass_at_k_distinct(uniq)
    out = values[inverse.ravel()].reshape(shape)
    return out[()] if shape == () else out


def _pass_at_k_distinct(triples: np.ndarray) -> np.ndarray:
    """pass@k for rows `(n, c, k)` of an [U, 3] int array (already validated)."""
    n, c, k = triples[:, 0], triples[:, 1], triples[:, 2]
    out = np.where(n - c < k, 1.0, 0.0)  # c = 0 stays 0; n - c < k is certain success
    # k = 1 is exactly c / n (also keeps pass@1 bit-identical to mean@n).
    out = np.where((k == 1) & (n - c >= k), c / n, out)
    todo = np.flatnonzero((c > 0) & (n - c >= k) & (k > 1))
    if todo.size == 0:
        return out
    c_max = int(c[todo].max())
    rows_per_chunk = max(1, _MAX_CHUNK_ELEMS // c_max)
    j = np.arange(c_max)
    for start in range(0, todo.size, rows_per_chunk):
        rows = todo[start : start + rows_per_chunk]
        i = (n[rows] - c[rows] + 1)[:, None] + j[None, :]  # i runs over n-c+1 .. n
        valid = j[None, :] < c[rows][:, None]
        # Here i >= n-c+1 > k, so every factor 1 - k/i lies in (0, 1).
        # Padding columns get an infinite denominator, i.e. a factor of exactly 1.
        terms = np.log1p(-k[rows][:, None] / np.where(valid, i, np.inf))
        out[rows] = -np.expm1(terms.sum(axis=1))
    return out


def default_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, with n itself appended when it is not a power of two."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def majority_at_k(
    answers: Sequence[str | None],
    correct: np.ndarray,
    ks: Sequence[int],
    resamples: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """maj@k for one problem: expected accuracy of a majority vote over a random k-subset.

    The vote counts the final answers (None = no answer, which abstains) of the subset; the
    most frequent answer wins. Ties are broken by a fixed order of the answers that does not
    depend on the subset: more frequent among all `n` samples first, then earlier first
    appearance. A subset where every sample abstains is wrong. An answer is correct when any of
    its samples was verified correct. The expectation is exact for k = 1 and whenever
    `C(n, k) <= resamples` (all subsets enumerated, so k = n is exact); otherwise it is a
    Monte-Carlo mean over `resamples` random subsets drawn from `rng`. Returns float64 [K].
    """
    n = len(answers)
    correct_G = np.asarray(correct, dtype=bool)
    if correct_G.shape != (n,):
        raise ValueError(f"majority_at_k: {n} answers but correctness of shape {correct_G.shape}")
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
            first.setdefault(a, i)
    order = sorted(counts, key=lambda a: (-counts[a], first[a]))  # id 0 wins every tie
    m = len(order)
    out = np.zeros(len(ks), np.float64)
    if m == 0:
        return out
    rank = {a: r for r, a in enumerate(order)}
    ids_G = np.array([rank[a] if a is not None else m for a in answers], np.int64)  # m = abstain
    ans_correct = np.zeros(m + 1, bool)
    np.logical_or.at(ans_correct, ids_G, correct_G)
    ans_correct[m] = False
    perms_RxG = None
    for j, k in enumerate(ks):
        if not 1 <= k <= n:
            raise ValueError(f"majority_at_k: k={k} outside 1..n={n}")
        if k == 1:
            out[j] = ans_correct[ids_G].mean()
            continue
        if math.comb(n, k) <= resamples:
            subsets_Rxk = np.array(list(itertools.combinations(range(n), k)), np.int64)
        else:
            if perms_RxG is None:  # prefixes of one set of permutations serve every k
                perms_RxG = rng.permuted(np.tile(np.arange(n), (resamples, 1)), axis=1)
            subsets_Rxk = perms_RxG[:, :k]
        out[j] = _vote_accuracy(ids_G[subsets_Rxk], m, ans_correct)
    return out


def _vote_accuracy(ids_Rxk: np.ndarray, m: int, ans_correct: np.ndarray) -> float:
    """Mean correctness of the majority answer of each row of answer ids (id m abstains)."""
    r = ids_Rxk.shape[0]
    flat = (np.arange(r)[:, None] * (m + 1) + ids_Rxk).ravel()
    counts_Rxm = np.bincount(flat, minlength=r * (m + 1)).reshape(r, m + 1)[:, :m]
    winner_R = np.argmax(counts_Rxm, axis=1)  # first maximum = lowest id = the tie-break order
    voted_R = counts_Rxm.max(axis=1) > 0
    return float(np.mean(voted_R & ans_correct[winner_R]))


def bootstrap_weights(num_problems: int, resamples: int, seed: int) -> np.ndarray:
    """[B, P] multiplicities of a bootstrap over problems (each row sums to P)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(num_problems, np.full(num_problems, 1.0 / num_problems), size=resamples)


def bootstrap_means(values_NxE: np.ndarray, weights_RxN: np.ndarray) -> np.ndarray:
    """[B, M] replicate means of each metric column; NaN entries are left out of a mean."""
    finite = np.isfinite(values_NxE)
    sums = weights_RxN @ np.where(finite, values_NxE, 0.0)
    counts = weights_RxN @ finite.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def percentile_ci(reps_RxE: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval (lo [M], hi [M]) of replicate means."""
    tail = 100.0 * (1.0 - level) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN bounds
        lo, hi = np.nanpercentile(reps_RxE, [tail, 100.0 - tail], axis=0)
    return lo, hi


def nanmean(values: np.ndarray, axis=None):
    """Mean ignoring NaN, NaN (without a warning) when nothing is finite."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=axis)


def summarize_columns(
    per_problem: Mapping[str, np.ndarray], weights_RxN: np.ndarray, level: float
) -> tuple[dict[str, dict[str, float]], np.ndarray]:
    """Mean and bootstrap CI of each per-problem metric [P]; also returns the [B, M] replicates.

    All metrics share the same resampled problems, so differences between them are paired.
    """
    names = list(per_problem)
    values_NxE = np.stack([np.asarray(per_problem[k], np.float64) for k in names], axis=1)
    reps_RxE = bootstrap_means(values_NxE, weights_RxN)
    lo, hi = percentile_ci(reps_RxE, level)
    mean = nanmean(values_NxE, axis=0)
    stats = {
        name: {"mean": float(mean[j]), "lo": float(lo[j]), "hi": float(hi[j])}
        for j, name in enumerate(names)
    }
    return stats, reps_RxE


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from JSON-able parts, identical across processes and machines."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def finite_or_none(x) -> float | None:
    """`float(x)`, or None for None, NaN and infinities (JSON has no NaN)."""
    x = None if x is None else float(x)
    return x if x is not None and math.isfinite(x) else None
