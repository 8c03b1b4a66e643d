"""Sampler/trainer corrections (TIS, MIS, rejection at three levels, OPSM), CISPO, the entropy bonus, high-entropy
token selection and SAGE's two forms, each against the float64 NumPy loop reference of tests/loss_reference.py
(written from TRL's / verl's / the papers' definitions), a hand-computed case, or an exact enumeration."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loss_reference import make_tensors, np_policy_loss

from sage_jax.rl import losses
from sage_jax.rl.losses import LossConfig

pytestmark = pytest.mark.usefixtures("x64")  # float64 references (tests/conftest.py)

_value_and_grad = jax.jit(jax.value_and_grad(losses.policy_loss, has_aux=True), static_argnames=("cfg",))


def _check(cfg, c, j, n_batch=None, sampler=None, ent=None):
    """The loss, its gradient and every metric against the NumPy reference (and no metric beyond it)."""
    kw = {}
    if sampler is not None:
        kw["sampler_logp_BxT"] = jnp.asarray(np.where(c["m"], sampler, np.nan))
    if ent is not None:
        kw["entropy_BxT"] = jnp.asarray(np.where(c["m"], ent, np.nan))
    (loss, met), g = _value_and_grad(j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], cfg=cfg,
                                     num_batch_tokens=n_batch, **kw)
    want, want_met, want_g = np_policy_loss(c["lp"], c["old"], c["ref"], c["logq"], c["adv"], c["m"], cfg, n_batch,
                                            sampler=sampler, ent=ent)
    np.testing.assert_allclose(float(loss), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-9, atol=1e-12)
    assert set(met) == set(want_met)
    for k, v in want_met.items():
        np.testing.assert_allclose(float(met[k]), v, rtol=1e-10, atol=1e-12, err_msg=k)
    return want_met


def _spread_sampler(c, level, seed=60):
    """Sampler log-probs whose weights at `level` spread over about [0.3, 3.3] (some capped, some outside the
    band, some inside): per token old + noise; per sequence / geometric mean a row's log weight from
    linspace(-1.2, 1.2), its tokens' noise summing to zero."""
    rng = np.random.default_rng(seed)
    if level == "token":
        return c["old"] + rng.normal(0, 0.8, size=c["old"].shape)
    m = c["m"]
    n = np.maximum(m.sum(-1, keepdims=True), 1)
    noise = rng.normal(0, 0.5, size=m.shape) * m
    noise -= m * noise.sum(-1, keepdims=True) / n
    shift = np.linspace(-1.2, 1.2, m.shape[0])[:, None]
    return c["old"] - (shift / n if level == "sequence" else shift) + noise


CORRECTIONS = {  # name: the LossConfig fields of one sampler correction
    "tis": dict(tis_cap=1.3),  # TRL token_truncate
    "mis": dict(mis_bounds=(0.5, 1.6)),  # TRL token_mask / sequence_mask, IcePop
    "rs": dict(rs_bounds=(0.5, 1.6)),  # verl rollout_rs: rejection only
    "tis+rs": dict(tis_cap=1.3, rs_bounds=(0.5, 1.6)),
    "mis+tis": dict(tis_cap=1.3, mis_bounds=(0.5, 1.6)),
    "opsm": dict(opsm_threshold=0.02),  # TRL off_policy_mask_threshold
}


@pytest.mark.parametrize("name,level", list(itertools.product(CORRECTIONS, ["token", "sequence", "geometric"])))
def test_sampler_corrections_match_their_definitions(name, level):
    c, j = make_tensors(6)
    sampler = _spread_sampler(c, level)
    cfg = LossConfig(loss_type="grpo", beta=0.07, mismatch_level=level, **CORRECTIONS[name])
    met = _check(cfg, c, j, sampler=sampler)
    for k in ("mis_masked", "rs_masked", "tis_capped", "opsm_masked"):
        if k in met:
            assert 0 < met[k] < 0.9, (k, met[k])  # the correction binds on some tokens, not all


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_truncated_importance_sampling_with_each_aggregation(loss_type):
    c, j = make_tensors(5)
    sampler = c["old"] + np.random.default_rng(50).normal(0, 0.8, size=c["old"].shape)
    n_batch = 2 * int(c["m"].sum()) if loss_type in ("dapo", "cispo") else None
    _check(LossConfig(loss_type=loss_type, beta=0.07, tis_cap=2.0), c, j, n_batch, sampler=sampler)
    with pytest.raises(ValueError, match="sampler_logp_BxT"):
        losses.policy_loss(j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], LossConfig(tis_cap=2.0))


def test_masked_importance_sampling_keeps_the_weight_inside_the_band():
    """One token, A = 1, on-policy, sampler weight 1.5 inside [0.5, 2]: TRL's token_mask and IcePop give
    -w A = -1.5; rejection only (verl's rollout_rs) gives -A = -1; outside the band both give 0."""
    lp, sampler = jnp.zeros((1, 1)), jnp.full((1, 1), -np.log(1.5))
    run = lambda **kw: float(losses.policy_loss(lp, None, None, None, jnp.ones(1), jnp.ones((1, 1)),
                                                LossConfig(beta=0.0, **kw), sampler_logp_BxT=sampler)[0])
    assert run(mis_bounds=(0.5, 2.0)) == pytest.approx(-1.5, abs=1e-12)
    assert run(rs_bounds=(0.5, 2.0)) == pytest.approx(-1.0, abs=1e-12)
    assert run(mis_bounds=(0.5, 1.4)) == 0.0 and run(rs_bounds=(0.5, 1.4)) == 0.0
    assert run(tis_cap=1.2) == pytest.approx(-1.2, abs=1e-12)
    for bad in [(1.2, 2.0), (0.5, 0.9), (0.5,), (0.5, float("nan"))]:
        with pytest.raises(ValueError, match="mis_bounds"):
            LossConfig(mis_bounds=bad)
    with pytest.raises(ValueError, match="set one"):
        LossConfig(mis_bounds=(0.5, 2.0), rs_bounds=(0.5, 2.0))


def test_mismatch_kl_is_kl_of_the_sampler_to_the_trainer_by_enumeration():
    """The metric is the k3 estimate of KL(sampler || trainer) on tokens the sampler drew. With a uniform sampler
    over V tokens and one row per token, its token mean is the expectation under the sampler, so it equals
    sum_v s(v) log(s(v) / t(v)) exactly."""
    V = 5
    t = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    s = np.full(V, 1 / V)
    old, samp = jnp.asarray(np.log(t))[:, None], jnp.asarray(np.log(s))[:, None]  # row v: the token v
    _, m = losses.policy_loss(old, old, None, None, jnp.zeros(V), jnp.ones((V, 1)), LossConfig(beta=0.0, tis_cap=2.0),
                              sampler_logp_BxT=samp)
    assert float(m["mismatch_kl"]) == pytest.approx(float(np.sum(s * np.log(s / t))), rel=1e-12)
    # the review's two-token case: 0.511, where the old formula gave 1.267
    t2, s2 = np.array([0.9, 0.1]), np.array([0.5, 0.5])
    _, m2 = losses.policy_loss(jnp.log(jnp.asarray(t2))[None], jnp.log(jnp.asarray(t2))[None], None, None,
                               jnp.zeros(1), jnp.ones((1, 2)), LossConfig(beta=0.0, tis_cap=2.0),
                               sampler_logp_BxT=jnp.log(jnp.asarray(s2))[None])
    assert float(m2["mismatch_kl"]) == pytest.approx(float(np.sum(s2 * np.log(s2 / t2))), rel=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_matches_its_definition(level):
    """MiniMax-M1's CISPO as TRL writes it: -clamp(r, max=epsilon_high).detach() * A * logp, normalised by the
    generation batch's tokens: the gradient is -min(r, eps_high) A on every token, clipped or not."""
    c, j = make_tensors(8)
    cfg = LossConfig(loss_type="cispo", beta=0.05, eps_high=1.05, importance_sampling_level=level)
    met = _check(cfg, c, j, n_batch=int(c["m"].sum()) + 5)
    assert met["clip_high"] > 0  # some ratios above the cap: PPO would zero their gradient, CISPO keeps it
    lp = jnp.zeros((1, 3)) - 1.0
    old = lp - jnp.log(jnp.asarray([[2.0, 1.0, 0.5]]))  # ratios 2, 1, 0.5
    g = jax.grad(lambda x: losses.policy_loss(x, old, None, None, jnp.ones(1), jnp.ones((1, 3)),
                                              LossConfig(loss_type="cispo", beta=0.0, eps_high=1.5))[0])(lp)
    np.testing.assert_allclose(np.asarray(g), [[-1.5 / 3, -1.0 / 3, -0.5 / 3]], rtol=1e-12)


@pytest.mark.parametrize("loss_type,frac", [("grpo", 1.0), ("dapo", 1.0), ("bnpo", 0.5)])
def test_entropy_bonus_matches_its_definition(loss_type, frac):
    """TRL's entropy_coef: loss - coef x (mean entropy over the tokens that keep the policy gradient; for dapo the
    generation batch's tokens); its gradient in the entropy is -coef / that count on those tokens."""
    c, j = make_tensors(9)
    ent = np.random.default_rng(90).gamma(2.0, 0.5, size=c["lp"].shape)
    n_batch = int(c["m"].sum()) + 3 if loss_type == "dapo" else None
    cfg = LossConfig(loss_type=loss_type, beta=0.05, entropy_coef=0.01, entropy_top_frac=frac)
    met = _check(cfg, c, j, n_batch, ent=ent)
    assert met["entropy_loss"] < 0
    dent = jax.grad(lambda e: losses.policy_loss(j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"], cfg,
                                                 num_batch_tokens=n_batch, entropy_BxT=e)[0])(
        jnp.asarray(np.where(c["m"], ent, 0.0)))
    denom = n_batch if loss_type == "dapo" else int(np.ceil(frac * c["m"].sum()))
    got = np.asarray(dent)[c["m"]]
    assert np.all((np.abs(got + 0.01 / denom) < 1e-12) | (got == 0)) and (got != 0).sum() >= frac * c["m"].sum()


def test_opsm_drops_only_negative_off_policy_sequences():
    """Two rows, the sampler far below the policy on both (mean log ratio 2 > 0.5): the A < 0 row leaves the
    policy gradient, the A > 0 row stays; with a looser threshold both stay."""
    lp = jnp.zeros((2, 2)) - 1.0
    samp = lp + 2.0  # mean_t (sampler - policy) = 2
    run = lambda thr: losses.policy_loss(lp, None, None, None, jnp.asarray([1.0, -1.0]), jnp.ones((2, 2)),
                                         LossConfig(beta=0.0, loss_type="bnpo", opsm_threshold=thr),
                                         sampler_logp_BxT=samp)
    loss, m = run(0.5)
    assert float(loss) == pytest.approx(-0.5) and float(m["opsm_masked"]) == 0.5  # (-1 - 1 + 0 + 0) / 4
    loss, m = run(3.0)
    assert float(loss) == pytest.approx(0.0) and float(m["opsm_masked"]) == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("frac", [0.2, 0.5])
def test_high_entropy_token_selection_matches_numpy(loss_type, frac):
    """Only the top `frac` of the completion tokens by entropy keep the policy gradient; the KL term keeps
    every token. With ties: the entropies are rounded so that the threshold value repeats."""
    c, j = make_tensors(7)
    ent = np.round(np.random.default_rng(70).gamma(2.0, 0.5, size=c["lp"].shape), 1)
    met = _check(LossConfig(loss_type=loss_type, beta=0.07, entropy_top_frac=frac), c, j, ent=ent)
    assert frac <= met["pg_token_frac"] < frac + 0.15
    with pytest.raises(ValueError, match="entropy_BxT"):
        losses.policy_loss(j["lp"], j["old"], j["ref"], j["logq"], j["adv"], j["m"],
                           LossConfig(entropy_top_frac=frac))


def test_a_masked_row_changes_neither_the_loss_nor_its_normaliser():
    """A row with no loss token (a dynamic-sampling fill-in, an overlong-filtered row) is not a row of the batch,
    for every aggregation: the loss with it equals the loss without it."""
    lp, adv = jnp.full((2, 3), -1.0), jnp.array([1.0, 5.0])
    m = jnp.array([[1, 1, 1], [0, 0, 0]])
    for lt in losses.LOSS_TYPES:
        cfg = LossConfig(beta=0.0, loss_type=lt)
        with_row = losses.policy_loss(lp, None, None, None, adv, m, cfg)[0]
        alone = losses.policy_loss(lp[:1], None, None, None, adv[:1], m[:1], cfg)[0]
        assert float(with_row) == pytest.approx(float(alone), abs=1e-12), lt


# ---------------------------------------------------------------------------- SAGE's two forms, enumerated
def _tree_expected_grads(T, V=3, seed=0, beta=0.3):
    """A tabular policy over sequences of T tokens from V: at every prefix a softmax over its own logits (the
    parameters), a reference distribution and a positive q per next token. Returns, for q and for q = 1, the
    expected gradient of the code's loss over y ~ pi (sum_y pi(y) grad loss(y), pi(y) a constant: the sampled
    data) for both SAGE forms, and the closed forms of losses.py's docstring computed by walking the tree."""
    rng = np.random.default_rng(seed)
    prefixes = [p for n in range(T) for p in itertools.product(range(V), repeat=n)]
    index = {p: i for i, p in enumerate(prefixes)}
    theta = jnp.asarray(rng.normal(size=(len(prefixes), V)))
    ref = rng.dirichlet(np.ones(V), size=len(prefixes))
    q_table = rng.uniform(0.6, 1.4, size=(len(prefixes), V))
    seqs = list(itertools.product(range(V), repeat=T))

    def code_expected(form, q_tab):
        cfg = LossConfig(beta=beta, sage_form=form, loss_type="bnpo")
        rows = np.array([[index[y[:t]] for t in range(T)] for y in seqs])  # S x T: the prefix of each position
        toks = np.array(seqs)
        rf = jnp.asarray(np.log(ref[rows, toks]))
        lq = jnp.asarray(np.log(q_tab[rows, toks]))

        def total(th):  # sum_y pi(y) loss(y), pi(y) a constant (the sampled data)
            lsm = jax.nn.log_softmax(th)
            lp = lsm[rows, toks]  # S x T
            p_y = jnp.exp(jax.lax.stop_gradient(lp).sum(-1))
            one = lambda i: losses.policy_loss(lp[i][None], None, rf[i][None], lq[i][None], jnp.zeros((1,)),
                                               jnp.ones((1, T)), cfg)[0]
            return sum(p_y[i] * one(i) for i in range(len(seqs)))

        return np.asarray(jax.jit(jax.grad(total))(theta))

    def closed_form(form, q_tab):
        pi = np.asarray(jax.nn.softmax(theta))

        def future_log_q(prefix):  # E[sum of log q over the positions after `prefix` | prefix]
            if len(prefix) == T:
                return 0.0
            r = index[prefix]
            return sum(pi[r, v] * (np.log(q_tab[r, v]) + future_log_q(prefix + (v,))) for v in range(V))

        g = np.zeros(theta.shape)
        for prefix in prefixes:
            r = index[prefix]
            p_prefix = np.prod([pi[index[prefix[:t]], prefix[t]] for t in range(len(prefix))])
            if form == "loss":
                coef = q_tab[r] * ref[r]
            else:
                Q = np.array([np.log(q_tab[r, v]) + future_log_q(prefix + (v,)) for v in range(V)])
                coef = ref[r] + pi[r] * Q
            # sum_v coef_v grad log pi(v | prefix), whose gradient lives in row r: coef - pi * sum(coef)
            g[r] += -beta * p_prefix * (coef - pi[r] * coef.sum()) / T  # bnpo: / T tokens
        return g

    ones = np.ones_like(q_table)
    return {(form, qn): (code_expected(form, qt), closed_form(form, qt))
            for form in ("loss", "reward") for qn, qt in (("q", q_table), ("1", ones))}


@pytest.mark.parametrize("T", [1, 2, 3])
def test_sage_forms_expected_gradients_match_the_closed_forms(T):
    """Enumerated exactly over all V^T sequences (V = 3): the loss form's expected gradient is
    -beta sum_t E[sum_v q ref grad log pi], the reward form's -beta sum_t E[sum_v (ref + pi Q_t) grad log pi] with
    Q_t the token's log q plus the expected log q still to come; they differ unless q = 1."""
    out = _tree_expected_grads(T)
    for (form, qn), (code, closed) in out.items():
        np.testing.assert_allclose(code, closed, rtol=1e-9, atol=1e-13, err_msg=f"{form}, q={qn}, T={T}")
    assert np.abs(out[("loss", "q")][0] - out[("reward", "q")][0]).max() > 1e-3
    np.testing.assert_allclose(out[("loss", "1")][0], out[("reward", "1")][0], rtol=1e-9, atol=1e-13)
    with pytest.raises(ValueError, match="sage.form"):
        LossConfig(sage_form="objective")
