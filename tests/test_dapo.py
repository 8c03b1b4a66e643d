"""DAPO's sample-level options: the overlong penalty and group selection against NumPy references, and the
rollout phase under dynamic sampling / overlong filtering (a gather of the plain rollout, masks as stated)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rl_fixtures import TOK, batch, setup

from sage_jax.rewards.host import HostReward
from sage_jax.policy import state as train_state
from sage_jax.rl import dapo, step as R
from sage_jax.rl.advantages import group_advantages
from sage_jax.rl.rollout import rollout
from sage_jax.sampling import SamplingConfig

EOS = 2


def _penalty_ref(length, max_len, buffer, factor):
    """DAPO eq. 13, written out case by case."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return factor * ((max_len - buffer) - length) / buffer
    return -factor


def test_overlong_penalty_matches_the_published_formula():
    lengths = np.arange(0, 17)
    got = np.asarray(dapo.overlong_penalty(jnp.asarray(lengths), 16, 5, 0.5))
    want = [_penalty_ref(int(n), 16, 5, 0.5) for n in lengths]
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert got[16] == -0.5 and got[11] == 0.0 and got[12] == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="overlong buffer"):
        dapo.overlong_penalty(jnp.asarray(lengths), 16, 17)


@pytest.mark.parametrize("keep", [1, 2, 3, 5])
def test_select_groups_informative_first_in_batch_order(keep):
    rewards = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25], [1, 0, 1]], np.float32)
    idx, informative, m = dapo.select_groups(jnp.asarray(rewards.reshape(-1)), 3, keep)
    inf = [g for g in range(5) if rewards[g].max() > rewards[g].min()]  # [1, 3, 4]
    order = inf + [g for g in range(5) if g not in inf]  # then the uninformative, in batch order
    np.testing.assert_array_equal(np.asarray(idx), order[:keep])
    np.testing.assert_array_equal(np.asarray(informative), [g in inf for g in order[:keep]])
    kept = min(len(inf), keep)
    assert {k: int(v) for k, v in m.items()} == dict(generated=5, informative=3, kept=kept, short=keep - kept,
                                                     surplus=3 - kept)
    np.testing.assert_array_equal(np.asarray(dapo.group_rows(idx, 3)),
                                  np.concatenate([np.arange(3 * g, 3 * g + 3) for g in order[:keep]]))


def _dense(completions, answers=None):
    """A reward that differs between random completions (the character codes' sum mod 7, over 7)."""
    return np.array([sum(map(ord, c)) % 7 / 7.0 for c in completions], np.float32)


def _by_answer(completions, answers):
    """Answer "0": every sample scores 0, "1": every sample 1 (no signal); otherwise a dense reward."""
    dense = _dense(completions)
    return np.array([0.0 if a == "0" else 1.0 if a == "1" else d for a, d in zip(answers, dense)], np.float32)


def _batch(answers):
    from sage_jax.rewards.host import encode_answers
    b = batch()
    return dict(b, answer=jnp.asarray(encode_answers(TOK, answers, 8)))


def _rollout(answers, max_new_tokens=16, eos_ids=(EOS,), **fields):
    cfg, graphdef, state, _ = setup(sampling=SamplingConfig(max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=0,
                                                            decode_segments=2))
    cfg = dataclasses.replace(cfg, **fields)
    policy = train_state.policy_model(graphdef, state)
    fn = jax.jit(lambda b, key: rollout(policy, b, key, cfg, HostReward(TOK, _by_answer)))
    return fn(_batch(answers), jax.random.key(7)), cfg


@pytest.mark.parametrize("answers,k,groups,short", [
    (["0", "12", "1", "4"], 2, [1, 3], 0),  # two informative groups for two slots
    (["0", "12", "1", "4"], 4, [1], 0),  # one slot: the first informative group, the other is surplus
    (["0", "1", "12", "0"], 2, [2, 0], 1),  # one informative group; the second slot a masked fill-in
])
def test_dynamic_sampling_keeps_informative_groups_of_the_same_rollout(answers, k, groups, short):
    full, cfg = _rollout(answers)
    ro, _ = _rollout(answers, dynamic_sampling=k)
    G = cfg.group_size
    rows = np.concatenate([np.arange(g * G, g * G + G) for g in groups])
    np.testing.assert_array_equal(ro.prompt_NxP, np.asarray(batch()["prompt"])[groups])
    for got, want in ((ro.tokens_BxT, full.tokens_BxT), (ro.cmask_BxT, full.cmask_BxT),
                      (ro.raw_logp_BxT, full.raw_logp_BxT), (ro.adv_B, full.adv_B)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[rows])  # a gather: same samples, same key
    informative_rows = np.repeat([answers[g] not in ("0", "1") for g in groups], G)
    np.testing.assert_array_equal(ro.loss_mask_BxT, np.asarray(full.cmask_BxT)[rows] * informative_rows[:, None])
    m = {key: int(v) for key, v in ro.metrics.items() if key.startswith("dynamic/")}
    n_inf = sum(a not in ("0", "1") for a in answers)
    assert m == {"dynamic/generated_groups": 4, "dynamic/informative_groups": n_inf,
                 "dynamic/kept_groups": len(groups) - short, "dynamic/short_groups": short,
                 "dynamic/surplus_groups": n_inf - (len(groups) - short)}
    # the reward metrics still describe every generated sample; the kept ones are logged beside them
    assert float(ro.metrics["reward/reward_mean"]) == pytest.approx(float(full.metrics["reward/reward_mean"]))
    assert float(ro.metrics["reward/kept_frac_zero_std"]) == pytest.approx(short / len(groups))


def test_overlong_filter_and_penalty_in_the_rollout():
    answers, ends = ["12", "3", "4", "4"], tuple(range(2, 20))  # many end tokens: some rows stop, some not
    full, cfg = _rollout(answers, max_new_tokens=8, eos_ids=ends)
    ro, _ = _rollout(answers, max_new_tokens=8, eos_ids=ends, overlong_filter=True, overlong_buffer=4,
                     overlong_penalty=0.5)
    tokens, cmask = np.asarray(full.tokens_BxT), np.asarray(full.cmask_BxT)
    stopped = (np.isin(tokens, ends) & (cmask == 1)).any(axis=1)
    assert 0 < stopped.sum() < len(stopped), "the test needs truncated and finished rows"
    np.testing.assert_array_equal(ro.tokens_BxT, tokens)
    np.testing.assert_array_equal(ro.loss_mask_BxT, cmask * stopped[:, None])
    texts = [TOK.decode(t[m == 1].tolist(), skip_special_tokens=True) for t, m in zip(tokens, cmask)]
    verifier = _dense(texts)
    shaped = verifier + np.array([_penalty_ref(int(n), 8, 4, 0.5) for n in cmask.sum(1)], np.float32)
    want, _ = group_advantages(jnp.asarray(shaped), cfg.group_size)
    np.testing.assert_allclose(np.asarray(ro.adv_B), np.asarray(want), atol=1e-6)
    assert int(ro.metrics["rollout/overlong_filtered"]) == int((~stopped).sum())


def test_an_update_with_nothing_to_train_on_is_no_optimizer_step():
    """Every row truncated (the end token is one the model never samples) and filtered out: no loss token. Under
    AdamW with weight decay a zero-gradient step still moves the parameters (momentum, decay) and advances the
    step (lr and guide schedules): it must not happen at all. Unfiltered, the same rollout trains."""
    never = SamplingConfig(max_new_tokens=6, eos_ids=(10_000,), pad_id=0, decode_segments=1)
    for filt in (True, False):
        cfg, graphdef, state, step = setup(sampling=never, overlong_filter=filt, dynamic_sampling=2,
                                           tx=optax.adamw(1e-2, weight_decay=0.1))
        state, _ = step(state, batch())  # a first step with signal would give Adam a momentum; here none
        before = jax.tree.map(np.asarray, state.params)
        opt_before = jax.tree.map(np.asarray, state.opt_state)
        step0 = int(state.step)
        state, m = step(state, batch())
        assert float(m["rollout/truncated_frac"]) == 1.0
        moved = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(jax.tree.leaves(state.params),
                                                                           jax.tree.leaves(before)))
        assert (moved == 0.0) == filt
        assert int(state.step) == step0 + (0 if filt else 1)
        assert int(m["train/updates_skipped"]) == (1 if filt else 0)
        if filt:
            same = [np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(state.opt_state),
                                                                      jax.tree.leaves(opt_before))]
            assert all(same)  # Adam's moments and count untouched
        assert int(m["dynamic/generated_groups"]) == 4


def test_a_shortfall_trains_the_kept_groups_and_skips_the_empty_minibatch():
    """Dynamic sampling with M = 2 minibatches: one informative group of two slots fills minibatch 0; the
    masked fill-in group alone is minibatch 1, which is skipped (no phantom AdamW step): one optimizer step."""
    answers = ["0", "1", "12", "0"]  # one informative group (the third) of four generated
    tx = optax.adamw(1e-2, weight_decay=0.1)
    _, _, state, step = setup(reward_fn=_by_answer, dynamic_sampling=2, num_minibatches=2, tx=tx)
    p0 = jax.tree.map(np.asarray, state.params)
    new, m = step(state, _batch(answers))
    assert int(m["dynamic/kept_groups"]) == 1 and int(m["dynamic/short_groups"]) == 1
    assert int(m["train/updates_skipped"]) == 1 and int(new.step) == 1
    assert max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(jax.tree.leaves(new.params),
                                                                     jax.tree.leaves(p0))) > 0


def test_pass_at_k_signal_and_its_combinations():
    """Dynamic sampling under the pass@k advantage keeps the groups whose pass@k advantage is nonzero (not
    merely unequal rewards), and the overlong penalty, which the pass@k advantage would ignore, is refused."""
    from sage_jax.rl.advantages import pass_at_k_advantages, pass_at_k_informative
    G, k = 4, 2
    groups = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    adv, _ = pass_at_k_advantages(jnp.asarray(groups.reshape(-1)), G, k)
    nonzero = np.abs(np.asarray(adv).reshape(-1, G)).max(axis=1) > 0
    np.testing.assert_array_equal(np.asarray(pass_at_k_informative(jnp.asarray(groups.reshape(-1)), G, k)), nonzero)
    assert nonzero.tolist() == [False, True, False, True, False]  # group 0: unequal rewards, but 1 wrong < k
    idx, informative, _ = dapo.select_groups(jnp.asarray(groups.reshape(-1)), G, 2,
                                             pass_at_k_informative(jnp.asarray(groups.reshape(-1)), G, k))
    assert np.asarray(idx).tolist() == [1, 3] and bool(np.asarray(informative).all())
    with pytest.raises(ValueError, match="pass_at_k=2 with rl.overlong_buffer=4"):
        R.RLConfig(group_size=4, pass_at_k=2, overlong_buffer=4, sampling=SamplingConfig(max_new_tokens=8))


def test_stop_strings_end_a_row_without_truncating_it():
    """A completion ended by a stop string is not truncated: it counts as stopped in rollout/truncated_frac and
    stays in the loss under rl.overlong_filter (as a row ended by EOS would)."""
    from sage_jax.stop_strings import StopStrings
    stop = StopStrings.for_tokenizer(("1",), TOK, TOK.vocab_size if hasattr(TOK, "vocab_size") else len(TOK))
    sampling = SamplingConfig(max_new_tokens=12, eos_ids=(10_000,), pad_id=0, decode_segments=1, stop=stop)
    cfg, graphdef, state, _ = setup(sampling=sampling)
    cfg = dataclasses.replace(cfg, overlong_filter=True)
    policy = train_state.policy_model(graphdef, state)
    ro = jax.jit(lambda b, key: rollout(policy, b, key, cfg, HostReward(TOK, _by_answer)))(_batch(["12"] * 4),
                                                                                        jax.random.key(3))
    texts = [TOK.decode(t[m == 1].tolist()) for t, m in zip(np.asarray(ro.tokens_BxT), np.asarray(ro.cmask_BxT))]
    ended = np.array([t.endswith("1") for t in texts])
    assert 0 < ended.sum() < len(ended), "the test needs rows stopped by the string and truncated rows"
    assert float(ro.metrics["rollout/truncated_frac"]) == pytest.approx(1 - ended.mean())
    np.testing.assert_array_equal(np.asarray(ro.loss_mask_BxT).any(axis=1), ended)


def test_dapo_config_errors():
    with pytest.raises(ValueError, match="dynamic_sampling"):
        R.RLConfig(dynamic_sampling=0)
    with pytest.raises(ValueError, match="overlong_buffer"):
        R.RLConfig(overlong_buffer=10_000)


