"""Losses vs an independent NumPy implementation of docs/design.md §2 (float64, tests/loss_reference.py),
gradients vs the analytic NumPy gradient, and the SAGE invariants (guide="none" == GRPO+k3, q > 1 pulls up,
masked tokens get zero gradient, beta = 0 ignores the reference)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loss_reference import make_tensors, np_kl, np_policy_loss

from sage_jax.rl import guides, losses
from sage_jax.rl.losses import LossConfig

pytestmark = pytest.mark.usefixtures("x64")  # float64 references (tests/conftest.py)


_loss_and_grad = jax.jit(
    jax.value_and_grad(losses.policy_loss, has_aux=True), static_argnames=("cfg",)
)


def run(j, cfg, n_batch=None, lp=None):
    return _loss_and_grad(j["lp"] if lp is None else lp, j["old"], j["ref"], j["logq"],
                          j["adv"], j["m"], cfg=cfg, num_batch_tokens=n_batch)


# ------------------------------------------------------------------ per-token KL


@pytest.mark.parametrize("est", losses.ESTIMATORS)
def test_per_token_kl_matches_numpy(est):
    c, _ = make_tensors(1)
    got = losses.per_token_kl(jnp.asarray(c["lp"]), jnp.asarray(c["ref"]), jnp.asarray(c["logq"]),
                              est)
    np.testing.assert_allclose(np.asarray(got), np_kl(c["lp"], c["ref"], c["logq"], est),
                               rtol=1e-12, atol=1e-12)
    got0 = losses.per_token_kl(jnp.asarray(c["lp"]), jnp.asarray(c["ref"]), None, est)
    np.testing.assert_allclose(np.asarray(got0), np_kl(c["lp"], c["ref"], 0.0, est),
                               rtol=1e-12, atol=1e-12)


def test_k3_is_nonnegative_and_zero_at_anchor():
    lp = jnp.linspace(-5, 0, 11)
    assert np.all(np.asarray(losses.per_token_kl(lp, lp - 1.0, None)) >= 0)
    assert np.all(np.asarray(losses.per_token_kl(lp, lp - 0.3, jnp.full_like(lp, 0.3))) == 0)


# ------------------------------------------------------------------ full loss vs numpy

# Every loss_type x IS level; delta and the estimator alternate so each level sees both deltas
# and every estimator.
CASES = [(lt, lvl, [None, 1.5][(i // 2 + i) % 2])
         for i, (lt, lvl) in enumerate(itertools.product(losses.LOSS_TYPES, losses.IS_LEVELS))]


@pytest.mark.parametrize("loss_type,level,delta", CASES)
def test_policy_loss_and_grad_match_numpy(loss_type, level, delta):
    c, j = make_tensors(2)
    est = losses.ESTIMATORS[CASES.index((loss_type, level, delta)) % 3]  # cycle estimators
    cfg = LossConfig(loss_type=loss_type, beta=0.07, estimator=est, eps_low=0.2, eps_high=0.28,
                     delta=delta, importance_sampling_level=level)
    n_batch = 3 * int(c["m"].sum()) if loss_type == "dapo" else None
    (loss, met), g = run(j, cfg, n_batch)
    want, want_met, want_g = np_policy_loss(c["lp"], c["old"], c["ref"], c["logq"], c["adv"],
                                            c["m"], cfg, n_batch)
    np.testing.assert_allclose(float(loss), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-9, atol=1e-12)
    for k, v in want_met.items():
        np.testing.assert_allclose(float(met[k]), v, rtol=1e-10, atol=1e-12, err_msg=k)
    assert np.all(np.asarray(g)[~c["m"]] == 0.0)


@pytest.mark.parametrize("est", losses.ESTIMATORS)
def test_each_estimator_in_loss(est):
    c, j = make_tensors(3)
    cfg = LossConfig(beta=0.3, estimator=est)
    (loss, _), g = run(j, cfg)
    want, _, want_g = np_policy_loss(c["lp"], c["old"], c["ref"], c["logq"], c["adv"], c["m"], cfg)
    np.testing.assert_allclose(float(loss), want, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-9, atol=1e-12)


def test_float32_matches_float64_reference():
    c, _ = make_tensors(4, garbage=False)
    j32 = {k: jnp.asarray(v, jnp.float32) if v.dtype == np.float64 else jnp.asarray(v)
           for k, v in c.items()}
    cfg = LossConfig(beta=0.05)
    (loss, _), g = run(j32, cfg)
    assert loss.dtype == jnp.float32
    c32 = {k: v.astype(np.float32).astype(np.float64) if v.dtype == np.float64 else v
           for k, v in c.items()}
    want, _, want_g = np_policy_loss(c32["lp"], c32["old"], c32["ref"], c32["logq"], c32["adv"],
                                     c32["m"], cfg)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ SAGE invariants


def grpo_k3_reference(lp, old, ref, adv, m, beta, eps):
    """Straightforward TRL-style GRPO + k3 (multiplicative masking; clean inputs only), its mean over the rows
    that have tokens (TRL's mean also counts an all-masked row, as a zero; here such a row is not in the batch)."""
    mf = m.astype(lp.dtype)
    coef1 = jnp.exp(lp - old)
    coef2 = jnp.clip(coef1, 1 - eps, 1 + eps)
    per_tok = -jnp.minimum(coef1 * adv[:, None], coef2 * adv[:, None])
    kl = jnp.exp(ref - lp) - (ref - lp) - 1
    per_tok = per_tok + beta * kl
    rows = (mf.sum(-1) > 0).sum()
    return ((per_tok * mf).sum(-1) / jnp.maximum(mf.sum(-1), 1.0)).sum() / rows


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_guide_none_is_grpo_with_kl(dtype):
    c, _ = make_tensors(5, garbage=False)
    j = {k: jnp.asarray(v, dtype) if v.dtype == np.float64 else jnp.asarray(v)
         for k, v in c.items()}
    inp = guides.GuideInputs(mask_BxT=j["m"], step=jnp.asarray(3), max_steps=100,
                             key=jax.random.PRNGKey(0), logp_BxT=j["lp"])
    log_q, q = guides.compute_log_q("none", None, inp)
    assert np.all(np.asarray(log_q) == 0)
    cfg = LossConfig(loss_type="grpo", beta=0.04, estimator="k3", eps_low=0.2, eps_high=0.2)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == jnp.float64 else dict(rtol=1e-6, atol=1e-7)
    for lq in (log_q, None):
        f = lambda lp: losses.policy_loss(lp, j["old"], j["ref"], lq, j["adv"], j["m"], cfg)[0]
        g_ref = lambda lp: grpo_k3_reference(lp, j["old"], j["ref"], j["adv"], j["m"], 0.04, 0.2)
        (lf, gf), (lr, gr) = jax.jit(lambda x: (jax.value_and_grad(f)(x),
                                                jax.value_and_grad(g_ref)(x)))(j["lp"])
        np.testing.assert_allclose(float(lf), float(lr), **tol)
        np.testing.assert_allclose(np.asarray(gf), np.asarray(gr), **tol)
    # On-policy (old=None) too.
    f = lambda lp: losses.policy_loss(lp, None, j["ref"], log_q, j["adv"], j["m"], cfg)[0]
    g_ref = lambda lp: grpo_k3_reference(lp, jax.lax.stop_gradient(lp), j["ref"], j["adv"],
                                         j["m"], 0.04, 0.2)
    gf, gr = jax.jit(lambda x: (jax.grad(f)(x), jax.grad(g_ref)(x)))(j["lp"])
    np.testing.assert_allclose(np.asarray(gf), np.asarray(gr), **tol)


def test_on_policy_gradient_closed_form():
    # old = lp: ratio 1, never clipped. dL/dlp_bt = m / (n_b B) (-A_b + beta (1 - e^d)), B the rows with tokens.
    c, j = make_tensors(6)
    beta = 0.1
    cfg = LossConfig(beta=beta)
    g = jax.grad(lambda lp: losses.policy_loss(lp, None, j["ref"], j["logq"], j["adv"], j["m"],
                                               cfg)[0])(j["lp"])
    B = int(c["m"].any(-1).sum())
    assert B == c["m"].shape[0] - 1  # make_tensors' row 0 has no token
    n = np.maximum(c["m"].sum(-1, keepdims=True), 1)
    d = c["ref"] + c["logq"] - c["lp"]
    want = np.where(c["m"], (-c["adv"][:, None] + beta * (1 - np.exp(d))) / (n * B), 0.0)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-10, atol=1e-14)


def test_q_above_one_raises_the_pull_toward_reference():
    # A = 0 isolates the KL term. At lp = ref: d = log q, d k3 / d lp = 1 - q.
    # q > 1: gradient < 0, so a descent step *raises* lp toward the (raised) anchor ref + log q;
    # q = 1: zero; q < 1: > 0 (pushed down). Off the anchor, larger q is always more negative.
    ref = jnp.array([[-2.0, -2.0, -2.0, -1.0, -1.0]])
    lp = jnp.array([[-2.0, -2.0, -2.0, -1.5, -1.5]])
    q = jnp.array([[1.3, 1.0, 0.7, 1.0, 1.3]])
    m = jnp.ones((1, 5), bool)
    beta = 0.5
    cfg = LossConfig(beta=beta)
    f = lambda x: losses.policy_loss(x, None, ref, jnp.log(q), jnp.zeros(1), m, cfg)[0]
    g = np.asarray(jax.jit(jax.grad(f))(lp))[0]
    np.testing.assert_allclose(g[:3], beta * (1 - np.array([1.3, 1.0, 0.7])) / 5, atol=1e-14)
    assert g[0] < 0 and g[1] == 0 and g[2] > 0
    assert g[4] < g[3] < 0  # lp below ref: q = 1 already pulls up, q = 1.3 pulls harder
    # One descent step moves lp toward the anchor a = ref + log q at every token.
    a = np.asarray(ref + jnp.log(q))[0]
    lp1 = np.asarray(lp)[0] - 0.1 * g
    assert np.all(np.abs(lp1 - a) <= np.abs(np.asarray(lp)[0] - a) + 1e-15)


@pytest.mark.parametrize("loss_type,level", list(zip(losses.LOSS_TYPES,
                                                     losses.IS_LEVELS * 2)))
def test_masked_tokens_get_exactly_zero_gradient(loss_type, level):
    c, j = make_tensors(7)  # nan / inf garbage on padding in every input
    cfg = LossConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.2, delta=2.0)
    (loss, met), g = run(j, cfg)
    g = np.asarray(g)
    assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in met.values())
    assert np.all(g[~c["m"]] == 0.0)
    assert np.all(np.isfinite(g))
    assert np.any(g[c["m"]] != 0.0)
    # Gradient w.r.t. the guide's log q is stopped.
    gq = jax.grad(lambda lq: losses.policy_loss(j["lp"], j["old"], j["ref"], lq, j["adv"], j["m"],
                                                cfg)[0])(jnp.zeros_like(j["lp"]))
    assert np.all(np.asarray(gq) == 0.0)


# ------------------------------------------------------------------ aggregation


def test_loss_type_normalisers():
    rng = np.random.default_rng(8)
    B, T = 4, 6
    x = rng.normal(size=(B, T))
    m = np.array([[1, 1, 1, 0, 0, 0], [1] * 6, [0] * 6, [1, 0, 0, 0, 0, 0]], bool)
    xm = np.where(m, x, 0.0)
    xg = jnp.asarray(np.where(m, x, np.nan))
    mj = jnp.asarray(m)
    agg = losses.aggregate
    # row 2 has no token: it is not a row of the batch (3 rows)
    np.testing.assert_allclose(float(agg(xg, mj, "grpo")),
                               np.mean([xm[0].sum() / 3, xm[1].sum() / 6, xm[3].sum()]))
    np.testing.assert_allclose(float(agg(xg, mj, "bnpo")), xm.sum() / 10)
    np.testing.assert_allclose(float(agg(xg, mj, "dr_grpo")), xm.sum() / (3 * 6))
    np.testing.assert_allclose(float(agg(xg, mj, "dr_grpo", max_completion_length=50)),
                               xm.sum() / (3 * 50))
    for lt in ("dapo", "cispo"):
        np.testing.assert_allclose(float(agg(xg, mj, lt, num_batch_tokens=37)), xm.sum() / 37)
        np.testing.assert_allclose(float(agg(xg, mj, lt)), xm.sum() / 10)
    # an update's denominators, given: the micro-batch's sum over them
    norm = losses.Normalizer(rows=jnp.asarray(7.0), tokens=jnp.asarray(20.0), pg_tokens=jnp.asarray(20.0),
                             batch_tokens=jnp.asarray(40.0))
    np.testing.assert_allclose(float(agg(xg, mj, "grpo", norm=norm)),
                               (xm[0].sum() / 3 + xm[1].sum() / 6 + xm[3].sum()) / 7)
    np.testing.assert_allclose(float(agg(xg, mj, "bnpo", norm=norm)), xm.sum() / 20)
    np.testing.assert_allclose(float(agg(xg, mj, "dr_grpo", norm=norm)), xm.sum() / (7 * 6))
    np.testing.assert_allclose(float(agg(xg, mj, "dapo", norm=norm)), xm.sum() / 40)
    with pytest.raises(ValueError, match="max_new_tokens=3 .dr_grpo's T_max. is smaller"):
        agg(xg, mj, "dr_grpo", max_completion_length=3)
    assert float(agg(xg, jnp.zeros_like(mj), "grpo")) == 0.0
    assert float(agg(xg, jnp.zeros_like(mj), "bnpo")) == 0.0


def test_dapo_micro_batches_sum_to_full_batch():
    c, j = make_tensors(9, B=8, garbage=False)
    cfg = LossConfig(loss_type="dapo", beta=0.05)
    n_total = int(c["m"].sum())
    (full, _), g_full = run(j, cfg, n_total)
    halves = [{k: v[:4] for k, v in j.items()}, {k: v[4:] for k, v in j.items()}]
    outs = [run(h, cfg, n_total) for h in halves]
    np.testing.assert_allclose(float(outs[0][0][0] + outs[1][0][0]), float(full), rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([np.asarray(o[1]) for o in outs]),
                               np.asarray(g_full), rtol=1e-12, atol=1e-15)
    # bnpo per micro-batch would not be exact (different denominators): the point of dapo.
    (b0, _), _ = run(halves[0], LossConfig(loss_type="bnpo", beta=0.05))
    (b1, _), _ = run(halves[1], LossConfig(loss_type="bnpo", beta=0.05))
    assert abs(float(b0 + b1) / 2 - float(full)) > 1e-6


# ------------------------------------------------------------------ ratio / clipping


def test_gspo_ratio_is_sequence_geometric_mean():
    c, j = make_tensors(10)
    cfg = LossConfig(importance_sampling_level="sequence", beta=0.0, eps_low=1 - 1e-12,
                     eps_high=1e9)  # no clipping: pg_b = -r_b A_b
    (loss, met), _ = run(j, cfg)
    m = c["m"]
    n = np.maximum(m.sum(-1), 1)
    r_b = np.exp(np.where(m, c["lp"] - c["old"], 0).sum(-1) / n)
    want = np.sum(np.where(m.sum(-1) > 0, -r_b * c["adv"], 0.0)) / (m.sum(-1) > 0).sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-12)
    np.testing.assert_allclose(float(met["ratio_mean"]), (r_b * m.sum(-1)).sum() / m.sum(),
                               rtol=1e-12)
    # GSPO's ratio differs from the token-level mean ratio.
    (_, met_tok), _ = run(j, LossConfig(beta=0.0))
    assert abs(float(met_tok["ratio_mean"]) - float(met["ratio_mean"])) > 1e-3


def _one_row(lp_minus_old, adv):
    lr = jnp.asarray(lp_minus_old, jnp.float64)[None, :]
    old = jnp.zeros_like(lr) - 1.0
    return lr + old, old, jnp.ones_like(lr, dtype=bool), jnp.asarray([adv], jnp.float64)


def test_delta_caps_the_unclipped_ratio():
    ratios = np.array([0.5, 1.0, 1.1, 3.0, 5.0])
    lp, old, m, _ = _one_row(np.log(ratios), 1.0)
    for A in (1.0, -1.0):
        adv = jnp.asarray([A])
        cfg = LossConfig(loss_type="bnpo", beta=0.0, eps_low=0.2, eps_high=0.2, delta=2.0)
        loss, met = losses.policy_loss(lp, old, None, None, adv, m, cfg)
        loss0, _ = losses.policy_loss(lp, old, None, None, adv, m,
                                      LossConfig(loss_type="bnpo", beta=0.0))
        r1, r1c = ratios, np.minimum(ratios, 2.0)
        r2 = np.clip(ratios, 0.8, 1.2)
        want = np.mean(-np.minimum(r1c * A, r2 * A))
        want0 = np.mean(-np.minimum(r1 * A, r2 * A))
        np.testing.assert_allclose(float(loss), want, rtol=1e-12)
        np.testing.assert_allclose(float(loss0), want0, rtol=1e-12)
        np.testing.assert_allclose(float(met["delta_capped"]), 2 / 5)
        if A < 0:  # the cap only matters for negative advantages with large ratios
            assert float(loss) < float(loss0)
        else:
            assert float(loss) == pytest.approx(float(loss0))
    with pytest.raises(ValueError, match="rl.delta=1.1 must be >= 1 \\+ rl.eps_high"):
        LossConfig(delta=1.1, eps_high=0.2)


def test_asymmetric_clip_fractions():
    ratios = np.array([0.7, 0.85, 1.0, 1.25, 1.35, 0.7, 1.35, 1.25])
    adv_sign = np.array([-1, -1, 1, 1, 1, 1, -1, -1], float)
    # Put each token in its own sequence so each has its own advantage.
    lp = jnp.asarray(np.log(ratios)[:, None] - 1.0)
    old = jnp.full_like(lp, -1.0)
    m = jnp.ones_like(lp, dtype=bool)
    cfg = LossConfig(beta=0.0, eps_low=0.2, eps_high=0.28)
    _, met = losses.policy_loss(lp, old, None, None, jnp.asarray(adv_sign), m, cfg)
    # low: r < 0.8 and A < 0 -> token 0; high: r > 1.28 and A > 0 -> token 4.
    # r = 1.25 with A > 0 is inside clip-higher (it would be clipped with eps_high = 0.2).
    np.testing.assert_allclose(float(met["clip_low"]), 1 / 8)
    np.testing.assert_allclose(float(met["clip_high"]), 1 / 8)
    np.testing.assert_allclose(float(met["clip_region"]), 2 / 8)
    _, met_sym = losses.policy_loss(lp, old, None, None, jnp.asarray(adv_sign), m,
                                    LossConfig(beta=0.0, eps_low=0.2, eps_high=0.2))
    np.testing.assert_allclose(float(met_sym["clip_high"]), 2 / 8)
    # Clipped tokens get no policy gradient.
    g = jax.jit(jax.grad(lambda x: losses.policy_loss(x, old, None, None, jnp.asarray(adv_sign),
                                                      m, cfg)[0]))(lp)
    g = np.asarray(g)[:, 0]
    assert g[0] == 0 and g[4] == 0 and g[3] != 0 and g[1] != 0


# ------------------------------------------------------------------ beta = 0 / forward KL


def test_beta_zero_ignores_reference():
    c, j = make_tensors(11)
    cfg = LossConfig(beta=0.0, loss_type="bnpo")
    f = jax.value_and_grad(losses.policy_loss, has_aux=True)
    (l0, m0), g0 = f(j["lp"], j["old"], None, None, j["adv"], j["m"], cfg)
    other_ref = jnp.asarray(np.random.default_rng(0).normal(size=c["lp"].shape)) * 5
    (l1, m1), g1 = f(j["lp"], j["old"], other_ref, j["logq"], j["adv"], j["m"], cfg)
    assert float(l0) == float(l1)
    assert np.array_equal(np.asarray(g0), np.asarray(g1))
    assert "kl" not in m0 and "kl_loss" not in m0 and m0.keys() == m1.keys()
    np.testing.assert_allclose(float(l0), float(m0["pg_loss"]))
    with pytest.raises(ValueError, match="beta=0.1 > 0 needs ref_logp_BxT"):
        losses.policy_loss(j["lp"], j["old"], None, None, j["adv"], j["m"], LossConfig(beta=0.1))


def np_forward_kl(pol, ref):
    out = np.zeros(pol.shape[:-1])
    for idx in np.ndindex(*pol.shape[:-1]):
        lp = pol[idx] - np.log(np.exp(pol[idx] - pol[idx].max()).sum()) - pol[idx].max()
        lr = ref[idx] - np.log(np.exp(ref[idx] - ref[idx].max()).sum()) - ref[idx].max()
        out[idx] = sum(np.exp(lr[v]) * (lr[v] - lp[v]) for v in range(pol.shape[-1]))
    return out


def test_forward_kl_exact_chunked_and_gradient():
    rng = np.random.default_rng(12)
    B, T, V = 3, 8, 11
    pol = rng.normal(size=(B, T, V)) * 2
    ref = rng.normal(size=(B, T, V)) * 2
    m = np.arange(T)[None, :] < np.array([8, 3, 0])[:, None]
    got = losses.forward_kl_from_logits(jnp.asarray(pol), jnp.asarray(ref), jnp.asarray(m))
    want = np.where(m, np_forward_kl(pol, ref), 0.0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-14)
    # Applied per T-chunk it gives the same values.
    chunks = [losses.forward_kl_from_logits(jnp.asarray(pol[:, s:s + 3]),
                                            jnp.asarray(ref[:, s:s + 3])) for s in range(0, T, 3)]
    np.testing.assert_allclose(np.concatenate([np.asarray(c) for c in chunks], 1),
                               np_forward_kl(pol, ref), rtol=1e-12, atol=1e-14)
    # d/dlogits sum_t KL_t = softmax(pol) - p_ref; nothing flows to the reference.
    gp, gr = jax.jit(jax.grad(
        lambda p, r: losses.forward_kl_from_logits(p, r, jnp.asarray(m)).sum(),
        argnums=(0, 1)))(jnp.asarray(pol), jnp.asarray(ref))
    sm = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(
        x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(gp), np.where(m[..., None], sm(pol) - sm(ref), 0.0),
                               atol=1e-12)
    assert np.all(np.asarray(gr) == 0)


def test_forward_kl_mode_in_policy_loss():
    c, j = make_tensors(13, garbage=False)
    fkl = jnp.asarray(np.random.default_rng(1).gamma(1.0, 0.1, size=c["lp"].shape))
    cfg = LossConfig(beta=0.2, kl_mode="forward", loss_type="bnpo")
    loss, met = losses.policy_loss(j["lp"], j["old"], None, None, j["adv"], j["m"], cfg,
                                   forward_kl_BxT=fkl)
    pg, _ = losses.policy_loss(j["lp"], j["old"], None, None, j["adv"], j["m"],
                               LossConfig(beta=0.0, loss_type="bnpo"))
    m = c["m"]
    np.testing.assert_allclose(float(loss) - float(pg),
                               0.2 * np.where(m, np.asarray(fkl), 0).sum() / m.sum(), rtol=1e-10)
    np.testing.assert_allclose(float(met["kl"]), np.where(m, np.asarray(fkl), 0).sum() / m.sum())
    with pytest.raises(ValueError, match="needs forward_kl_BxT"):
        losses.policy_loss(j["lp"], j["old"], None, None, j["adv"], j["m"], cfg)


def test_config_validation_and_hashable():
    for kw, msg in [
        (dict(loss_type="ppo"), "rl.loss_type='ppo'"),
        (dict(estimator="k4"), "rl.estimator='k4'"),
        (dict(kl_mode="both"), "rl.kl_mode='both'"),
        (dict(importance_sampling_level="seq"), "rl.importance_sampling_level='seq'"),
        (dict(beta=-1.0), "rl.beta must be >= 0"),
        (dict(beta=float("nan")), "rl.beta=nan must be a finite number"),
        (dict(eps_high=float("inf")), "rl.eps_high=inf must be a finite number"),
        (dict(eps_low=1.0), "rl.eps_low"),
        (dict(eps_high=-0.1), "rl.eps_high"),
        (dict(entropy_coef=-0.1), "rl.entropy_coef"),
        (dict(opsm_threshold=-1.0), "rl.opsm_threshold"),
        (dict(max_completion_length=0), "rollout.max_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=msg):
            LossConfig(**kw)
    with pytest.raises(ValueError, match="unknown estimator"):
        losses.per_token_kl(jnp.zeros(2), jnp.zeros(2), None, "kx")
    with pytest.raises(ValueError, match="unknown loss_type"):
        losses.aggregate(jnp.zeros((1, 2)), jnp.ones((1, 2)), "x")
    assert hash(LossConfig()) == hash(LossConfig())
