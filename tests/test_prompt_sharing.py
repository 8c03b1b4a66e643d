"""Prompt sharing: each prompt's forward pass once per group (prefill, reference and policy passes).

The reference implementation repeats every prompt G times; the shared passes must give the same
log-probs, entropies, gradients, samples and RL steps (fp32 reassociation only), with fewer FLOPs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rl_fixtures import batch, setup

from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import tiny_config
from sage_jax.policy.logprobs import grouped_logp_entropy, sequence_logp_entropy
from sage_jax.sampling import SamplingConfig, generate

N, G, P, T = 3, 4, 7, 9


def _inputs(vocab):
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, vocab, (N, P)), jnp.int32)
    pmask = jnp.asarray([[0, 0, 1, 1, 1, 1, 1], [1] * P, [0, 0, 0, 0, 0, 1, 1]], jnp.int32)  # left padding
    comp = jnp.asarray(rng.integers(3, vocab, (N * G, T)), jnp.int32)
    lengths = rng.integers(1, T + 1, (N * G, 1))  # completions that stopped early: masked tails
    cmask = jnp.asarray(np.arange(T)[None] < lengths, jnp.int32)
    return prompt, pmask, comp, cmask


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config(), rngs=nnx.Rngs(0))


def test_grouped_logp_entropy_and_gradients_match_repeated_prompts(model):
    prompt, pmask, comp, cmask = _inputs(model.cfg.vocab_size)
    tokens = jnp.concatenate([jnp.repeat(prompt, G, 0), comp], 1)
    fmask = jnp.concatenate([jnp.repeat(pmask, G, 0), cmask], 1)
    g, params = nnx.split(model)

    def loss(fn):
        def f(p):
            logp, ent = fn(nnx.merge(g, p))
            return (logp * cmask).sum(), (logp, ent)
        return jax.value_and_grad(f, has_aux=True)(params)

    (_, (lp_ref, ent_ref)), g_ref = loss(lambda m: sequence_logp_entropy(m, tokens, fmask, P))
    (_, (lp, ent)), grads = loss(lambda m: grouped_logp_entropy(m, prompt, pmask, comp, cmask))
    np.testing.assert_allclose(lp, lp_ref, atol=1e-5)
    np.testing.assert_allclose(ent, ent_ref, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref)):  # the prompt's share reaches the weights
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()) + 1e-7)


def test_grouped_pass_costs_fewer_flops(model):
    prompt, pmask, comp, cmask = _inputs(model.cfg.vocab_size)
    tokens = jnp.concatenate([jnp.repeat(prompt, G, 0), comp], 1)
    fmask = jnp.concatenate([jnp.repeat(pmask, G, 0), cmask], 1)
    flops = lambda f, *a: jax.jit(f).lower(*a).compile().cost_analysis()["flops"]
    shared = flops(lambda *a: grouped_logp_entropy(model, *a), prompt, pmask, comp, cmask)
    repeated = flops(lambda t, m: sequence_logp_entropy(model, t, m, P), tokens, fmask)
    # The prompt positions run on N rows instead of N * G: (G - 1) / G of their P / (P + T) share saved.
    assert shared < repeated * (1 - 0.5 * (G - 1) / G * P / (P + T))


def test_grouped_rows_must_be_whole_groups(model):
    prompt, pmask, comp, cmask = _inputs(model.cfg.vocab_size)
    with pytest.raises(ValueError, match="whole number of groups"):
        grouped_logp_entropy(model, prompt, pmask, comp[:-1], cmask[:-1])


def test_generate_with_group_size_matches_repeated_prompts(model):
    prompt, pmask, _, _ = _inputs(model.cfg.vocab_size)
    cfg = SamplingConfig(max_new_tokens=12, eos_ids=(2,), temperature=1.0)
    key = jax.random.key(3)
    shared = generate(model, prompt, pmask, key, cfg, group_size=G)
    repeated = generate(model, jnp.repeat(prompt, G, 0), jnp.repeat(pmask, G, 0), key, cfg)
    np.testing.assert_array_equal(shared.tokens_BxT, repeated.tokens_BxT)
    np.testing.assert_array_equal(shared.mask_BxT, repeated.mask_BxT)
    np.testing.assert_allclose(shared.logp_BxT, repeated.logp_BxT, atol=1e-5)
    np.testing.assert_allclose(shared.entropy_BxT, repeated.entropy_BxT, atol=1e-5)


def _sgd_step(**rl):
    """One RL step under plain SGD (lr 1), so the parameter change is exactly minus the gradient: Adam's
    first step, g / (|g| + eps), would amplify fp32 noise in entries with |g| near eps."""
    # Two layers, as this tolerance was set on: with one, token 17's tied-embedding gradient is a sum whose
    # terms cancel to ~0.5, and reordering them (shared vs repeated prompts) moves it by ~3e-5
    _, _, state, step = setup(tx=optax.sgd(1.0), lr=1.0, num_layers=2, **rl)
    before = jax.device_get(state.params)  # the step donates its input state
    new_state, metrics = step(state, batch())
    grads = jax.tree.map(lambda a, b: a - b, before, jax.device_get(new_state.params))  # = the gradient
    return grads, jax.device_get(metrics)


@pytest.mark.parametrize("minibatches", [1, 2, 8])  # 8: micro-batches of 2 rows, not whole groups of 4
def test_rl_step_shared_equals_repeated(minibatches):
    (g1, m1), (g0, m0) = (_sgd_step(share_prompt=s, num_minibatches=minibatches) for s in (True, False))
    assert m1.keys() == m0.keys()
    for k in m0:  # samples, rewards, loss, KL, entropy, grad norm, ...
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-4, atol=1e-5, err_msg=k)
    for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, c, atol=1e-5 * float(np.abs(c).max()) + 1e-7)
