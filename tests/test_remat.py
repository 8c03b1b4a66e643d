"""Rematerialisation policies (none / full / dots) give the same loss and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import tiny_config
from sage_jax.policy.logprobs import sequence_logp_entropy


@functools.lru_cache(maxsize=None)
def _loss_and_grads(remat):
    model = Decoder(tiny_config(hidden_size=64, num_layers=2), rngs=nnx.Rngs(0), remat=remat)
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 1, model.cfg.vocab_size)
    mask = jnp.ones_like(tokens).at[0, :3].set(0)

    def loss(p):
        logp, ent = sequence_logp_entropy(nnx.merge(graphdef, p), tokens, mask, 5, chunk=4)
        return -(logp.mean()) + 0.1 * (logp ** 2).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_same_loss_and_grads(remat):
    l0, g0 = _loss_and_grads("none")
    l1, g1 = _loss_and_grads(remat)
    np.testing.assert_allclose(float(l1), float(l0), atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


def test_remat_is_in_the_compiled_program():
    """'full' actually rematerialises: the jaxpr of the gradient carries a checkpoint (remat) primitive."""
    model = Decoder(tiny_config(hidden_size=64, num_layers=2), rngs=nnx.Rngs(0), remat="full")
    graphdef, params = nnx.split(model)
    tokens = jnp.ones((1, 6), jnp.int32)
    f = lambda p: nnx.merge(graphdef, p)(tokens).sum()
    assert "checkpoint" in str(jax.make_jaxpr(jax.grad(f))(params)) or "remat" in str(jax.make_jaxpr(jax.grad(f))(params))
    with pytest.raises(ValueError, match="remat"):
        Decoder(tiny_config(hidden_size=64, num_layers=2), remat="bogus")


def test_remat_from_config():
    from sage_jax import config_lib, defaults
    from sage_jax.rl import step as R

    c = defaults.default_config()
    assert config_lib.rl_config(c).remat == "none"
    c.model.remat = "dots"
    assert config_lib.rl_config(c).remat == "dots"
    with pytest.raises(ValueError, match="remat"):
        R.RLConfig(remat="bogus")


def test_rl_remat_reaches_the_training_forward_only():
    """`rl.remat` rematerialises the blocks of the step's training forward (more remat primitives in the
    step's program than with "none"), and leaves the model's own setting alone (its graphdef still says none)."""
    from rl_fixtures import batch, setup

    counts = {}
    for remat in ("none", "full"):
        _, graphdef, state, step = setup(remat=remat)
        counts[remat] = str(jax.make_jaxpr(step)(state, batch())).count("remat")
        assert nnx.merge(graphdef, state.params).remat == "none"
    assert counts["full"] > counts["none"], counts
    with pytest.raises(ValueError, match="remat"):
        Decoder(tiny_config(hidden_size=64, num_layers=2)).forward(
            jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32), remat="bogus")
