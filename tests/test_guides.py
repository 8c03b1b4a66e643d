"""Guides vs an independent NumPy implementation of docs/design.md §2 (float64), plus invariants.

The NumPy references below use loops and numpy's own percentile/std; they never call
sage_jax. Random noise is drawn with the key convention documented in sage_jax.rl.guides
(token: normal(key); random: split(key) -> (gate, noise)), then fed to the NumPy formula.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.rl import guide_configs, guide_norm, guides

pytestmark = pytest.mark.usefixtures("x64")  # float64 references (tests/conftest.py)


# ------------------------------------------------------------------ independent references


def np_branch(H, m, ratio=0.3, threshold=1.2, q_min=0.6, q_max=1.4):
    q = np.ones_like(H, dtype=np.float64)
    for b in range(H.shape[0]):
        for t in range(H.shape[1]):
            if m[b, t]:
                q[b, t] = min(max(1.0 + ratio * max(H[b, t] - threshold, 0.0), q_min), q_max)
    return q


def np_norm_row(s, norm):
    """s: 1-D array of the row's real tokens only."""
    n = len(s)
    if n == 0:
        return s.copy()
    if norm == "minmax":
        lo, hi = np.percentile(s, 5), np.percentile(s, 95)
        if hi - lo <= 0:
            return np.zeros(n)
        return (np.clip(s, lo, hi) - lo) / (hi - lo)
    if norm == "rank":
        if n == 1:
            return np.zeros(1)
        out = np.zeros(n)
        for i in range(n):
            less = sum(1 for j in range(n) if s[j] < s[i])
            eq = sum(1 for j in range(n) if s[j] == s[i])
            out[i] = (less + (eq - 1) / 2.0) / (n - 1)
        return out
    if norm == "zscore":
        z = (s - s.mean()) / (s.std() + 1e-6)
        return 1.0 / (1.0 + np.exp(-z))
    raise AssertionError(norm)


def np_token(s, m, eps_noise, alpha, sigma, norm, q_min=0.6, q_max=1.4):
    q = np.ones_like(s, dtype=np.float64)
    for b in range(s.shape[0]):
        idx = np.nonzero(m[b])[0]
        w = np_norm_row(s[b, idx].astype(np.float64), norm)
        for k, t in enumerate(idx):
            v = 1.0 + alpha * w[k] + sigma * w[k] * eps_noise[b, t]
            q[b, t] = min(max(v, q_min), q_max)
    return q


def np_random(m, u, z, eps, sigma, q_min=0.6, q_max=1.4):
    q = np.ones(m.shape)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t] and u[b, t] < eps:
                q[b, t] = min(max(1.0 + sigma * z[b, t], q_min), q_max)
    return q


def np_cosine(s, max_steps, ub, lb, N=8, decay=0.9):
    L = max(1, max_steps // N)
    c = min(s // L, N - 1)
    u = (s % L) / L
    return lb + (ub * decay**c - lb) * (1 + math.cos(math.pi * u)) / 2


# ------------------------------------------------------------------ fixtures


def make_batch(seed=0, B=6, T=23, ties=False):
    rng = np.random.default_rng(seed)
    x = rng.gamma(2.0, 1.0, size=(B, T))
    if ties:
        x = np.round(x, 0)  # many exact ties
    lens = rng.integers(0, T + 1, size=B)
    lens[0], lens[1], lens[2] = 0, 1, T  # all-masked row, one-token row, full row
    m = np.arange(T)[None, :] < lens[:, None]
    m[3] = rng.random(T) < 0.5  # a ragged (non-contiguous) mask too
    x[4, :] = 2.5  # constant row
    garbage = x.copy()
    garbage[~m] = np.where(rng.random((~m).sum()) < 0.5, np.nan, np.inf)
    return x, m, garbage


# ------------------------------------------------------------------ branch


def test_branch_matches_numpy_with_padding_garbage():
    H, m, Hg = make_batch(1)
    got = np.asarray(guides.branch_q(jnp.asarray(Hg), jnp.asarray(m)))
    np.testing.assert_allclose(got, np_branch(H, m), rtol=0, atol=1e-12)
    got2 = np.asarray(guides.branch_q(jnp.asarray(Hg), jnp.asarray(m), 0.5, 0.8, 0.9, 1.25))
    np.testing.assert_allclose(got2, np_branch(H, m, 0.5, 0.8, 0.9, 1.25), rtol=0, atol=1e-12)
    assert np.all(got[~m] == 1.0)


def test_branch_threshold_and_clamp_values():
    H = jnp.array([[0.0, 1.2, 1.5, 10.0]])
    m = jnp.ones((1, 4), bool)
    q = np.asarray(guides.branch_q(H, m))
    np.testing.assert_allclose(q, [[1.0, 1.0, 1.09, 1.4]], atol=1e-12)


# ------------------------------------------------------------------ token


@pytest.mark.parametrize("norm", guide_norm.NORMS)
@pytest.mark.parametrize("ties", [False, True])
def test_token_matches_numpy(norm, ties):
    s, m, sg = make_batch(2, ties=ties)
    key = jax.random.PRNGKey(7)
    alpha, sigma = 0.3, 0.25
    eps_noise = np.asarray(jax.random.normal(key, s.shape, dtype=jnp.float64))
    got = np.asarray(guides.token_q(jnp.asarray(sg), jnp.asarray(m), key, alpha, sigma, norm))
    want = np_token(s, m, eps_noise, alpha, sigma, norm)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    assert np.all(got[~m] == 1.0) and np.all(np.isfinite(got))


@pytest.mark.parametrize("norm", guide_norm.NORMS)
def test_normalisation_weights_match_numpy(norm):
    # Wide clamp so w itself is visible: q = 1 + 1 * w exactly.
    s, m, sg = make_batch(3, B=8, T=40)
    w = np.asarray(guide_norm.normalize_per_sequence(jnp.asarray(sg), jnp.asarray(m), norm))
    for b in range(s.shape[0]):
        idx = np.nonzero(m[b])[0]
        np.testing.assert_allclose(w[b, idx], np_norm_row(s[b, idx], norm), atol=1e-12)
        assert np.all(w[b, ~m[b]] == 0)
        assert np.all((w[b] >= 0) & (w[b] <= 1))
    q = np.asarray(guides.token_q(jnp.asarray(sg), jnp.asarray(m), jax.random.PRNGKey(0),
                                  1.0, 0.0, norm, q_min=0.5, q_max=3.0))
    np.testing.assert_allclose(q[m], 1.0 + w[m], atol=1e-12)


def test_minmax_clips_outliers_to_percentiles():
    s = np.concatenate([np.linspace(0.0, 1.0, 19), [100.0]])[None, :]
    m = np.ones_like(s, bool)
    w = np.asarray(guide_norm.normalize_per_sequence(jnp.asarray(s), jnp.asarray(m), "minmax"))
    lo, hi = np.percentile(s[0], 5), np.percentile(s[0], 95)
    assert abs(w[0, -1] - 1.0) < 1e-12 and w[0, 0] == 0.0 
    # The outlier does not squash the rest: without clipping w[-2] would be ~0.01.
    np.testing.assert_allclose(w[0, -2], (1.0 - lo) / (hi - lo), atol=1e-12)
    assert w[0, -2] > 0.15
    np.testing.assert_allclose(w[0, 10], (s[0, 10] - lo) / (hi - lo), atol=1e-12)


def test_token_gradient_is_stopped():
    s, m, _ = make_batch(4)
    f = lambda x: guides.token_q(x, jnp.asarray(m), jax.random.PRNGKey(0), 0.3, 0.25).sum()
    g = jax.grad(f)(jnp.asarray(s))
    assert np.all(np.asarray(g) == 0)
    gb = jax.grad(lambda x: guides.branch_q(x, jnp.asarray(m)).sum())(jnp.asarray(s) + 1.0)
    assert np.all(np.asarray(gb) == 0)


# ------------------------------------------------------------------ random


def test_random_matches_numpy():
    _, m, _ = make_batch(5, B=7, T=31)
    key = jax.random.PRNGKey(11)
    kg, kn = jax.random.split(key)
    u = np.asarray(jax.random.uniform(kg, m.shape, dtype=jnp.float64))
    z = np.asarray(jax.random.normal(kn, m.shape, dtype=jnp.float64))
    for eps, sigma in [(0.1, 0.15), (0.5, 0.4), (0.0, 0.2), (1.0, 0.05)]:
        got = np.asarray(guides.random_q(jnp.asarray(m), key, eps, sigma, dtype=jnp.float64))
        np.testing.assert_allclose(got, np_random(m, u, z, eps, sigma), rtol=0, atol=1e-12)


def test_random_gate_rate():
    m = jnp.ones((128, 128), bool)
    q = guides.random_q(m, jax.random.PRNGKey(3), 0.3, 0.15, dtype=jnp.float64)
    frac = float((q != 1.0).mean())
    assert abs(frac - 0.3) < 0.015  # ~4 binomial std
    q0 = guides.random_q(m, jax.random.PRNGKey(3), 0.0, 0.15)
    assert np.all(np.asarray(q0) == 1.0)


# ------------------------------------------------------------------ schedule


@pytest.mark.parametrize("max_steps", [80, 85, 5, 1, 1000])
def test_cosine_schedule_matches_formula(max_steps):
    steps = sorted(set([0, 1, 4, 5, 9, 10, 11, 19, 20, 69, 70, 79, 80, 84, 85, 100, 999, 1500]))
    f = jax.jit(lambda s: guide_configs.cosine_schedule(s, max_steps, 0.3, 0.1))
    for s in steps:
        want = np_cosine(s, max_steps, 0.3, 0.1)
        assert abs(float(f(jnp.asarray(s))) - want) < 1e-12, (max_steps, s)
        assert abs(float(guide_configs.cosine_schedule(s, max_steps, 0.1, 0.0, 4, 0.5))
                   - np_cosine(s, max_steps, 0.1, 0.0, 4, 0.5)) < 1e-12


def test_cosine_schedule_restarts_and_decay():
    v = [float(guide_configs.cosine_schedule(s, 80, 0.3, 0.1)) for s in range(80)]
    # Each cycle starts at ub * decay^c and decreases monotonically within its 10 steps.
    for c in range(8):
        np.testing.assert_allclose(v[10 * c], 0.3 * 0.9**c, atol=1e-12)
        assert all(v[10 * c + i] > v[10 * c + i + 1] for i in range(9))
    assert v[10] > v[9]  # restart
    # Traced max_steps works too and agrees.
    g = jax.jit(guide_configs.cosine_schedule, static_argnums=(2, 3))
    assert abs(float(g(jnp.asarray(37), jnp.asarray(80), 0.3, 0.1)) - v[37]) < 1e-12


# ------------------------------------------------------------------ registry / compute_log_q


def _inputs(seed=6, step=13, max_steps=80):
    H, m, Hg = make_batch(seed)
    rng = np.random.default_rng(seed + 100)
    lp = -rng.gamma(2.0, 1.0, size=H.shape)
    ref = -rng.gamma(2.0, 1.0, size=H.shape)
    Href = rng.gamma(2.0, 1.0, size=H.shape)
    lp_g, ref_g = lp.copy(), ref.copy()
    lp_g[~m], ref_g[~m] = np.nan, -np.inf
    inp = guides.GuideInputs(
        mask_BxT=jnp.asarray(m), step=jnp.asarray(step), max_steps=max_steps,
        key=jax.random.PRNGKey(21), entropy_BxT=jnp.asarray(Hg), logp_BxT=jnp.asarray(lp_g),
        ref_logp_BxT=jnp.asarray(ref_g), ref_entropy_BxT=jnp.asarray(Href))
    return inp, dict(H=H, m=m, lp=lp, ref=ref, Href=Href)


def test_compute_log_q_branch_sources():
    inp, d = _inputs()
    f = jax.jit(guides.compute_log_q, static_argnums=(0, 1))
    for source, H in [("new", d["H"]), ("ref", d["Href"])]:
        log_q, q = f("branch", guide_configs.BranchConfig(source=source), inp)
        np.testing.assert_allclose(np.asarray(q), np_branch(H, d["m"]), atol=1e-12)
        np.testing.assert_allclose(np.asarray(log_q), np.log(np_branch(H, d["m"])), atol=1e-12)
        assert np.all(np.asarray(log_q)[~d["m"]] == 0.0)


@pytest.mark.parametrize("norm", guide_norm.NORMS)
@pytest.mark.parametrize("source", guide_configs.SOURCES)
def test_compute_log_q_token_uses_schedule_from_step(norm, source):
    step, max_steps = 27, 80
    inp, d = _inputs(step=step, max_steps=max_steps)
    cfg = guide_configs.TokenConfig(source=source, norm=norm)
    log_q, q = jax.jit(guides.compute_log_q, static_argnums=(0, 1))("token", cfg, inp)
    alpha = np_cosine(step, max_steps, 0.3, 0.1)
    sigma = np_cosine(step, max_steps, 0.25, 0.1)
    s = -(d["lp"] if source == "new" else d["ref"])
    noise = np.asarray(jax.random.normal(inp.key, s.shape, dtype=jnp.float64))
    want = np_token(s, d["m"], noise, alpha, sigma, norm)
    np.testing.assert_allclose(np.asarray(q), want, atol=1e-10)
    np.testing.assert_allclose(np.asarray(log_q), np.log(want), atol=1e-10)


def test_compute_log_q_random_uses_schedule_from_step():
    step, max_steps = 45, 80
    inp, d = _inputs(step=step, max_steps=max_steps)
    _, q = guides.compute_log_q("random", guide_configs.RandomConfig(), inp)
    eps = np_cosine(step, max_steps, 0.1, 0.0)
    sigma = np_cosine(step, max_steps, 0.15, 0.05)
    kg, kn = jax.random.split(inp.key)
    u = np.asarray(jax.random.uniform(kg, d["m"].shape, dtype=jnp.float64))
    z = np.asarray(jax.random.normal(kn, d["m"].shape, dtype=jnp.float64))
    np.testing.assert_allclose(np.asarray(q), np_random(d["m"], u, z, eps, sigma), atol=1e-12)


def test_none_guide_is_identity_and_all_guides_safe():
    inp, d = _inputs()
    log_q, q = guides.compute_log_q("none", None, inp)
    assert np.all(np.asarray(q) == 1.0) and np.all(np.asarray(log_q) == 0.0)
    for name in ("none", "branch", "token", "random"):
        log_q, q = guides.compute_log_q(name, None, inp)
        q, log_q = np.asarray(q), np.asarray(log_q)
        assert np.all(np.isfinite(log_q)), name
        assert np.all(q[~d["m"]] == 1.0), name
        assert np.all(q[0] == 1.0), name  # the all-masked row
        assert np.all((q >= 0.6) & (q <= 1.4)), name
    # All-masked batch.
    inp0 = inp.replace(mask_BxT=jnp.zeros_like(inp.mask_BxT))
    for name in ("branch", "token", "random"):
        _, q = guides.compute_log_q(name, None, inp0)
        assert np.all(np.asarray(q) == 1.0)
    met = guides.guide_metrics(jnp.ones((2, 3)), jnp.zeros((2, 3), bool))
    assert all(np.isfinite(float(v)) for v in met.values())


def test_guide_metrics():
    q = jnp.array([[1.0, 1.2, 0.7], [1.0, 9.0, 1.0]])
    m = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
    met = guides.guide_metrics(q, m)
    np.testing.assert_allclose(float(met["q_mean"]), (1 + 1.2 + 0.7 + 1) / 4)
    np.testing.assert_allclose(float(met["q_max"]), 1.2)
    np.testing.assert_allclose(float(met["q_min"]), 0.7)
    np.testing.assert_allclose(float(met["frac_shaped"]), 0.5)
    # shares of the 4 real tokens: first tokens (1.0, 1.0) none shaped; later 1.2, 0.7 shaped (9.0 is padding)
    np.testing.assert_allclose(float(met["frac_shaped_first"]), 0.0)
    np.testing.assert_allclose(float(met["frac_shaped_later"]), 2 / 4)
    met = guides.guide_metrics(jnp.array([[1.3, 1.0, 1.0], [1.0, 1.0, 0.9]]), jnp.ones((2, 3), bool))
    np.testing.assert_allclose([float(met[k]) for k in ("frac_shaped", "frac_shaped_first", "frac_shaped_later")],
                               [2 / 6, 1 / 6, 1 / 6])


def test_compute_log_q_stops_gradient():
    inp, _ = _inputs()

    def f(h):
        return guides.compute_log_q("branch", None, inp.replace(entropy_BxT=h))[0].sum()

    g = jax.grad(f)(jnp.nan_to_num(inp.entropy_BxT, nan=0.0, posinf=0.0) + 2.0)
    assert np.all(np.asarray(g) == 0)


def test_register_custom_guide_by_name():
    @dataclasses.dataclass(frozen=True)
    class ScaledEntropy(guide_configs.GuideConfig):
        scale: float = 0.1  # q per nat

    @guides.register_guide("_test_scaled_entropy", ScaledEntropy, overwrite=True)
    def _fn(cfg, inputs):
        return 1.0 + cfg.scale * inputs.entropy_BxT  # unclamped, garbage on padding

    inp, d = _inputs()
    cfg = guides.make_guide_config("_test_scaled_entropy", scale=0.05, q_max=1.2)
    assert hash(cfg) == hash(guides.make_guide_config("_test_scaled_entropy", scale=0.05,
                                                      q_max=1.2))
    _, q = jax.jit(guides.compute_log_q, static_argnums=(0, 1))("_test_scaled_entropy", cfg, inp)
    want = np.where(d["m"], np.clip(1 + 0.05 * d["H"], 0.6, 1.2), 1.0)
    np.testing.assert_allclose(np.asarray(q), want, atol=1e-12)
    assert "_test_scaled_entropy" in guides.available_guides()
    with pytest.raises(ValueError, match="already registered"):
        guides.register_guide("_test_scaled_entropy", ScaledEntropy)(_fn)


def test_config_validation_errors():
    with pytest.raises(ValueError, match="unknown guide='nope'"):
        guides.get_guide("nope")
    with pytest.raises(ValueError, match=r"BranchConfig.q_min=1.5 must be <= BranchConfig.q_max"):
        guide_configs.BranchConfig(q_min=1.5, q_max=1.4)
    with pytest.raises(ValueError, match="q_min must be > 0"):
        guide_configs.TokenConfig(q_min=0.0)
    with pytest.raises(ValueError, match="TokenConfig.norm='l2'"):
        guide_configs.TokenConfig(norm="l2")
    with pytest.raises(ValueError, match="source='old'"):
        guide_configs.BranchConfig(source="old")
    with pytest.raises(ValueError, match="RandomConfig.eps_ub"):
        guide_configs.RandomConfig(eps_ub=1.5)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['ratoi'\]"):
        guides.make_guide_config("branch", ratoi=0.1)
    with pytest.raises(ValueError, match="unknown norm"):
        guides.token_q(jnp.ones((1, 2)), jnp.ones((1, 2)), jax.random.PRNGKey(0), 0.1, 0.1, "bad")
    with pytest.raises(ValueError, match=r"q_min=2.0 must be <= q_max=1.0"):
        guides.branch_q(jnp.ones((1, 2)), jnp.ones((1, 2)), q_min=2.0, q_max=1.0)
    with pytest.raises(TypeError, match="expects a TokenConfig"):
        guides.compute_log_q("token", guide_configs.BranchConfig(), _inputs()[0])
    inp, _ = _inputs()
    with pytest.raises(ValueError, match="needs GuideInputs.ref_entropy_BxT"):
        guides.compute_log_q("branch", guide_configs.BranchConfig(source="ref"),
                             inp.replace(ref_entropy_BxT=None))


def test_config_from_ml_collections():
    ml_collections = pytest.importorskip("ml_collections")
    sage = ml_collections.ConfigDict(dict(guide="token", token=dict(norm="rank", alpha_ub=0.5)))
    cfg = guides.make_guide_config(sage.guide, **sage.token)
    assert cfg == guide_configs.TokenConfig(norm="rank", alpha_ub=0.5)
    sched = cfg.schedule(jnp.asarray(0), 80)
    np.testing.assert_allclose(float(sched["alpha"]), 0.5)
    np.testing.assert_allclose(float(sched["sigma"]), 0.25)
