"""rl.length_buckets: the training-side passes over rows sorted by length, each chunk at the smallest static length
that holds it. The reference is the padded step (length_buckets = 1), which computes every pass over the whole
[B, P + T] rectangle: the bucketed step must give the same scores, loss, gradients and metrics (fp32), on ragged
lengths that include a row with no completion token and rows at the cap."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rl_fixtures import TOK, batch, setup

from sage_jax.policy.logprobs import length_grid, sorted_chunks
from sage_jax.policy.state import merge_policy
from sage_jax.rl import guides, losses, step as R
from sage_jax.rl.rollout import Rollout
from sage_jax.rl.update import reduce_metrics, update_scan
from sage_jax.sampling import SamplingConfig

T = 16
# 16 rows (4 prompts x 4): a row with no completion token (a stop at once), two at the cap, the rest in between
LENGTHS = [0, 16, 1, 5, 3, 16, 7, 2, 9, 11, 4, 6, 13, 8, 10, 12]


def test_length_grid_is_k_even_steps_ending_at_t():
    assert length_grid(16, 4) == (4, 8, 12, 16)
    assert length_grid(10, 4) == (3, 5, 8, 10)  # ceil(10 k / 4)
    assert length_grid(16, 1) == (16,)
    assert length_grid(3, 3) == (1, 2, 3)


def test_sorted_chunks_put_the_longest_rows_in_chunk_zero():
    lengths = jnp.asarray(LENGTHS)
    C = 4
    perm = np.asarray(sorted_chunks(lengths, C))
    assert sorted(perm) == list(range(16))  # a permutation
    chunks = [sorted(np.asarray(LENGTHS)[perm[c::C]].tolist()) for c in range(C)]
    assert chunks == [[12, 13, 16, 16], [8, 9, 10, 11], [4, 5, 6, 7], [0, 1, 2, 3]]  # by hand, from LENGTHS


def _rollout(seed=0):
    rng = np.random.default_rng(seed)
    N, G, P = 4, 4, 6
    prompt = rng.integers(3, len(TOK), size=(N, P))
    pmask = np.ones((N, P), np.int32)
    pmask[0, :2] = 0  # left padding
    pmask[2, :1] = 0
    prompt = prompt * pmask
    cmask = (np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.int32)
    tokens = rng.integers(3, len(TOK), size=(N * G, T)) * cmask  # pad id 0 after the end
    lmask = cmask.copy()
    lmask[6] = 0  # a row out of the loss (an overlong filter, a dynamic-sampling fill-in)
    raw = -rng.uniform(0.1, 3.0, size=(N * G, T)).astype(np.float32) * cmask
    adv = rng.normal(size=N * G).astype(np.float32)
    f = lambda x, d=jnp.int32: jnp.asarray(x, d)
    return Rollout(f(prompt), f(pmask), f(tokens), f(cmask), f(lmask), f(raw, jnp.float32), f(adv, jnp.float32), {})


def _step(buckets, **rl):
    """(scores, new params, the step's metrics) of the no-gradient passes and the update scan on `_rollout()`,
    under SGD at lr 1 (new params = params - the summed gradients, so gradients are compared linearly)."""
    cfg, graphdef, state, _ = setup(tx=optax.sgd(1.0), lr=1.0, length_buckets=buckets,
                                    sampling=SamplingConfig(max_new_tokens=T, eos_ids=(2,), pad_id=0), **rl)
    merge = lambda p: merge_policy(graphdef, p, state.frozen_params)

    @jax.jit
    def run(state, ro):
        scores = R.no_gradient_passes(state, ro, merge, cfg)
        (params, _, _), ms = update_scan(state, ro, scores, merge, cfg, optax.sgd(1.0), lambda s: jnp.float32(1.0),
                                         jax.random.PRNGKey(3))
        return scores, params, reduce_metrics(ms)

    return run(state, _rollout())


@pytest.mark.parametrize("K,rl", [
    # shared prompts, 2 updates (an `old` pass), the branch guide on the reference's entropy; chunks of 2 rows
    # hold fewer rows than there are prompts, so each row takes its own prompt
    (4, dict(share_prompt=True, num_minibatches=2, guide=guides.make_guide("branch", source="ref"),
             loss=losses.LossConfig(beta=0.04))),
    # shared prompts, 2 iterations; chunks of 8 rows: every prompt's forward once per chunk, gathered per row
    (2, dict(share_prompt=True, num_iterations=2, guide="branch", loss=losses.LossConfig(beta=0.04))),
    # repeated prompts, accumulation, token-level loss, the entropy selection over the whole update, a score chunk,
    # the branch guide on the policy's entropy (the token and random guides draw noise per position: not compared)
    (2, dict(share_prompt=False, grad_accum_steps=2, score_chunks=2, guide="branch",
             loss=losses.LossConfig(beta=0.04, loss_type="dapo", entropy_top_frac=0.5))),
], ids=["shared-per-row-M2", "shared-gathered-iter2", "repeated-J2-dapo-top-entropy"])
def test_bucketed_step_equals_the_padded_step(K, rl):
    ref_scores, ref_params, ref_m = _step(1, **rl)
    got_scores, got_params, got_m = _step(K, **rl)
    cmask = np.asarray(_rollout().cmask_BxT, bool)
    for name, a, b in zip(("ref_logp", "ref_entropy", "old_logp"), ref_scores, got_scores):
        assert (a is None) == (b is None), name
        if a is not None:  # on the real tokens; the bucketed pass leaves 0 on the cut padding
            np.testing.assert_allclose(np.asarray(b)[cmask], np.asarray(a)[cmask], rtol=1e-5, atol=1e-5, err_msg=name)
    assert set(got_m) == set(ref_m)
    for k in ref_m:
        np.testing.assert_allclose(np.asarray(got_m[k]), np.asarray(ref_m[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    # SGD at lr 1: params - summed gradients; the gradients agree to fp32 (relative to their scale)
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(got_params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    assert float(ref_m["train/kl"]) != 0 and float(ref_m["train/grad_norm"]) > 0  # the passes mattered


def test_the_bucketed_step_compiles_once():
    """Steps whose lengths differ run the same executable: a lax.switch among the static lengths."""
    cfg, _, state, step = setup(length_buckets=2, loss=losses.LossConfig(beta=0.0), guide="none")
    for _ in range(2):
        state, m = step(state, batch())
    assert step._cache_size() == 1
    with pytest.raises(ValueError, match="rl.length_buckets=3 does not divide"):
        R.RLConfig(group_size=4, length_buckets=3).check_batch(4)
    with pytest.raises(ValueError, match=r"rl.length_buckets=0 must be in \[1"):
        R.RLConfig(length_buckets=0)
