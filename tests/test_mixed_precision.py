"""Mixed precision: params stored in float32 or bfloat16, compute in bfloat16, while the log-softmax,
entropy and loss reductions run in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax import config_lib, defaults
from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import tiny_config
from sage_jax.rl import losses
from sage_jax.policy.logprobs import sequence_logp_entropy


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_compute_float32_reductions(param_dtype):
    cfg = tiny_config(hidden_size=64, num_layers=2)
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(param_dtype)}
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 1, cfg.vocab_size)
    mask = jnp.ones_like(tokens).at[0, :2].set(0)
    P = 5
    hidden = jax.eval_shape(lambda: model.forward(tokens, jnp.cumsum(mask, -1) - 1, mask)[0])
    assert hidden.dtype == jnp.bfloat16  # the blocks compute in bf16
    assert jax.eval_shape(lambda: model(tokens, mask)).dtype == jnp.float32  # logits accumulate in f32

    cmask = jnp.ones((4, tokens.shape[1] - P), jnp.int32).at[1, 4:].set(0)
    adv = jnp.array([1.0, -0.5, 0.3, -0.8])

    def loss_fn(p):
        logp, ent = sequence_logp_entropy(nnx.merge(graphdef, p), tokens, mask, P, chunk=4)
        loss, m = losses.policy_loss(logp, None, jax.lax.stop_gradient(logp) - 0.1, None, adv, cmask,
                                     losses.LossConfig(beta=0.04))
        return loss, (logp, ent, m)

    (loss, (logp, ent, m)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    assert loss.dtype == jnp.float32 and m["kl"].dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(param_dtype)}
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))

    # the log-softmax reductions see f32: every reduce over the vocab axis in the program is f32
    jaxpr = jax.make_jaxpr(lambda p: loss_fn(p)[0])(params)
    V = cfg.vocab_size
    seen = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name in ("reduce_max", "reduce_sum") and eqn.invars[0].aval.shape[-1:] == (V,):
                seen.append(eqn.invars[0].aval.dtype)
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub.jaxpr)

    walk(jaxpr.jaxpr)
    assert seen and all(d == jnp.float32 for d in seen), seen

    # bf16 compute stays close to the f32 model (same weights)
    ref = Decoder(cfg, rngs=nnx.Rngs(0))
    nnx.update(ref, jax.tree.map(lambda x: x.astype(jnp.float32), params))  # bf16-initialised weights differ
    lp32, _ = nnx.jit(lambda r: sequence_logp_entropy(r, tokens, mask, P, chunk=4))(ref)
    assert np.abs(np.asarray(lp32) - np.asarray(logp)).max() < 0.1


def test_dtypes_from_config():
    c = defaults.default_config()
    c.model.dtype, c.model.param_dtype = "bfloat16", "bfloat16"
    assert config_lib.model_dtypes(c) == (jnp.bfloat16, jnp.bfloat16)
    c.model.param_dtype = "float32"
    assert config_lib.model_dtypes(c) == (jnp.bfloat16, jnp.float32)
