"""Gradient accumulation: 4 micro-batches summed into one update equal one batch 4x the size (1e-5),
for every loss aggregation (each micro-batch normalised by the update's denominators, `losses.normalizer`),
and in the step for bnpo and for entropy_top_frac (taken over the whole update)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sage_jax.policy import state as train_state
from sage_jax.rl import losses, step as R
from sage_jax.rl.update import accumulate_grads

A, B, T, D, V = 4, 16, 7, 8, 11


def _data():
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (B, T, D))
    targets = jax.random.randint(k[1], (B, T), 0, V)
    lengths = jax.random.randint(k[2], (B,), 0, T + 1).at[0].set(0).at[1].set(T)  # an empty and a full row
    mask = (jnp.arange(T)[None] < lengths[:, None]).astype(jnp.int32)
    old = jax.random.normal(k[3], (B, T)) * 0.3 - 2.5
    ref = jax.random.normal(k[4], (B, T)) * 0.3 - 2.5
    adv = jax.random.normal(k[5], (B,))
    w = 0.3 * jax.random.normal(jax.random.key(9), (D, V))
    return w, dict(x=x, targets=targets, mask=mask, old=old, ref=ref, adv=adv)


def _loss(w, d, cfg, n_gen, norm=None):
    logp_all = jax.nn.log_softmax(d["x"] @ w, axis=-1)
    logp = jnp.take_along_axis(logp_all, d["targets"][..., None], axis=-1)[..., 0]
    log_q = 0.1 * jnp.tanh(d["ref"])
    return losses.policy_loss(logp, d["old"], d["ref"], log_q, d["adv"], d["mask"], cfg, num_batch_tokens=n_gen,
                              norm=norm)[0]


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_accumulated_equals_big_batch(loss_type):
    cfg = losses.LossConfig(loss_type=loss_type, beta=0.04, eps_low=0.1, eps_high=0.1)
    w, d = _data()
    n_gen = d["mask"].sum()
    big_loss, big_grad = jax.value_and_grad(_loss)(w, d, cfg, n_gen)

    rows = B // A
    micro = lambda j: jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, j * rows, rows, 0), d)

    norm = losses.normalizer(d["mask"], n_gen)  # the update's denominators, over all its micro-batches
    micro_fn = lambda w, j: (_loss(w, micro(j), cfg, n_gen, norm), {})

    acc_loss, _, acc_grad = jax.jit(lambda w: accumulate_grads(micro_fn, w, A))(w)
    np.testing.assert_allclose(float(acc_loss), float(big_loss), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(acc_grad), np.asarray(big_grad), atol=1e-5, rtol=0)
    assert float(jnp.abs(big_grad).max()) > 1e-3  # a real gradient, not two zeros
    # the naive accumulators are NOT exact here (so the test can tell): per-micro normalisers averaged
    naive = sum(jax.grad(lambda w: _loss(w, micro(j), cfg, None))(w) for j in range(A)) / A
    if loss_type != "dapo":  # (dapo's denominator is the generation batch's anyway)
        assert float(jnp.abs(naive - big_grad).max()) > 1e-4


def _sgd_step(loss_type, accum, **loss_kw):
    from sage_jax.models.decoder import Decoder
    from sage_jax.models.tiny import tiny_config
    from sage_jax.rewards.host import HostReward
    from sage_jax.sampling import SamplingConfig
    from tests import rl_fixtures as F

    cfg = R.RLConfig(group_size=4, sampling=SamplingConfig(max_new_tokens=8, eos_ids=(2,), pad_id=0),
                     loss=losses.LossConfig(loss_type=loss_type, beta=0.04, **loss_kw), grad_accum_steps=accum)
    model = Decoder(tiny_config(hidden_size=32, num_layers=1), rngs=nnx.Rngs(0))
    tx = optax.sgd(1.0)  # the update is -grad: compares gradients, not Adam's normalised steps
    graphdef, state = train_state.init_train_state(model, cfg, tx, 0)
    p0 = jax.tree.map(np.asarray, state.params)
    step = jax.jit(lambda s, b: R.rl_step(s, b, graphdef=graphdef, cfg=cfg, tx=tx, lr_fn=lambda s: 1.0,
                                           reward_host=HostReward(F.TOK, F.count_ones)))
    new, m = step(state, F.batch())
    return jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, p0), m


def test_rl_step_accumulation_equals_one_batch():
    """End to end through `rl_step` (same rollout: same key and params): bnpo, the mode whose per-micro
    normaliser must become the whole batch's."""
    d1, m1 = _sgd_step("bnpo", 1)
    d4, m4 = _sgd_step("bnpo", 4)
    for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d4)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(m4["train/loss"]), float(m1["train/loss"]), atol=1e-5)
    assert max(float(np.abs(a).max()) for a in jax.tree.leaves(d1)) > 1e-4


def test_entropy_top_fraction_is_taken_over_the_update():
    """rl.entropy_top_frac with accumulation: the top fraction of the whole update's tokens keep the policy
    gradient, as without accumulation (per micro-batch, the selection and so the update would differ)."""
    d1, m1 = _sgd_step("grpo", 1, entropy_top_frac=0.2)
    d4, m4 = _sgd_step("grpo", 4, entropy_top_frac=0.2)
    for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d4)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(m4["train/pg_token_frac"]), float(m1["train/pg_token_frac"]), atol=1e-6)
