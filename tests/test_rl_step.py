"""The fused RL step: one compilation, no reference pass at beta = 0, invariants, robustness, golden."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rl_fixtures import batch, count_ones, setup

from sage_jax.rl import guides, losses, step as R
from sage_jax.policy.logprobs import grouped_logp_entropy
from sage_jax.sampling import SamplingConfig


def test_single_compilation_over_steps():
    _, _, state, step = setup()
    b = batch()
    seen = []
    for _ in range(3):
        state, m = step(state, b)
        seen.append(float(m["train/loss"]))
    assert step._cache_size() == 1
    assert int(state.step) == 3 and all(np.isfinite(seen))


def _count_dots(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    n += _count_dots(inner if hasattr(inner, "eqns") else inner.jaxpr)
                elif hasattr(sub, "eqns"):
                    n += _count_dots(sub)
    return n


def test_beta_zero_compiles_no_reference_forward():
    b = batch()
    cfg0, g0, s0, _ = setup(loss=losses.LossConfig(beta=0.0), guide="none")
    cfg1, g1, s1, _ = setup(loss=losses.LossConfig(beta=0.04), guide="none")
    assert s0.ref_params is None and s1.ref_params is not None  # no second copy of the weights
    assert len(jax.tree.leaves(s1)) > len(jax.tree.leaves(s0))

    def dots(cfg, g, s):
        from rl_fixtures import TOK

        from sage_jax.rewards.host import HostReward
        from sage_jax.policy.optim import OptimConfig, make_optimizer
        tx, lr = make_optimizer(OptimConfig(learning_rate=1e-3))
        fn = lambda st, bt: R.rl_step(st, bt, graphdef=g, cfg=cfg, tx=tx, lr_fn=lr,
                                      reward_host=HostReward(TOK, count_ones))
        return _count_dots(jax.make_jaxpr(fn)(s, b).jaxpr)

    model = nnx.merge(g0, s0.params)
    prompts, completions = jnp.zeros((16 // cfg1.group_size, 8), jnp.int32), jnp.zeros((16, 16), jnp.int32)
    one_forward = _count_dots(jax.make_jaxpr(  # the reference pass shares each prompt across its group
        lambda p, c: grouped_logp_entropy(model, p, jnp.ones_like(p), c, jnp.ones_like(c), 256))(
            prompts, completions).jaxpr)
    assert dots(cfg1, g1, s1) - dots(cfg0, g0, s0) == one_forward


def _adam_mu(state):
    """Adam's first moment: after one step from zero, mu = (1 - b1) g, the gradient."""
    return next(x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
                if hasattr(x, "mu")).mu


def test_guide_none_equals_branch_with_zero_ratio():
    """q == 1 either way, so the two programs compute the same loss and gradients, hence the same update (GRPO
    with KL). They are two programs, which XLA may fuse and order differently, so they agree to float32
    rounding, not bit for bit (test_sharding's bounds, from the same argument): the gradient, through Adam's
    first moment mu = (1 - b1) g, to 1e-5 of its largest entry; the params after AdamW's first step
    p1 = p0 - lr (g / (|g| + eps) + wd p0) to lr min(2, d_g / (|g| + eps)) + 4 u |p|, since Adam's
    normalisation turns a change d_g of a gradient entry near eps into a change of order lr."""
    b = batch()
    _, _, sa, step_a = setup(guide="none")
    _, _, sb, step_b = setup(guide=guides.make_guide("branch", ratio=0.0))
    sa, ma = step_a(sa, b)
    sb, mb = step_b(sb, b)
    assert float(ma["train/loss"]) == pytest.approx(float(mb["train/loss"]), abs=1e-7)
    assert float(mb["sage/q_mean"]) == 1.0
    lr, b1, eps, u = 1e-3, 0.9, 1e-8, 6e-8
    mu_a, mu_b = (jax.tree.leaves(_adam_mu(s)) for s in (sa, sb))
    d_mu = 1e-5 * max(float(jnp.abs(m).max()) for m in mu_a)
    assert d_mu > 0
    for ma_, mb_, pa, pb in zip(mu_a, mu_b, jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
        np.testing.assert_allclose(np.asarray(mb_), np.asarray(ma_), rtol=0, atol=d_mu)
        tol = lr * np.minimum(2.0, (d_mu / (1 - b1)) / (np.abs(np.asarray(ma_)) / (1 - b1) + eps))
        assert np.all(np.abs(np.asarray(pb) - np.asarray(pa)) <= tol + 4 * u * np.abs(np.asarray(pa)))


def test_branch_guide_raises_kl_at_step_zero():
    # At step 0 the policy equals the reference; q > 1 moves the anchor, so k3 > 0 exactly where q != 1.
    b = batch()
    _, _, s_none, st_none = setup(guide="none")
    _, _, s_br, st_br = setup(guide=guides.make_guide("branch", threshold=0.0))
    _, m_none = st_none(s_none, b)
    _, m_br = st_br(s_br, b)
    assert float(m_none["train/kl"]) == pytest.approx(0.0, abs=1e-6)
    q = float(m_br["sage/q_mean"])
    assert q > 1.0 and float(m_br["train/kl"]) > 1e-3


def test_forward_kl_is_zero_at_start_and_trains():
    _, _, state, step = setup(guide="none", loss=losses.LossConfig(beta=0.04, kl_mode="forward"))
    b = batch()
    state, m = step(state, b)
    assert float(m["train/kl"]) == pytest.approx(0.0, abs=1e-6)
    state, m = step(state, b)
    assert float(m["train/kl"]) > 0.0


def test_multi_update_uses_sampler_logp_as_old():
    _, _, state, step = setup(num_iterations=2, num_minibatches=2,
                              sampling=SamplingConfig(max_new_tokens=16, eos_ids=(2,), temperature=0.9))
    state, m = step(state, batch())
    # The first update sees the sampling params: the sampler's log-probs must equal the trainer's.
    assert float(m["train/logp_diff_max"]) <= 1e-4
    assert int(state.step) == 4  # 2 iterations x 2 minibatches


@pytest.mark.parametrize("filters", [dict(min_p=0.3), dict(top_p=0.7), dict(top_k=5)])
def test_multi_update_ratio_is_one_under_sampling_filters(filters):
    """With several updates per rollout, `old` is the trainer's log-prob under the sampling params, as TRL
    computes it: at lr 0 every update's ratio is exactly 1, whatever top-k / top-p / min-p kept. (With the
    sampler's filtered log-probs as `old`, the ratio is the kept mass, < 1, and negative-advantage tokens
    get clipped.) The sampler-vs-trainer numerics check compares unfiltered log-probs on both sides."""
    _, _, state, step = setup(lr=0.0, num_minibatches=2, sampling=SamplingConfig(
        max_new_tokens=16, eos_ids=(2,), temperature=1.0, decode_segments=2, **filters))
    state, m = step(state, batch())
    assert float(m["train/ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["train/clip_low"]) == 0.0 and float(m["train/clip_high"]) == 0.0
    assert float(m["train/logp_diff_max"]) <= 1e-4


def test_truncated_importance_weight_is_one_in_float32_under_min_p():
    """The sampler's log-prob the weight divides by is its pre-filter one: under min_p the weight stays 1 up to
    fp32 numerics (about 1e-5 per op, 1e-4 on a logit), never the kept mass (about 0.6-0.8 here)."""
    _, _, state, step = setup(lr=0.0, num_minibatches=2, loss=losses.LossConfig(beta=0.04, tis_cap=2.0),
                              sampling=SamplingConfig(max_new_tokens=16, eos_ids=(2,), temperature=1.0,
                                                        min_p=0.3))
    state, m = step(state, batch())
    assert float(m["train/is_weight_mean"]) == pytest.approx(1.0, abs=1e-4)
    assert float(m["train/tis_capped"]) == 0.0


def test_mismatch_entropy_and_pass_at_k_options_in_the_step():
    """The issue-28 options together in one fused step: the pass@k advantage (its metric logged), MIS / TIS
    logging a mismatch that is fp32 numerics only, and the entropy selection keeping about its fraction."""
    loss = losses.LossConfig(beta=0.04, tis_cap=2.0, mis_bounds=(0.5, 2.0), entropy_top_frac=0.25)
    _, _, state, step = setup(lr=0.0, loss=loss, pass_at_k=2)
    state, m = step(state, batch())
    assert 0.25 <= float(m["train/pg_token_frac"]) < 0.4
    assert float(m["train/mis_masked"]) == 0.0 and abs(float(m["train/mismatch_kl"])) < 1e-5  # fp32 numerics only
    assert 0.0 <= float(m["reward/pass_at_k"]) <= 1.0
    with pytest.raises(ValueError, match="pass_at_k"):
        R.RLConfig(group_size=4, pass_at_k=5)


def test_update_order_permutes_whole_rows_consistently():
    """rl.update_shuffle: every row once in the new order, each row's arrays and prompt moved together; "groups"
    keeps the groups contiguous (prompt sharing stays possible), "rows" mixes prompts within a minibatch."""
    from sage_jax.rl.rollout import Rollout
    from sage_jax.rl.update import Scores, update_order
    N, G, P, T = 4, 4, 3, 5
    B = N * G
    ar = jnp.arange(B)
    ro = Rollout(prompt_NxP=jnp.arange(N * P).reshape(N, P), pmask_NxP=jnp.ones((N, P), jnp.int32),
                 tokens_BxT=jnp.tile(ar[:, None], (1, T)), cmask_BxT=jnp.ones((B, T), jnp.int32),
                 loss_mask_BxT=jnp.ones((B, T), jnp.int32), raw_logp_BxT=jnp.tile(-ar[:, None], (1, T)) * 1.0,
                 adv_B=ar * 1.0, metrics={})
    for mode in ("none", "groups", "rows"):
        cfg = R.RLConfig(group_size=G, update_shuffle=mode)
        rw = update_order(ro, Scores(old_logp_BxT=ro.raw_logp_BxT), cfg, jax.random.key(1))
        row = np.asarray(rw.tokens_BxT[:, 0])
        assert sorted(row.tolist()) == list(range(B))
        np.testing.assert_array_equal(np.asarray(rw.adv_B), row)
        np.testing.assert_array_equal(np.asarray(rw.scores.old_logp_BxT[:, 0]), -row)
        np.testing.assert_array_equal(np.asarray(rw.prompt_BxP), np.asarray(ro.prompt_NxP)[row // G])
        np.testing.assert_array_equal(np.asarray(rw.prompt_NxP)[np.asarray(rw.prompt_of_B)], np.asarray(rw.prompt_BxP))
        if mode == "none":
            assert row.tolist() == list(range(B))
        if mode == "groups":
            assert all(len(set((row[g * G:(g + 1) * G] // G).tolist())) == 1 for g in range(N)) and row.tolist() != list(range(B))
        if mode == "rows":
            assert any(len(set((row[g * G:(g + 1) * G] // G).tolist())) > 1 for g in range(N))


@pytest.mark.parametrize("share_prompt", [True, False])
def test_row_shuffle_changes_the_updates_not_the_loss(share_prompt):
    """TRL 0.23 shuffles the generation batch before splitting it into updates. At lr 0 with M = 2 equal
    minibatches the mean of the two updates' grpo losses is the whole batch's whatever the order, so it must
    equal the unshuffled step's, while the updates themselves (their gradients) differ. The row-shuffled
    micro-batches share each prompt's forward through a gather (4 prompts, 8 rows) or repeat it: same numbers."""
    out = {}
    for mode in ("none", "rows"):
        _, _, state, step = setup(lr=0.0, num_minibatches=2, update_shuffle=mode, share_prompt=share_prompt)
        out[mode] = step(state, batch())[1]
    assert float(out["rows"]["train/loss"]) == pytest.approx(float(out["none"]["train/loss"]), rel=1e-5, abs=1e-7)
    assert float(out["rows"]["train/kl"]) == pytest.approx(float(out["none"]["train/kl"]), rel=1e-5, abs=1e-8)
    assert abs(float(out["rows"]["train/grad_norm"]) - float(out["none"]["train/grad_norm"])) > 1e-4


def test_dapo_normaliser_with_several_minibatches():
    """dapo, M = 2 updates: "generation" divides each update's token sum by the generation batch's tokens
    (TRL 0.23, the reference), "window" by half of them (TRL >= 1.x): the logged losses differ by exactly 2."""
    kw = dict(lr=0.0, num_minibatches=2, loss=losses.LossConfig(beta=0.04, loss_type="dapo"))
    out = {}
    for norm in ("generation", "window"):
        _, _, state, step = setup(dapo_normalizer=norm, **kw)
        out[norm] = step(state, batch())[1]
    for k in ("train/pg_loss", "train/kl_loss", "train/loss"):
        assert float(out["window"][k]) == pytest.approx(2 * float(out["generation"][k]), rel=1e-5, abs=1e-9), k
    with pytest.raises(ValueError, match="dapo_normalizer"):
        R.RLConfig(dapo_normalizer="per_token")


def test_logged_loss_terms_do_not_shrink_under_accumulation():
    """dapo: the logged pg_loss / kl_loss of an update with 2 accumulated micro-batches equal those without
    accumulation (a mean over micro-batches would be half of them)."""
    kw = dict(lr=0.0, loss=losses.LossConfig(beta=0.04, loss_type="dapo"))
    ms = [setup(grad_accum_steps=a, **kw) for a in (1, 2)]
    m1, m2 = [step(state, batch())[1] for _, _, state, step in ms]
    for k in ("train/pg_loss", "train/kl_loss", "train/loss"):
        assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-4, abs=1e-8), k


def test_reward_that_raises_or_nans_for_one_sample():
    calls = {"n": 0}

    def flaky(completions, answers):
        calls["n"] += 1
        if len(completions) > 1:
            raise RuntimeError("batch failure")  # forces the per-sample path
        if calls["n"] % 5 == 0:
            raise RuntimeError("one bad sample")
        return np.array([np.nan if calls["n"] % 7 == 0 else 1.0], np.float32)

    _, _, state, step = setup(reward_fn=flaky)
    state, m = step(state, batch())
    failed = int(m["reward/failed"])
    assert failed == 5  # call 1 is the batch; per-sample calls 2..17: calls 5, 10, 15 raise, calls 7, 14 NaN
    assert np.isfinite(float(m["train/loss"]))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    # reward mean counts the failures as 0
    assert float(m["reward/reward_mean"]) == pytest.approx((16 - failed) / 16)


@pytest.mark.parametrize("skip", [True, False])
def test_a_non_finite_update_is_counted_and_optionally_skipped(skip):
    """One NaN weight makes the loss and every gradient NaN: train/nonfinite says so; with skip_nonfinite the
    update leaves the parameters, the optimizer state and the step as they were (optax.apply_if_finite's
    semantics), without it they change (and the training loop stops the run)."""
    _, _, state, step = setup(skip_nonfinite=skip)
    params = jax.tree.map(lambda x: x, state.params)
    leaf = jax.tree.leaves(params)[0]
    params = jax.tree.unflatten(jax.tree.structure(params),
                                [leaf.at[(0,) * leaf.ndim].set(jnp.nan)] + jax.tree.leaves(params)[1:])
    state = state.replace(params=params)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    new, m = step(state, batch())
    assert float(m["train/nonfinite"]) == 1.0
    after = jax.tree.map(np.asarray, (new.params, new.opt_state))
    same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    assert same == skip and int(new.step) == (0 if skip else 1)


def test_config_errors():
    with pytest.raises(ValueError, match="group_size"):
        R.RLConfig(group_size=1)
    with pytest.raises(ValueError, match="unknown guide"):
        R.RLConfig(guide="nope")
    with pytest.raises(ValueError, match="beta=0"):
        R.RLConfig(guide="branch", loss=losses.LossConfig(beta=0.0))
    with pytest.raises(ValueError, match="forward"):
        R.RLConfig(guide="branch", loss=losses.LossConfig(beta=0.05, kl_mode="forward"))


# Golden values of one step from a fixed seed (tiny random Qwen2, 4 prompts x 4, 16 tokens, branch guide).
# They change legitimately only when the math or the sampling order changes on purpose (a new default,
# a different RNG split, a fixed bug): then rerun with GOLDEN_PRINT=1, check why they moved, and update.
# A refactor that should be behaviour-preserving must leave them as they are.
GOLDEN = {"train/loss": 1.20565e-05, "train/kl": 0.000299723, "train/grad_norm": 0.89262}


def test_golden_one_step(capsys):
    import os
    _, _, state, step = setup(guide=guides.make_guide("branch", threshold=4.5), num_layers=2)  # as pinned
    _, m = step(state, batch())
    got = {k: float(m[k]) for k in GOLDEN}
    if os.environ.get("GOLDEN_PRINT"):
        with capsys.disabled():
            print("GOLDEN =", {k: float(f"{v:.6g}") for k, v in got.items()})
    for k, v in GOLDEN.items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-7), (k, got[k], v)


@pytest.mark.parametrize("share_prompt,decoder_remat", [(True, "none"), (False, "none"), (True, "full")])
def test_reference_and_old_passes_in_row_chunks_change_nothing(share_prompt, decoder_remat):
    """rl.score_chunks = 2 runs the reference and `old` passes over half the rows at a time (interleaved
    prompts): the step's metrics, the loss, KL and gradient norm among them, equal those of the one-pass step
    (fp32: 1e-6). (Updated params are not compared: Adam's first step is lr x sign(g) wherever |g| >> eps, so
    it turns 1e-7 differences of tiny gradients into differences of order lr.) A graphdef with block remat
    (an NNX transform inside the chunk loop) once failed here with a TraceContextError."""
    kw = dict(share_prompt=share_prompt, num_minibatches=2, loss=losses.LossConfig(beta=0.04),
              decoder_remat=decoder_remat)
    outs = []
    for chunks in (1, 2):
        _, _, state, step = setup(score_chunks=chunks, **kw)
        outs.append(step(state, batch()))
    (_, m1), (_, m2) = outs
    assert set(m1) == set(m2) and "train/grad_norm" in m1
    for k in m1:
        np.testing.assert_allclose(np.asarray(m2[k]), np.asarray(m1[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    assert float(m1["train/kl"]) > 0  # the reference pass mattered
    with pytest.raises(ValueError, match="score_chunks"):
        R.RLConfig(score_chunks=0)
