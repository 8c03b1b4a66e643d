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
    under SGD at lr 1 (new params = params - the summed gradients, so gradients are compared linearly).
    `buckets`: rl.length_buckets, or a dict of the real-token settings (rl.pack_buckets)."""
    real = buckets if isinstance(buckets, dict) else dict(length_buckets=buckets)
    cfg, graphdef, state, _ = setup(tx=optax.sgd(1.0), lr=1.0, **real,
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
    _assert_same_step(_step(1, **rl), _step(K, **rl))


@pytest.mark.parametrize("K,rl", [
    # shared prompts, 2 updates (an `old` pass) of whole groups, the branch guide on the reference's entropy
    (2, dict(share_prompt=True, num_minibatches=2, guide=guides.make_guide("branch", source="ref"),
             loss=losses.LossConfig(beta=0.04))),
    # rows shuffled across groups (every prompt prefilled per micro-batch), 2 iterations, 2 score chunks
    (4, dict(share_prompt=True, num_iterations=2, update_shuffle="rows", score_chunks=2, guide="branch",
             loss=losses.LossConfig(beta=0.04))),
    # repeated prompts in the padded step, accumulation, token-level loss, the entropy selection; one static count
    (1, dict(share_prompt=False, grad_accum_steps=2, guide="branch",
             loss=losses.LossConfig(beta=0.04, loss_type="dapo", entropy_top_frac=0.5))),
], ids=["groups-M2", "rows-shuffled-iter2-chunks2", "repeated-J2-dapo-top-entropy"])
def test_packed_step_equals_the_padded_step(K, rl):
    _assert_same_step(_step(1, **rl), _step(dict(pack_buckets=K), **rl))


def _assert_same_step(padded, got):
    (ref_scores, ref_params, ref_m), (got_scores, got_params, got_m) = padded, got
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


@pytest.mark.parametrize("real", [dict(length_buckets=2), dict(pack_buckets=2)], ids=["buckets", "packing"])
def test_the_real_token_step_compiles_once(real):
    """Steps whose lengths differ run the same executable: a lax.switch among static lengths (or row counts)."""
    cfg, _, state, step = setup(**real, loss=losses.LossConfig(beta=0.0), guide="none")
    for _ in range(2):
        state, m = step(state, batch())
    assert step._cache_size() == 1


def test_real_token_settings_are_checked():
    with pytest.raises(ValueError, match="rl.length_buckets=3 does not divide"):
        R.RLConfig(group_size=4, length_buckets=3).check_batch(4)
    with pytest.raises(ValueError, match=r"rl.length_buckets=0 must be in \[1"):
        R.RLConfig(length_buckets=0)
    with pytest.raises(ValueError, match="rl.pack_buckets=2 must be >= 0 .* exclusive with rl.length_buckets=2"):
        R.RLConfig(pack_buckets=2, length_buckets=2)


def test_pack_fills_rows_of_one_prompt_first_fit_longest_first():
    """First fit decreasing within each prompt, no row beyond T slots: worked by hand for T = 16."""
    from sage_jax.policy.packing import pack, row_grid
    lengths = jnp.asarray(LENGTHS)
    prompt_of = jnp.arange(16) // 4  # prompt 0: 0, 16, 1, 5; 1: 3, 16, 7, 2; 2: 9, 11, 4, 6; 3: 13, 8, 10, 12
    row, offset, rows = (np.asarray(x) for x in pack(lengths, prompt_of, T))
    # prompt 0: [16, 0] [5, 1] -> rows 0, 1 (the empty completion fits row 0 and takes no slot);
    # prompt 1: [16] [7, 3, 2] -> 2, 3; prompt 2: [11, 4] [9, 6] -> 4, 5; prompt 3: [13] [12] [10] [8] -> 6..9
    assert row.tolist() == [0, 0, 1, 1, 3, 2, 3, 3, 5, 4, 4, 5, 6, 9, 8, 7]
    assert offset.tolist() == [16, 0, 5, 0, 7, 0, 0, 10, 0, 0, 11, 9, 0, 0, 0, 0]
    assert int(rows) == 10
    assert row_grid(16, 4) == (4, 8, 12, 16) and row_grid(10, 4) == (3, 5, 8, 10) and row_grid(16, 1) == (16,)


def test_packed_scores_equal_the_shared_prompt_pass_under_attention_chunks_and_remat():
    """policy/packing against policy/logprobs' grouped pass (the padded reference) directly: log-probs, entropies and
    the gradient of their masked sum, with the decoder's query chunks (4 of the 16 slots: the segment mask is read per
    chunk) and full remat on the packed forward."""
    from flax import nnx

    from sage_jax.models.decoder import Decoder
    from sage_jax.models.tiny import tiny_config
    from sage_jax.policy.logprobs import grouped_logp_entropy
    from sage_jax.policy.packing import packed_logp_entropy, row_grid

    ro = _rollout()
    model = Decoder(tiny_config(num_layers=1), rngs=nnx.Rngs(0))
    model.set_attention_chunk(4)
    graphdef, params = nnx.split(model)
    cmask = np.asarray(ro.cmask_BxT, bool)
    prompt_of = jnp.arange(16) // 4

    def padded(p):
        return grouped_logp_entropy(nnx.merge(graphdef, p), ro.prompt_NxP, ro.pmask_NxP, ro.tokens_BxT, ro.cmask_BxT)

    def packed(p):
        return packed_logp_entropy(lambda q: nnx.merge(graphdef, q), p, ro.prompt_NxP, ro.pmask_NxP, ro.tokens_BxT,
                                   ro.cmask_BxT, prompt_of, row_grid(16, 4), remat="full")

    for a, b in zip(jax.jit(padded)(params), jax.jit(packed)(params)):
        np.testing.assert_allclose(np.asarray(b)[cmask], np.asarray(a)[cmask], rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(b)[~cmask] == 0)  # nothing past a row's length
    loss = lambda f: lambda p: jnp.sum(jnp.where(ro.cmask_BxT > 0, f(p)[0], 0.0))
    g_ref, g_got = jax.jit(jax.grad(loss(padded)))(params), jax.jit(jax.grad(loss(packed)))(params)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
        scale = float(np.max(np.abs(np.asarray(a)))) or 1.0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5 * scale)


def test_the_bench_counts_the_packs_the_step_makes():
    """experiments/bench/varlen.py counts FLOPs from its own first-fit-decreasing packing (numpy, per prompt):
    it uses as many rows as policy/packing.pack on the bench's workloads and on this file's lengths."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from experiments.bench.varlen import packed_rows, workload

    from sage_jax.policy.packing import pack
    cases = [(np.asarray(LENGTHS), np.arange(16) // 4, T)]
    for shape in ("tiny", "small", "long"):
        w = workload(shape)
        cases.append((np.asarray(w["lengths"]), np.arange(len(w["lengths"])) // w["G"], w["T"]))
    for L, prompt_of, t in cases:
        assert packed_rows(L, prompt_of, t) == int(pack(jnp.asarray(L), jnp.asarray(prompt_of), t)[2])
