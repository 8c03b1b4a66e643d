"""Learning-rate schedules: warmup is applied (values at 0, W/2, W match the formula) for every decay."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sage_jax.policy import optim


@pytest.mark.parametrize("schedule", optim.SCHEDULES)
def test_warmup_values_match_formula(schedule):
    peak, W, N = 3e-4, 10, 100
    fn = optim.lr_schedule(optim.OptimConfig(learning_rate=peak, schedule=schedule, warmup_steps=W, total_steps=N))
    # warmup: peak * (s + 1) / (W + 1) for s < W; at s = W the decay starts at its peak
    np.testing.assert_allclose(float(fn(0)), peak * 1 / (W + 1), rtol=1e-6)
    np.testing.assert_allclose(float(fn(W // 2)), peak * (W // 2 + 1) / (W + 1), rtol=1e-6)
    np.testing.assert_allclose(float(fn(W)), peak, rtol=1e-6)
    assert float(fn(0)) > 0  # step 0 trains
    vals = np.array([float(fn(s)) for s in range(W + 1)])
    assert np.all(np.diff(vals) > 0)  # monotone ramp up to the peak
    end = float(fn(N))
    if schedule == "constant":
        np.testing.assert_allclose(end, peak, rtol=1e-6)
    else:
        np.testing.assert_allclose(end, 0.0, atol=1e-12)
    if schedule == "cosine":
        np.testing.assert_allclose(float(fn(W + (N - W) // 2)), peak / 2, rtol=1e-5)
    if schedule == "linear":
        np.testing.assert_allclose(float(fn(W + (N - W) // 2)), peak / 2, rtol=1e-5)


def test_warmup_applied_through_the_optimizer():
    """The optimizer actually uses the warmed-up lr: the first AdamW step size is ~ lr(0)."""
    import jax.numpy as jnp

    peak, W = 1e-2, 4
    tx, fn = optim.make_optimizer(optim.OptimConfig(learning_rate=peak, warmup_steps=W, weight_decay=0.0,
                                                    grad_clip_norm=None))
    p = {"w": jnp.zeros((3,))}
    st = tx.init(p)
    upd, st = tx.update({"w": jnp.ones((3,))}, st, p)
    # Adam's first update is -lr * g / (|g| + eps) ~ -lr
    np.testing.assert_allclose(np.asarray(upd["w"]), -peak / (W + 1), rtol=1e-5)
    for _ in range(W):
        upd, st = tx.update({"w": jnp.ones((3,))}, st, p)
    np.testing.assert_allclose(np.asarray(upd["w"]), -peak, rtol=1e-5)


def test_weight_decay_and_clip_act():
    """Decoupled weight decay moves a parameter by -lr * wd * p under a zero gradient, and the clip scales a
    gradient of norm 20 to norm 1 before it reaches Adam's first moment (0.1 x the clipped gradient)."""
    tx, _ = optim.make_optimizer(optim.OptimConfig(learning_rate=0.1, weight_decay=0.5, grad_clip_norm=1.0))
    p = {"w": jnp.full((4,), 2.0)}
    st = tx.init(p)
    upd, st = tx.update({"w": jnp.zeros((4,))}, st, p)
    np.testing.assert_allclose(np.asarray(upd["w"]), -0.1 * 0.5 * 2.0, rtol=1e-6)
    _, st = tx.update({"w": jnp.full((4,), 10.0)}, st, p)  # norm 20 -> clipped to 1: each entry 0.5
    mu = optax.tree.get(st, "mu")
    np.testing.assert_allclose(np.asarray(mu["w"]), 0.1 * 0.5, rtol=1e-6)
