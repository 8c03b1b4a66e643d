"""Query-chunked attention (`model.attention_chunk`): the same numbers as one pass, forward and backward, in
the cache-free call and the prefill over a cache; and the compiled program holds fewer score bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.models.decoder import Decoder, positions_from_mask
from sage_jax.models.tiny import tiny_config
from sage_jax.policy.logprobs import grouped_logp_entropy, sequence_logp_entropy

ATOL = 1e-5  # fp32, a handful of ops apart at most (each chunk's softmax is the same row's softmax)


def _close(a, b):
    """fp32 agreement relative to the tensor's scale: gradients are sums over every position, and a
    different summation order moves the last bits of large entries (1e-5 of the largest, not absolute)."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, atol=ATOL * max(1.0, float(np.abs(b).max())))


def _model(chunk=0, seed=0, **cfg):
    return Decoder(tiny_config(hidden_size=64, num_layers=2, **cfg), rngs=nnx.Rngs(seed), attention_chunk=chunk)


def _batch(B=3, T=11, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 60, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    mask[1, :4] = 0  # left padding
    mask[-1, :7] = 0
    return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.mark.parametrize("chunk", [1, 3, 4, 10])
def test_chunked_forward_and_gradient_equal_one_pass(chunk):
    tokens, mask = _batch()
    pos = positions_from_mask(mask)
    full, part = _model(0), _model(chunk)
    g_full, p_full = nnx.split(full)
    g_part, p_part = nnx.split(part)

    def loss(g, p):
        h = nnx.merge(g, p).forward(tokens, pos, mask)[0]
        return (h * mask[..., None]).sum() / 7.0, h

    (l0, h0), d0 = jax.value_and_grad(loss, argnums=1, has_aux=True)(g_full, p_full)
    (l1, h1), d1 = jax.value_and_grad(loss, argnums=1, has_aux=True)(g_part, p_part)
    m = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(h1)[m], np.asarray(h0)[m], atol=ATOL)
    for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d0)):
        _close(a, b)


def test_chunked_prefill_over_a_cache_scores_the_same():
    """The prompt-shared scoring writes the prompt, then the completions, into a cache: both multi-token calls."""
    tokens, mask = _batch(B=2, T=9)
    comp = jnp.asarray(np.random.default_rng(3).integers(3, 60, (6, 7)).astype(np.int32))
    cmask = jnp.ones_like(comp).at[4, 5:].set(0)
    out0 = grouped_logp_entropy(_model(0), tokens, mask, comp, cmask, 256)
    out1 = grouped_logp_entropy(_model(2), tokens, mask, comp, cmask, 256)
    for a, b in zip(out1, out0):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL)


def test_chunks_hold_fewer_score_bytes():
    """Forward + backward of a 2-layer model at T = 256: one pass keeps rows x heads x T^2 float32 scores
    per layer; chunks of 32 queries keep 32 x T of them at a time. The compiled temporaries must drop by
    at least half of one layer's score tensor (the saving is more: the backward keeps one per layer)."""
    B, T, C = 2, 256, 32
    tokens = jnp.zeros((B, T), jnp.int32)
    mask = jnp.ones((B, T), jnp.int32)

    def temp_bytes(chunk):
        g, p = nnx.split(_model(chunk))
        f = lambda p: sequence_logp_entropy(nnx.merge(g, p), tokens, mask, 1, 64)[0].sum()
        return jax.jit(jax.grad(f)).lower(p).compile().memory_analysis().temp_size_in_bytes

    heads = tiny_config(hidden_size=64, num_layers=2).num_heads
    one_layer_scores = B * heads * T * T * 4
    saving = temp_bytes(0) - temp_bytes(C)
    assert saving >= 0.5 * (one_layer_scores - B * heads * C * T * 4), (saving, one_layer_scores)


def test_negative_chunk_is_refused():
    with pytest.raises(ValueError, match="attention chunk"):
        _model(-1)


def test_attention_softmax_derivative_is_the_softmax_jacobian_without_division():
    """The attention softmax (`decoder._softmax`) gives the probabilities and the vector-Jacobian product of the
    softmax differentiated through its quotient (fp32), also on a fully masked row (uniform, finite); and its
    backward holds no division over the scores' shape (the quotient rule's backward holds several)."""
    from sage_jax.models.decoder import _NEG_INF, _softmax

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 7)) * 4, jnp.float32)
    mask = np.ones((3, 5, 7), bool)
    mask[0, 1, 4:] = False
    mask[2, 3, :] = False  # a padding query row
    g = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)

    def quotient(x):  # the textbook softmax, differentiated by autodiff through exp and the division
        z = jnp.where(mask, x, _NEG_INF)
        e = jnp.exp(z - jax.lax.stop_gradient(z.max(-1, keepdims=True)))
        return e / e.sum(-1, keepdims=True)

    y, vjp = jax.vjp(lambda x: _softmax(x, mask, jnp.float32), x)
    y_ref, vjp_ref = jax.vjp(quotient, x)
    np.testing.assert_allclose(y, y_ref, atol=1e-6)
    np.testing.assert_allclose(y[2, 3], np.full(7, 1 / 7), atol=1e-6)
    np.testing.assert_allclose(vjp(g)[0], vjp_ref(g)[0], atol=1e-6)
    _, jvp_out = jax.jvp(lambda x: _softmax(x, mask, jnp.float32), (x,), (g,))  # forward mode agrees too
    np.testing.assert_allclose(jvp_out, jax.jvp(quotient, (x,), (g,))[1], atol=1e-6)

    def full_shape_divisions(f):
        jaxpr = jax.make_jaxpr(jax.grad(lambda x: (f(x) * g).sum()))(x)
        return sum(e.primitive.name == "div" and e.outvars[0].aval.shape == x.shape for e in jaxpr.jaxpr.eqns)

    assert full_shape_divisions(quotient) > 1  # the check can see the quotient rule's backward
    assert full_shape_divisions(lambda x: _softmax(x, mask, jnp.float32)) <= 1  # the forward's e / sum only
