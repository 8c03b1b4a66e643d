"""The RL step's first phase, itself four named steps: `sample` (generate), `verify` (the verifier's rewards
through the host callback), `keep` (DAPO's sample-level options) and `advantages`.

Dimension key (docs/design.md §5.4): N prompts trained on, k = rl.dynamic_sampling (k x N prompts sampled), G
completions per prompt, B = N * G rows (group-contiguous), P prompt length, T completion length.

    k x N prompts --generate--> k x N x G completions --host verifier--> rewards
      [overlong penalty: reward + factor * R_len]  [dynamic sampling: the N informative groups first]
      --group advantages--> adv_B,  loss_mask_BxT (masked: uninformative fill-in groups, overlong-filtered rows)

The completion mask (`cmask_BxT`: which positions hold tokens, what attention and positions read) and the
loss mask (`loss_mask_BxT`: which tokens the loss and its token counts read) differ only under the DAPO
options; without them they are the same array. Rollout metrics describe every generated completion, the
`reward/*` means every generated reward (what the policy scores); advantages and the loss see the kept rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sage_jax import sharding as shd
from sage_jax.rewards.host import HostReward, host_rewards
from sage_jax.rl import dapo
from sage_jax.rl.advantages import group_advantages, pass_at_k_advantages, pass_at_k_informative
from sage_jax.sampling import generate

Array = jax.Array


class Rollout(NamedTuple):
    prompt_NxP: Array  # the prompts trained on (left padded)
    pmask_NxP: Array
    tokens_BxT: Array  # their completions, G per prompt
    cmask_BxT: Array  # int32, 1 on real completion tokens
    loss_mask_BxT: Array  # int32, the tokens the loss reads (cmask without masked rows)
    raw_logp_BxT: Array | None  # the sampler's log-probs before top-k / top-p / min-p
    adv_B: Array
    metrics: dict[str, Array]


def rollout(policy, batch: dict[str, Array], key, cfg, reward_host: HostReward, mesh=None) -> Rollout:
    """Samples G completions for each of the batch's prompts, scores them and keeps the step's rows: the phases
    `sample`, `verify`, `keep` (DAPO's options) and `advantages`, in that order.

    `cfg`: the step's RLConfig (group_size, sampling, share_prompt, scale_rewards, pass_at_k and the DAPO
    fields dynamic_sampling, overlong_buffer, overlong_penalty, overlong_filter)."""
    s = sample(policy, batch, key, cfg)
    rewards, stopped, metrics = verify(s, _rep(batch["answer"], cfg.group_size), cfg, reward_host, mesh)
    s, rewards, shaped, loss_mask, keep_metrics = keep(s, rewards, stopped, cfg)
    adv, adv_metrics = advantages(rewards, shaped, cfg)
    metrics = {**metrics, **keep_metrics, **{f"reward/{m}": v for m, v in adv_metrics.items()}}
    return Rollout(s.prompt_NxP, s.pmask_NxP, s.tokens_BxT, s.cmask_BxT, loss_mask, s.raw_logp_BxT, adv, metrics)


class Samples(NamedTuple):
    prompt_NxP: Array
    pmask_NxP: Array
    tokens_BxT: Array
    cmask_BxT: Array
    raw_logp_BxT: Array | None
    stopped_B: Array  # ended by an end-of-sequence id or a stop string (not truncated at max_new_tokens)


def _rows(x):
    return shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def _rep(x, G):
    return _rows(jnp.repeat(x, G, axis=0))


def sample(policy, batch: dict[str, Array], key, cfg) -> Samples:
    """G completions per prompt, from each prompt's prefill once per group (`share_prompt`) or repeated."""
    G = cfg.group_size
    prompt, pmask = _rows(batch["prompt"]), _rows(batch["prompt_mask"])
    if cfg.share_prompt:
        out = generate(policy, prompt, pmask, key, cfg.sampling, group_size=G)
    else:
        out = generate(policy, _rep(batch["prompt"], G), _rep(batch["prompt_mask"], G), key, cfg.sampling)
    return Samples(prompt, pmask, out.tokens_BxT, out.mask_BxT, out.raw_logp_BxT, out.stopped_B)


def verify(s: Samples, answers_BxA, cfg, reward_host: HostReward, mesh=None):
    """(rewards_B, stopped_B, metrics): the verifier's rewards through the host callback, which rows ended with
    an end-of-sequence id or a stop string (the others hit max_new_tokens: truncated), and the rollout's length
    and failure counts (of every generated row)."""
    rewards, failed = host_rewards(reward_host, s.tokens_BxT, s.cmask_BxT, answers_BxA, mesh)
    lengths = s.cmask_BxT.sum(axis=1)
    stopped = s.stopped_B
    metrics = {"rollout/length_mean": lengths.mean(), "rollout/length_min": lengths.min(),
               "rollout/length_max": lengths.max(), "rollout/truncated_frac": 1.0 - stopped.mean(),
               "rollout/tokens": s.cmask_BxT.sum()}
    metrics["reward/failed"] = (failed > 0).sum()  # not verified (scored 0): the codes of rewards.FAIL_*
    for code, name in ((2, "timeouts"), (3, "gold_unparsed"), (4, "verifier_errors")):
        metrics[f"reward/{name}"] = (failed == code).sum()
    return rewards, stopped, metrics


def keep(s: Samples, rewards, stopped, cfg):
    """DAPO's sample-level options: the overlong penalty (shaped = rewards + penalty), dynamic sampling (the N
    groups with a learning signal first, of k x N generated: unequal rewards, or under rl.pass_at_k a nonzero
    pass@k advantage) and the overlong filter (truncated rows: no end-of-sequence id or stop string). Returns the kept
    (samples, rewards, shaped rewards, loss mask) and their metrics; without the options, the input."""
    G, k = cfg.group_size, cfg.dynamic_sampling
    metrics, shaped = {}, rewards
    if cfg.overlong_buffer:
        lengths = s.cmask_BxT.sum(axis=1)
        penalty = dapo.overlong_penalty(lengths, cfg.sampling.max_new_tokens, cfg.overlong_buffer,
                                        cfg.overlong_penalty)
        shaped = rewards + penalty
        metrics.update({"reward/overlong_penalty_mean": penalty.mean(), "reward/shaped_mean": shaped.mean()})
    keep_B = jnp.ones(rewards.shape, bool)
    if k > 1:
        # the generation metrics above cover all k x N groups, the rest the kept N
        metrics.update({f"reward/{m}": v for m, v in group_advantages(rewards, G, cfg.scale_rewards)[1].items()})
        signal_G = pass_at_k_informative(rewards, G, cfg.pass_at_k) if cfg.pass_at_k else None
        idx, informative, ds = dapo.select_groups(rewards, G, rewards.shape[0] // G // k, signal_G)
        metrics.update({f"dynamic/{m}_groups": v for m, v in ds.items()})
        take = dapo.group_rows(idx, G)
        raw = None if s.raw_logp_BxT is None else _rows(s.raw_logp_BxT[take])
        rewards, shaped, stopped = (_rows(x[take]) for x in (rewards, shaped, stopped))
        s = Samples(_rows(s.prompt_NxP[idx]), _rows(s.pmask_NxP[idx]), _rows(s.tokens_BxT[take]),
                    _rows(s.cmask_BxT[take]), raw, stopped)
        keep_B = jnp.repeat(informative, G)
    if cfg.overlong_filter:
        keep_B = keep_B & stopped
        metrics["rollout/overlong_filtered"] = jnp.logical_not(stopped).sum()
    cmask = s.cmask_BxT
    loss_mask = cmask if (k == 1 and not cfg.overlong_filter) else cmask * keep_B[:, None].astype(cmask.dtype)
    return s, rewards, shaped, loss_mask, metrics


def advantages(rewards, shaped, cfg):
    """adv_B of the kept rows: the group advantage of the shaped rewards, or the pass@k advantage (its
    correctness is the verifier's, without the length penalty); with dynamic sampling the metrics are the kept
    batch's (`kept_*`), beside those of the generated one."""
    adv, metrics = group_advantages(shaped, cfg.group_size, cfg.scale_rewards)
    if cfg.pass_at_k:
        adv, pk_metrics = pass_at_k_advantages(rewards, cfg.group_size, cfg.pass_at_k)
        metrics = {**metrics, **pk_metrics}
    if cfg.dynamic_sampling > 1:
        metrics = {f"kept_{m}": v for m, v in metrics.items()}
    return adv, metrics
