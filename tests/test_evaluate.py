"""Unit tests of the evaluation metrics: pass@k exactness, answer extraction, maj@k, bootstrap."""

import math
from fractions import Fraction

import numpy as np
import pytest

from sage_jax.eval import metrics as em
from sage_jax.eval.metrics import default_ks, pass_at_k
from sage_jax.rewards.boxed import extract_boxed_answer


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def _grid():
    for n in (1, 2, 3, 5, 8, 10, 31, 64, 100, 257, 512, 1000, 1023, 1024):
        ks = sorted({1, 2, 4, 8, 16, 64, 256, n // 3, n // 2, n - 1, n} & set(range(1, n + 1)))
        for k in ks:
            cs = {0, 1, 2, 3, n // 7, n // 2, n - k - 1, n - k, n - k + 1, n - 1, n}
            for c in sorted(x for x in cs if 0 <= x <= n):
                yield n, c, k


GRID = list(_grid())


def test_pass_at_k_matches_exact_fractions_on_grid():
    n, c, k = (np.array(x) for x in zip(*GRID))
    got = pass_at_k(n, c, k)  # one vectorised call over the whole grid
    want = np.array([float(exact_pass_at_k(*t)) for t in GRID])
    assert got.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert any(t[0] == 1024 for t in GRID) and any(t[2] == t[0] for t in GRID)


def test_pass_at_k_scalar_calls_and_exact_edges():
    for t in GRID[::37]:
        assert abs(float(pass_at_k(*t)) - float(exact_pass_at_k(*t))) < 1e-12
    assert pass_at_k(1024, 0, 1024) == 0.0 and pass_at_k(1024, 0, 1) == 0.0
    assert pass_at_k(1024, 1024, 1) == 1.0 and pass_at_k(1024, 1, 1024) == 1.0
    assert pass_at_k(1024, 3, 1022) == 1.0  # n - c < k: every draw of k hits a correct one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)
    assert isinstance(pass_at_k(4, 2, 2), np.floating)
    # Tiny but nonzero values keep their relative precision (no 1 - (1 - eps) cancellation).
    assert pass_at_k(1024, 1, 1) == pytest.approx(1 / 1024, rel=1e-12)


def test_pass_at_k_broadcasts():
    out = pass_at_k(16, np.arange(17)[:, None], np.array([1, 2, 4, 8, 16])[None, :])
    assert out.shape == (17, 5)
    assert np.all(np.diff(out, axis=0) >= 0) and np.all(np.diff(out, axis=1) >= 0)  # monotone in c, k
    np.testing.assert_allclose(out[:, 0], np.arange(17) / 16, atol=1e-15)


@pytest.mark.parametrize("n,c,k", [(20, 3, 5), (50, 1, 10), (12, 6, 3), (1024, 2, 300)])
def test_pass_at_k_matches_simulation_without_replacement(n, c, k):
    rng = np.random.default_rng(0)
    draws = 20_000
    correct = np.zeros(n, bool)
    correct[:c] = True
    # k distinct samples per draw: the first k of a random permutation.
    picks = np.argsort(rng.random((draws, n)), axis=1)[:, :k]
    freq = correct[picks].any(axis=1).mean()
    p = float(pass_at_k(n, c, k))
    assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / draws) + 1e-9


@pytest.mark.parametrize("n,c,k,msg", [
    (4, 1, 5, "k must be <= n"), (4, 1, 0, "k must be >= 1"), (4, 5, 2, "0 <= c <= n"),
    (4, -1, 2, "0 <= c <= n"), (4, 1.5, 2, "integers"),
])
def test_pass_at_k_rejects_invalid(n, c, k, msg):
    with pytest.raises(ValueError, match=msg):
        pass_at_k(n, c, k)


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(1024)[-1] == 1024 and len(default_ks(1024)) == 11
    assert default_ks(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        default_ks(0)


@pytest.mark.parametrize("text,want", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{ \{1,  2\} }", r"\{1, 2\}"),  # escaped braces do not close the box
    (r"$\boxed 5$", "5"),
    (r"\fbox{x+1}", "x+1"),
    (r"\boxed{3} and later \boxed{unfinished", "3"),  # truncated final box: the previous one
    (r"\boxed{unfinished", None),
    ("no box at all", None),
    (r"\boxed{}", None),
    (r"\boxed{a\\{b}}", r"a\\{b}"),  # \\ is a TeX line break, so the { after it counts
    (r"\boxedx{3}", None),
    ("\\boxed{\n  x \n=\t1 }", "x = 1"),
])
def test_extract_boxed_answer(text, want):
    assert extract_boxed_answer(text) == want


def _maj(answers, correct, ks, resamples=10_000, seed=0):
    return em.majority_at_k(answers, np.array(correct, bool), ks, resamples, np.random.default_rng(seed))


def test_majority_exact_by_hand():
    # A correct, B wrong, 2-2 tie: A appears first so A wins ties. k=2: {A,A}, {B,B}, 4x{A,B}.
    np.testing.assert_allclose(_maj(["A", "B", "A", "B"], [1, 0, 1, 0], [1, 2, 3, 4]),
                               [1 / 2, 5 / 6, 1 / 2, 1.0])
    # B more frequent: it wins every tie, so a single correct A never wins k >= 2.
    np.testing.assert_allclose(_maj(["B", "A", "B", "B"], [0, 1, 0, 0], [1, 2, 4]), [1 / 4, 0, 0])
    # Abstentions: the vote is correct iff the subset holds a correct answer -> pass@k.
    np.testing.assert_allclose(_maj(["A", None, None, None, None], [1, 0, 0, 0, 0], [1, 2, 3, 5]),
                               pass_at_k(5, 1, np.array([1, 2, 3, 5])), atol=1e-15)
    np.testing.assert_allclose(_maj([None, None], [0, 0], [1, 2]), [0, 0])


def test_majority_k3_by_hand():
    # [A, B, A, B] with A correct, k = 3: every 3-subset has two of one answer -> 2 of 4 have AA.
    assert _maj(["A", "B", "A", "B"], [1, 0, 1, 0], [3])[0] == pytest.approx(0.5)


def test_majority_monte_carlo_close_to_exact():
    # n = 40 with 12 correct "A", 10 "B", 18 distinct wrong singletons; compare MC with enumeration-free
    # exact value for k = 2: A wins iff both A, or A with a singleton, or A+B tie (A has more overall).
    answers = ["A"] * 12 + ["B"] * 10 + [f"w{i}" for i in range(18)]
    correct = [1] * 12 + [0] * 28
    n, a, b, s = 40, 12, 10, 18
    exact_k2 = (math.comb(a, 2) + a * s + a * b) / math.comb(n, 2)
    got = _maj(answers, correct, [2], resamples=700)[0]  # C(40, 2) = 780 > 700: Monte Carlo
    assert abs(got - exact_k2) < 0.06
    assert _maj(answers, correct, [2], resamples=780)[0] == pytest.approx(exact_k2, abs=1e-12)
    # Deterministic under a fixed seed.
    assert _maj(answers, correct, [8], 300, seed=3)[0] == _maj(answers, correct, [8], 300, seed=3)[0]


def test_bootstrap_ci_is_calibrated_and_deterministic():
    rng = np.random.default_rng(1)
    x = (rng.random(400) < 0.3).astype(float)
    w = em.bootstrap_weights(400, 2000, seed=7)
    assert np.all(w.sum(axis=1) == 400)
    stats, reps = em.summarize_columns({"x": x, "const": np.full(400, 0.25)}, w, 0.95)
    half = 1.96 * math.sqrt(x.mean() * (1 - x.mean()) / 400)
    assert stats["x"]["mean"] == pytest.approx(x.mean())
    assert stats["x"]["lo"] == pytest.approx(x.mean() - half, abs=0.01)
    assert stats["x"]["hi"] == pytest.approx(x.mean() + half, abs=0.01)
    assert stats["const"] == {"mean": 0.25, "lo": 0.25, "hi": 0.25}
    np.testing.assert_array_equal(em.bootstrap_weights(400, 10, 7), em.bootstrap_weights(400, 10, 7))
    # NaN entries are left out of a replicate mean.
    s2, _ = em.summarize_columns({"y": np.array([1.0, np.nan, 3.0])}, em.bootstrap_weights(3, 50, 0), 0.95)
    assert s2["y"]["mean"] == 2.0
