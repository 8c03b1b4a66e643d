"""Sampler/trainer corrections (TIS, MIS at three levels), high-entropy token selection and SAGE's two forms,
each against the float64 NumPy loop reference of tests/loss_reference.py or an exact enumeration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loss_reference import make_tensors, np_policy_loss

from sage_jax.rl import losses
from sage_jax.rl.losses import LossConfig

pytestmark = pytest.mark.usefixtures("x64")  # float64 references (tests/conftest.py)


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
