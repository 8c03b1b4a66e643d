"""Group advantages vs an independent NumPy loop implementation (TRL semantics: sample std)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.rl import advantages

pytestmark = pytest.mark.usefixtures("x64")  # float64 references (tests/conftest.py)


def np_advantages(r, G, scale, eps=1e-4):
    out = np.zeros_like(r, dtype=np.float64)
    batch_std = np.std(r, ddof=1) if len(r) > 1 else 0.0
    for p in range(len(r) // G):
        g = r[p * G:(p + 1) * G]
        mean = sum(g) / G
        std = np.sqrt(sum((x - mean) ** 2 for x in g) / (G - 1)) if G > 1 else 0.0
        for i in range(G):
            a = g[i] - mean
            if scale == "group":
                a = a / (std + eps)
            elif scale == "batch":
                a = a / (batch_std + eps)
            out[p * G + i] = a
    return out


def rewards(seed, P=6, G=8):
    rng = np.random.default_rng(seed)
    r = (rng.random((P, G)) < rng.random((P, 1))).astype(np.float64)
    r[0] = 1.0  # all correct
    r[1] = 0.0  # all wrong
    r[2] = rng.normal(size=G)  # continuous rewards
    return r.reshape(-1)


@pytest.mark.parametrize("scale", advantages.SCALE_REWARDS)
@pytest.mark.parametrize("G", [1, 2, 8])
def test_matches_numpy(scale, G):
    r = rewards(0, G=G)
    f = jax.jit(advantages.group_advantages, static_argnums=(1, 2))
    adv, met = f(jnp.asarray(r), G, scale)
    np.testing.assert_allclose(np.asarray(adv), np_advantages(r, G, scale), rtol=1e-12,
                               atol=1e-14)
    rg = r.reshape(-1, G)
    zero = np.mean([np.all(row == row[0]) for row in rg])
    np.testing.assert_allclose(float(met["frac_zero_std"]), zero)
    np.testing.assert_allclose(float(met["reward_mean"]), r.mean())
    np.testing.assert_allclose(float(met["reward_std"]), np.std(r, ddof=1))
    if G > 1:
        np.testing.assert_allclose(float(met["reward_std_group"]), np.std(rg, 1, ddof=1).mean())
        # Zero-variance groups get exactly zero advantage.
        assert np.all(np.asarray(adv).reshape(-1, G)[:2] == 0)


def test_sample_std_golden_value():
    # [1, 0, 0, 0]: mean 0.25, sample std sqrt(0.75 / 3) = 0.5 (population std would be 0.433).
    adv, _ = advantages.group_advantages(jnp.asarray([1.0, 0.0, 0.0, 0.0]), 4, "group")
    np.testing.assert_allclose(np.asarray(adv), np.array([0.75, -0.25, -0.25, -0.25]) / 0.5001,
                               rtol=1e-12)
    adv_b, _ = advantages.group_advantages(jnp.asarray([1.0, 0.0, 1.0, 1.0]), 2, "batch")
    np.testing.assert_allclose(np.asarray(adv_b), np.array([0.5, -0.5, 0, 0]) / (0.5 + 1e-4),
                               rtol=1e-12)
    adv_n, _ = advantages.group_advantages(jnp.asarray([1.0, 0.0, 0.0, 0.0]), 4, "none")
    np.testing.assert_allclose(np.asarray(adv_n), [0.75, -0.25, -0.25, -0.25], rtol=1e-12)


def test_zero_variance_fraction_and_float32():
    r = jnp.asarray([0.1] * 4 + [1, 0, 1, 1] + [0.7] * 4 + [0, 0, 0, 1], jnp.float32)
    adv, met = advantages.group_advantages(r, 4)
    assert adv.dtype == jnp.float32
    np.testing.assert_allclose(float(met["frac_zero_std"]), 0.5)
    assert np.all(np.asarray(adv)[:4] == 0) and np.all(np.asarray(adv)[8:12] == 0)
    np.testing.assert_allclose(np.asarray(adv), np_advantages(np.asarray(r, np.float64), 4,
                                                              "group"), rtol=1e-6, atol=1e-6)


def test_group_means_are_removed():
    r = rewards(3, P=5, G=6)
    for scale in advantages.SCALE_REWARDS:
        adv, _ = advantages.group_advantages(jnp.asarray(r), 6, scale)
        np.testing.assert_allclose(np.asarray(adv).reshape(-1, 6).sum(1), 0.0, atol=1e-10)


def test_validation_errors():
    r = jnp.zeros(6)
    with pytest.raises(ValueError, match="unknown scale_rewards='std'"):
        advantages.group_advantages(r, 3, "std")
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        advantages.group_advantages(r, 4)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        advantages.group_advantages(r, 0)
    with pytest.raises(ValueError, match="rewards_B must be 1-D"):
        advantages.group_advantages(jnp.zeros((2, 3)), 3)


def _brute_force_pass_at_k(correct, k):
    """Per sample: the mean over the k-subsets of its group that hold it of (max reward - R) / std, where R
    and std are the mean and population std of max reward over all k-subsets. Plain enumeration."""
    import itertools
    N = len(correct)
    subsets = list(itertools.combinations(range(N), k))
    scores = {s: max(correct[i] for i in s) for s in subsets}
    R = np.mean(list(scores.values()))
    std = np.sqrt(np.mean([(v - R) ** 2 for v in scores.values()]))
    adv = [np.mean([scores[s] - R for s in subsets if i in s]) / (std + 1e-4) for i in range(N)]
    return np.array(adv), R


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pass_at_k_advantage_is_the_subset_enumeration(k):
    from sage_jax.rl.advantages import pass_at_k_advantages
    rng = np.random.default_rng(k)
    G = 6
    rewards = (rng.random(8 * G) < 0.35).astype(np.float32)
    rewards[:G] = 0.0  # an all-wrong group
    rewards[G:2 * G] = 1.0  # an all-correct group
    adv, met = pass_at_k_advantages(jnp.asarray(rewards), G, k)
    want, Rs = zip(*[_brute_force_pass_at_k(list(rewards[g:g + G]), k) for g in range(0, len(rewards), G)])
    np.testing.assert_allclose(np.asarray(adv), np.concatenate(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(met["pass_at_k"]), np.mean(Rs), rtol=1e-6)
    assert not np.asarray(adv)[:2 * G].any()  # uniform groups carry no signal
    with pytest.raises(ValueError, match="k="):
        pass_at_k_advantages(jnp.asarray(rewards), G, G + 1)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_pass_at_k_advantage_is_finite_and_exact_for_every_count(k):
    """Every number of correct samples in a group of 8 (float32): finite, and the enumeration's value. A group
    with fewer than k wrong samples has pass@k exactly 1; products of ratios used to land a hair above it and
    make the std NaN (found by a run of configs/tiny.py with rl.pass_at_k=4)."""
    from sage_jax.rl.advantages import pass_at_k_advantages
    G = 8
    rewards = np.concatenate([(np.arange(G) < c).astype(np.float32) for c in range(G + 1)])
    # jitted, as in the RL step: XLA may divide by multiplying with a reciprocal, so (8 - j) / (8 - j) != 1
    adv, met = jax.jit(pass_at_k_advantages, static_argnums=(1, 2))(jnp.asarray(rewards, jnp.float32), G, k)
    want, Rs = zip(*[_brute_force_pass_at_k(list(rewards[g:g + G]), k) for g in range(0, len(rewards), G)])
    assert np.isfinite(np.asarray(adv)).all()
    np.testing.assert_allclose(np.asarray(adv), np.concatenate(want), rtol=1e-4, atol=1e-4)
    assert 0.0 <= float(met["pass_at_k"]) <= 1.0
    np.testing.assert_allclose(float(met["pass_at_k"]), np.mean(Rs), rtol=1e-6)
