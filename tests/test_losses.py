"""Losses vs an independent NumPy implementation of docs/design.md §2 (float64), gradients vs the
analytic NumPy gradient, and the SAGE invariants (guide="none" == GRPO+k3, q > 1 pulls up,
masked tokens get zero gradient, beta = 0 ignores the reference)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax import guides, losses
from sage_jax.losses import LossConfig


pytestmark = pytest.mark.usefixtures("x64")  # float64 references (tests/conftest.py)


# ------------------------------------------------------------------ independent references


def np_kl(lp, ref, logq, est):
    d = ref + logq - lp
    return {"k3": np.exp(d) - d - 1, "k1": -d, "k2": d * d / 2}[est]


def np_dkl_dlp(lp, ref, logq, est):
    d = ref + logq - lp
    return {"k3": 1 - np.exp(d), "k1": 1.0, "k2": -d}[est]


def np_weights(m, loss_type, n_batch=None, tmax=None):
    """Aggregation weight of each real token: loss = sum_bt w_bt l_bt."""
    B, T = m.shape
    w = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not m[b, t]:
                continue
            if loss_type == "grpo":
                w[b, t] = 1.0 / (max(m[b].sum(), 1) * B)
            elif loss_type == "bnpo":
                w[b, t] = 1.0 / max(m.sum(), 1)
            elif loss_type == "dr_grpo":
                w[b, t] = 1.0 / (B * (T if tmax is None else tmax))
            else:
                w[b, t] = 1.0 / max(m.sum() if n_batch is None else n_batch, 1)
    return w


def np_sampler_weights(old, sampler, m, level):
    """The sampler weight of each real token: its own, or its sequence's product / geometric mean."""
    B, T = old.shape
    ws = np.zeros((B, T))
    for b in range(B):
        idx = [t for t in range(T) if m[b, t]]
        total = sum(old[b, t] - sampler[b, t] for t in idx)
        for t in idx:
            ws[b, t] = np.exp({"token": old[b, t] - sampler[b, t], "sequence": total,
                               "geometric": total / max(len(idx), 1)}[level])
    return ws


def np_selected(ent, m, frac):
    """Top `frac` of the real tokens by entropy: k = ceil(frac n), ties at the k-th value kept."""
    if frac >= 1:
        return m.astype(bool)
    vals = sorted((ent[b, t] for b in range(m.shape[0]) for t in range(m.shape[1]) if m[b, t]), reverse=True)
    k = max(int(np.ceil(frac * len(vals))), 1)
    return m.astype(bool) & (ent >= vals[k - 1])


def np_policy_loss(lp, old, ref, logq, adv, m, cfg, n_batch=None, sampler=None, ent=None):
    """Loss, metrics and d loss / d lp, with explicit loops and branch bookkeeping."""
    B, T = lp.shape
    el, eh, delta = cfg.eps_low, cfg.eps_high, cfg.delta
    w = np_weights(m, cfg.loss_type, n_batch, cfg.max_completion_length)
    loss = pg_loss = kl_loss = 0.0
    grad = np.zeros((B, T))
    n_tok = max(m.sum(), 1)
    kl_sum = ratio_sum = low = high = tis_sum = tis_capped = mis_masked = mismatch = 0.0
    correcting = cfg.tis_cap is not None or cfg.mis_bounds is not None
    ws = np_sampler_weights(old, sampler, m, cfg.mismatch_level) if correcting else None
    selected = np_selected(ent, m, cfg.entropy_top_frac) if cfg.entropy_top_frac < 1 else m.astype(bool)
    for b in range(B):
        idx = [t for t in range(T) if m[b, t]]
        n = max(len(idx), 1)
        A = adv[b]
        seq_lr = sum(lp[b, t] - old[b, t] for t in idx) / n
        for t in idx:
            lr = seq_lr if cfg.importance_sampling_level == "sequence" else lp[b, t] - old[b, t]
            r = np.exp(lr)
            r1 = r if delta is None else min(r, delta)
            r2 = min(max(r, 1 - el), 1 + eh)
            if r1 * A <= r2 * A:
                pg = -r1 * A
                dpg_dlr = -A * r * (1.0 if (delta is None or r < delta) else 0.0)
            else:
                pg = -r2 * A
                dpg_dlr = -A * r * (1.0 if (1 - el < r < 1 + eh) else 0.0)
            if correcting:
                d = old[b, t] - sampler[b, t]
                mismatch += np.exp(-d) - 1 + d
            if cfg.tis_cap is not None:  # TRL: per_token_loss * clamp(exp(old - sampling), max=cap), then + beta kl
                tis = min(ws[b, t], cfg.tis_cap)
                tis_sum += tis
                tis_capped += float(ws[b, t] > cfg.tis_cap)
                pg, dpg_dlr = pg * tis, dpg_dlr * tis
            if cfg.mis_bounds is not None and not cfg.mis_bounds[0] <= ws[b, t] <= cfg.mis_bounds[1]:
                pg, dpg_dlr = 0.0, 0.0
                mis_masked += 1
            if not selected[b, t]:
                pg, dpg_dlr = 0.0, 0.0
            kl = np_kl(lp[b, t], ref[b, t], logq[b, t], cfg.estimator) if cfg.beta else 0.0
            loss += w[b, t] * (pg + cfg.beta * kl)
            pg_loss += w[b, t] * pg
            kl_loss += w[b, t] * cfg.beta * kl
            kl_sum += kl
            ratio_sum += r
            low += float(r < 1 - el and A < 0)
            high += float(r > 1 + eh and A > 0)
            if cfg.beta:
                grad[b, t] += w[b, t] * cfg.beta * np_dkl_dlp(lp[b, t], ref[b, t], logq[b, t],
                                                              cfg.estimator)
            if cfg.importance_sampling_level == "sequence":
                # pg_bt depends on every lp of the row through the mean log-ratio.
                for t2 in idx:
                    grad[b, t2] += w[b, t] * dpg_dlr / n
            else:
                grad[b, t] += w[b, t] * dpg_dlr
    metrics = dict(loss=loss, pg_loss=pg_loss, ratio_mean=ratio_sum / n_tok,
                   clip_low=low / n_tok, clip_high=high / n_tok,
                   clip_region=(low + high) / n_tok)
    if cfg.beta:
        metrics.update(kl=kl_sum / n_tok, kl_loss=kl_loss)
    if correcting:
        metrics.update(mismatch_kl=mismatch / n_tok)
    if cfg.tis_cap is not None:
        metrics.update(tis_weight_mean=tis_sum / n_tok, tis_capped=tis_capped / n_tok)
    if cfg.mis_bounds is not None:
        metrics.update(mis_masked=mis_masked / n_tok)
    if cfg.entropy_top_frac < 1:
        metrics.update(pg_token_frac=(selected & m.astype(bool)).sum() / n_tok)
    return loss, metrics, grad


def make_tensors(seed=0, B=7, T=13, garbage=True):
    rng = np.random.default_rng(seed)
    lp = -rng.gamma(2.0, 0.7, size=(B, T))
    old = lp + rng.normal(0, 0.3, size=(B, T))
    ref = lp + rng.normal(0, 0.5, size=(B, T))
    logq = np.log(rng.uniform(0.6, 1.4, size=(B, T)))
    adv = rng.normal(0, 1, size=B)
    lens = rng.integers(1, T + 1, size=B)
    lens[0] = 0  # all-masked row
    lens[1] = T
    m = np.arange(T)[None, :] < lens[:, None]
    clean = dict(lp=lp, old=old, ref=ref, logq=logq, adv=adv, m=m)
    dirty = {k: v.copy() for k, v in clean.items()}
    if garbage:
        for k, val in (("lp", np.nan), ("old", np.inf), ("ref", -np.inf), ("logq", np.nan)):
            dirty[k][~m] = val
    return clean, {k: jnp.asarray(v) for k, v in dirty.items()}


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
    """Straightforward TRL-style GRPO + k3 (multiplicative masking; clean inputs only)."""
    mf = m.astype(lp.dtype)
    coef1 = jnp.exp(lp - old)
    coef2 = jnp.clip(coef1, 1 - eps, 1 + eps)
    per_tok = -jnp.minimum(coef1 * adv[:, None], coef2 * adv[:, None])
    kl = jnp.exp(ref - lp) - (ref - lp) - 1
    per_tok = per_tok + beta * kl
    return ((per_tok * mf).sum(-1) / jnp.maximum(mf.sum(-1), 1.0)).mean()


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
    # old = lp: ratio 1, never clipped. dL/dlp_bt = m / (n_b B) (-A_b + beta (1 - e^d)).
    c, j = make_tensors(6)
    beta = 0.1
    cfg = LossConfig(beta=beta)
    g = jax.grad(lambda lp: losses.policy_loss(lp, None, j["ref"], j["logq"], j["adv"], j["m"],
                                               cfg)[0])(j["lp"])
    B = c["m"].shape[0]
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
    np.testing.assert_allclose(float(agg(xg, mj, "grpo")),
                               np.mean([xm[0].sum() / 3, xm[1].sum() / 6, 0.0, xm[3].sum()]))
    np.testing.assert_allclose(float(agg(xg, mj, "bnpo")), xm.sum() / 10)
    np.testing.assert_allclose(float(agg(xg, mj, "dr_grpo")), xm.sum() / (4 * 6))
    np.testing.assert_allclose(float(agg(xg, mj, "dr_grpo", max_completion_length=50)),
                               xm.sum() / (4 * 50))
    np.testing.assert_allclose(float(agg(xg, mj, "dapo", num_batch_tokens=37)), xm.sum() / 37)
    np.testing.assert_allclose(float(agg(xg, mj, "dapo")), xm.sum() / 10)
    with pytest.raises(ValueError, match="max_completion_length=3 is smaller"):
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
    want = np.mean(np.where(m.sum(-1) > 0, -r_b * c["adv"], 0.0))
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
    with pytest.raises(ValueError, match="LossConfig.delta=1.1 must be >= 1 \\+ eps_high"):
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
        (dict(loss_type="ppo"), "LossConfig.loss_type='ppo'"),
        (dict(estimator="k4"), "LossConfig.estimator='k4'"),
        (dict(kl_mode="both"), "LossConfig.kl_mode='both'"),
        (dict(importance_sampling_level="seq"), "LossConfig.importance_sampling_level='seq'"),
        (dict(beta=-1.0), "LossConfig.beta must be >= 0"),
        (dict(eps_low=1.0), "LossConfig.eps_low"),
        (dict(eps_high=-0.1), "LossConfig.eps_high"),
        (dict(max_completion_length=0), "LossConfig.max_completion_length"),
    ]:
        with pytest.raises(ValueError, match=msg):
            LossConfig(**kw)
    with pytest.raises(ValueError, match="unknown estimator"):
        losses.per_token_kl(jnp.zeros(2), jnp.zeros(2), None, "kx")
    with pytest.raises(ValueError, match="unknown loss_type"):
        losses.aggregate(jnp.zeros((1, 2)), jnp.ones((1, 2)), "x")
    assert hash(LossConfig()) == hash(LossConfig())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_truncated_importance_sampling_matches_numpy(loss_type):
    """TRL 0.23's sampler correction: pg x min(exp(old - sampler), cap), beta kl added unweighted."""
    c, j = make_tensors(5)
    rng = np.random.default_rng(50)
    sampler = c["old"] + rng.normal(0, 0.8, size=c["old"].shape)  # some weights above the cap of 2
    cfg = LossConfig(loss_type=loss_type, beta=0.07, tis_cap=2.0)
    n_batch = 2 * int(c["m"].sum()) if loss_type == "dapo" else None
    (loss, met), g = jax.jit(jax.value_and_grad(losses.policy_loss, has_aux=True), static_argnames=("cfg",))(
        j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], cfg=cfg, num_batch_tokens=n_batch,
        sampler_logp_BxT=jnp.asarray(np.where(c["m"], sampler, np.nan)))
    want, want_met, want_g = np_policy_loss(c["lp"], c["old"], c["ref"], c["logq"], c["adv"], c["m"], cfg,
                                            n_batch, sampler=sampler)
    assert 0 < want_met["tis_capped"] < 0.5  # the cap binds on some tokens, not all
    np.testing.assert_allclose(float(loss), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-9, atol=1e-12)
    for k, v in want_met.items():
        np.testing.assert_allclose(float(met[k]), v, rtol=1e-10, atol=1e-12, err_msg=k)
    with pytest.raises(ValueError, match="sampler_logp_BxT"):
        losses.policy_loss(j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], cfg)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("is_level", ["token", "sequence"])
def test_sampler_mismatch_corrections_match_numpy(level, is_level):
    """TIS (cap) and MIS (mask outside [lo, hi]) on the sampler weight of each token, of its sequence's
    product, or of its sequence's geometric mean; mismatch_kl is the k3 estimate of KL(sampler || trainer)."""
    c, j = make_tensors(6)
    rng = np.random.default_rng(60)
    scale = {"token": 0.8, "sequence": 0.4, "geometric": 1.5}[level]  # a sum over a row spreads more, a mean less
    sampler = c["old"] + rng.normal(0, scale, size=c["old"].shape)
    cfg = LossConfig(loss_type="grpo", beta=0.07, tis_cap=2.0, mis_bounds=(0.5, 1.6), mismatch_level=level,
                     importance_sampling_level=is_level)
    (loss, met), g = jax.jit(jax.value_and_grad(losses.policy_loss, has_aux=True), static_argnames=("cfg",))(
        j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], cfg=cfg,
        sampler_logp_BxT=jnp.asarray(np.where(c["m"], sampler, np.nan)))
    want, want_met, want_g = np_policy_loss(c["lp"], c["old"], c["ref"], c["logq"], c["adv"], c["m"], cfg,
                                            sampler=sampler)
    assert 0 < want_met["mis_masked"] < 0.8  # the mask binds on some tokens, not all
    assert set(met) == set(want_met)
    np.testing.assert_allclose(float(loss), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-9, atol=1e-12)
    for k, v in want_met.items():
        np.testing.assert_allclose(float(met[k]), v, rtol=1e-10, atol=1e-12, err_msg=k)
    for bad in [(1.2, 2.0), (0.5, 0.9), (0.5,)]:
        with pytest.raises(ValueError, match="mis_bounds"):
            LossConfig(mis_bounds=bad)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("frac", [0.2, 0.5])
def test_high_entropy_token_selection_matches_numpy(loss_type, frac):
    """Only the top `frac` of the completion tokens by entropy keep the policy gradient; the KL term keeps
    every token. With ties: the entropies are rounded so that the threshold value repeats."""
    c, j = make_tensors(7)
    ent = np.round(np.random.default_rng(70).gamma(2.0, 0.5, size=c["lp"].shape), 1)
    cfg = LossConfig(loss_type=loss_type, beta=0.07, entropy_top_frac=frac)
    (loss, met), g = jax.jit(jax.value_and_grad(losses.policy_loss, has_aux=True), static_argnames=("cfg",))(
        j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], cfg=cfg,
        entropy_BxT=jnp.asarray(np.where(c["m"], ent, np.nan)))
    want, want_met, want_g = np_policy_loss(c["lp"], c["old"], c["ref"], c["logq"], c["adv"], c["m"], cfg, ent=ent)
    assert frac <= want_met["pg_token_frac"] < frac + 0.15
    np.testing.assert_allclose(float(loss), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-9, atol=1e-12)
    for k, v in want_met.items():
        np.testing.assert_allclose(float(met[k]), v, rtol=1e-10, atol=1e-12, err_msg=k)
    with pytest.raises(ValueError, match="entropy_BxT"):
        losses.policy_loss(j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], cfg)


def test_sage_loss_form_and_reward_form_differ_in_expectation_as_derived():
    """One position, a softmax policy over V = 5 tokens, on-policy, no verifier reward (A = 0). The expected
    gradient over y ~ pi, enumerated exactly (sum_y pi_y grad loss(y), pi_y a constant), of
      the loss form:   -beta sum_y q_y ref_y grad log pi_y            (k3 against ref + log q)
      the reward form: -beta sum_y (ref_y + pi_y log q_y) grad log pi_y (k3 against ref, bonus beta log q_y)
    Different unless q = 1, where both are -beta sum_y ref_y grad log pi_y."""
    beta = 0.3
    theta = jnp.array([0.2, -1.0, 0.7, 0.0, -0.4], jnp.float64)
    ref = jax.nn.softmax(jnp.array([0.5, 0.1, -0.3, 0.9, -1.2], jnp.float64))
    q = jnp.array([1.4, 0.6, 1.0, 0.8, 1.2], jnp.float64)

    def expected_grad(form, q):
        pi = jax.lax.stop_gradient(jax.nn.softmax(theta))

        def loss_of(th, y):
            lp = jax.nn.log_softmax(th)[y][None, None]
            cfg = LossConfig(beta=beta, sage_form=form)
            return losses.policy_loss(lp, None, jnp.log(ref[y])[None, None], jnp.log(q[y])[None, None],
                                      jnp.zeros((1,), jnp.float64), jnp.ones((1, 1)), cfg)[0]

        return sum(pi[y] * jax.grad(loss_of)(theta, y) for y in range(5))

    pi = jax.nn.softmax(theta)
    dlogpi = jnp.eye(5) - pi[None, :]  # row y: grad_theta log pi_y
    want_loss = -beta * ((q * ref)[:, None] * dlogpi).sum(0)
    want_reward = -beta * ((ref + pi * jnp.log(q))[:, None] * dlogpi).sum(0)
    np.testing.assert_allclose(expected_grad("loss", q), want_loss, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(expected_grad("reward", q), want_reward, rtol=1e-10, atol=1e-13)
    assert np.abs(np.asarray(want_loss - want_reward)).max() > 1e-3
    ones = jnp.ones(5, jnp.float64)
    np.testing.assert_allclose(expected_grad("loss", ones), expected_grad("reward", ones), rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="sage_form"):
        LossConfig(sage_form="objective")
