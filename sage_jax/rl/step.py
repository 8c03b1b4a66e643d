"""The fused RL step: rollout -> verifier reward -> advantages -> reference -> guide -> loss -> update.

Dimension key: N prompts trained on, G completions per prompt, B = N * G rows (group-contiguous),
P prompt length (left padded), T completion length, A answer tokens, M minibatches.

One jitted program per step (`make_rl_step`), compiled once and reused:

  prompts --generate (KV cache)--> tokens_BxT, mask_BxT, sampler logp_BxT
  --host callback (per shard)--> rewards_B --group_advantages--> adv_B     (sage_jax/rl/rollout.py; with DAPO's
                                 dynamic sampling, N of the batch's prompts are kept after the rewards)
  --frozen reference (only when beta > 0)--> ref_logp_BxT
  --scan over num_iterations x M minibatch updates:
        policy logp, entropy (chunked) -> guide q -> policy_loss -> grads -> optax update

`old` log-probs: with one update per rollout, old = stop_gradient(logp) (ratio 1, as in TRL); with
several updates (num_iterations > 1 or M > 1) old = the trainer's forward under the sampling params, once
before the updates (the sampler's log-probs are after top-k / top-p / min-p, not the trainer's). The guide
schedule step, RNG and counters live in `TrainState`; nothing lives on the Python side.

Gradient accumulation (`grad_accum_steps` = A): each of the M updates sums the gradients of A equal
micro-batches (`micro_loss_share` rescales each micro-batch loss so the sum is exactly the minibatch
loss, for every `loss_type`), then applies ONE optimizer update. LoRA (`models.lora.add_lora` before
`init_train_state`): `params` = the adapters (the only optimizer state), `frozen_params` = the base;
the reference is the base with zeroed adapters (no copy of the weights).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sage_jax import sharding as shd
from sage_jax.models import lora as lora_lib
from sage_jax.models.decoder import positions_from_mask
from sage_jax.rewards.host import HostReward
from sage_jax.rl import guides, losses
from sage_jax.rl.logprobs import grouped_logp_entropy, sequence_logp_entropy
from sage_jax.rl.rollout import rollout
from sage_jax.rl.state import TrainState, merge_policy
from sage_jax.sampling import SamplingConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RLConfig:
    group_size: int = 8  # G completions per prompt
    sampling: SamplingConfig = SamplingConfig()
    loss: losses.LossConfig = losses.LossConfig()
    guide: str = "branch"  # a registered guide name (sage_jax.rl.guides); "none" = plain GRPO + KL
    guide_cfg: Any = None  # that guide's config dataclass; None = its defaults
    scale_rewards: str = "group"  # group | batch | none
    num_iterations: int = 1  # updates per rollout over the same samples (PPO epochs)
    num_minibatches: int = 1  # M, rows split into M sequential updates per iteration
    grad_accum_steps: int = 1  # micro-batches per update, gradients summed into ONE optimizer update
    max_steps: int = 1000  # optimizer steps of the run (guide schedules)
    logp_chunk: int = 256  # sequence chunk of the log-prob / entropy pass, tokens
    remat: str | None = None  # training-forward remat per block: none | full | dots; None = the model's own
    # Each prompt's forward pass once per group, its keys / values shared by the G rows: in the rollout's
    # prefill, the reference pass and the policy pass (the latter when a micro-batch holds whole groups).
    # The same numbers either way; False repeats the prompt G times (the reference implementation).
    share_prompt: bool = True
    # dapo with M > 1 updates per rollout: divide each update's token sum by the generation batch's tokens
    # ("generation", TRL 0.23 and the SAGE reference) or by that over M ("window", TRL >= 1.x); equal at M = 1
    dapo_normalizer: str = "generation"
    # 0: GRPO's group advantage (scale_rewards); k >= 1: the analytic pass@k advantage (Chen et al., 2025)
    pass_at_k: int = 0
    # The no-gradient passes over the rollout (reference, and `old` under several updates) in this many
    # sequential row chunks of whole groups: their attention scores (rows x heads x S^2) are live for B / C
    # rows at a time. 1 = all rows at once. Same numbers either way.
    score_chunks: int = 1
    # DAPO's sample-level options (sage_jax/rl/dapo.py): sample dynamic_sampling x the trained prompts, train on
    # the groups with unequal rewards first (1 = off); the soft overlong penalty over the last
    # overlong_buffer tokens (0 = off), times overlong_penalty; truncated completions out of the loss.
    dynamic_sampling: int = 1
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    overlong_filter: bool = False

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"rl.group_size must be >= 2 (group advantages need a group), got {self.group_size}")
        if self.num_iterations < 1 or self.num_minibatches < 1:
            raise ValueError("rl.num_iterations and rl.num_minibatches must be >= 1")
        if self.grad_accum_steps < 1:
            raise ValueError(f"rl.grad_accum_steps must be >= 1, got {self.grad_accum_steps}")
        guides.get_guide(self.guide)  # unknown name -> error listing the registered guides
        if self.score_chunks < 1:
            raise ValueError(f"rl.score_chunks must be >= 1, got {self.score_chunks}")
        if not 0 <= self.pass_at_k <= self.group_size:
            raise ValueError(f"rl.pass_at_k={self.pass_at_k} must be in [0, group_size={self.group_size}] (0 = off)")
        if self.dynamic_sampling < 1:
            raise ValueError(f"rl.dynamic_sampling={self.dynamic_sampling} must be >= 1 (1 = off)")
        if not 0 <= self.overlong_buffer <= self.sampling.max_new_tokens:
            raise ValueError(f"rl.overlong_buffer={self.overlong_buffer} must be in [0, rollout.max_new_tokens="
                             f"{self.sampling.max_new_tokens}] (0 = off)")
        if self.dapo_normalizer not in ("generation", "window"):
            raise ValueError(f"rl.dapo_normalizer={self.dapo_normalizer!r} is not one of generation, window")
        if self.remat not in (None, "none", "full", "dots"):
            raise ValueError(f"rl.remat={self.remat!r} is not one of none, full, dots")
        if self.loss.kl_mode == "forward" and self.guide != "none":
            raise ValueError(f"rl.guide={self.guide!r} with kl_mode='forward': the forward KL ignores the guide")
        if self.loss.beta == 0 and self.guide != "none":
            raise ValueError(f"rl.guide={self.guide!r} with rl.beta=0: the guide reshapes the KL anchor, "
                             "which does not exist without a KL term; set guide='none' or beta > 0")

    @property
    def needs_ref(self) -> bool:
        return self.loss.beta > 0

    @property
    def multi_update(self) -> bool:
        return self.num_iterations > 1 or self.num_minibatches > 1


def _forward_kl(pol, ref, tokens, mask, P, chunk, temperature):
    """Exact forward KL(pi_ref || pi_theta) per completion position, chunked over the sequence."""
    pos = positions_from_mask(mask)
    h_pol = pol.forward(tokens, pos, mask)[0][:, P - 1:-1]
    h_ref = jax.lax.stop_gradient(ref.forward(tokens, pos, mask)[0][:, P - 1:-1])
    w_pol, w_ref = pol.unembed_matrix(), jax.lax.stop_gradient(ref.unembed_matrix())
    B, T, D = h_pol.shape
    C = min(chunk, T)
    pad = (-T) % C
    padf = lambda h: jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, C, D).swapaxes(0, 1)

    @jax.checkpoint
    def body(_, xs):
        lp = jnp.einsum("bcd,dv->bcv", xs[0], w_pol, preferred_element_type=jnp.float32) / temperature
        lr = jnp.einsum("bcd,dv->bcv", xs[1], w_ref, preferred_element_type=jnp.float32) / temperature
        return None, losses.forward_kl_from_logits(lp, lr)

    _, kl = jax.lax.scan(body, None, (padf(h_pol), padf(h_ref)))
    return kl.swapaxes(0, 1).reshape(B, -1)[:, :T]


def micro_loss_share(loss: Array, mask_BxT: Array, loss_type: str, num_micro: int, batch_tokens: Array) -> Array:
    """A micro-batch's loss -> its share of the loss of the whole (equal-size) micro-batch set, so the
    shares (and their gradients) sum exactly to the one-big-batch loss (gradient accumulation):

      grpo:    mean over this micro-batch's rows      -> / num_micro
      dr_grpo: sum / (B_micro * T_max)                 -> / num_micro
      bnpo:    S_j / max(1, n_j)  (n_j its tokens)     -> S_j / max(1, N), N = the whole set's tokens
      dapo:    S_j / N_gen (already the generation batch's count, `num_batch_tokens`) -> unchanged
    """
    if loss_type in ("grpo", "dr_grpo"):
        return loss / num_micro
    if loss_type == "bnpo":
        n = jnp.maximum(mask_BxT.astype(jnp.float32).sum(), 1.0)
        return loss * (n / jnp.maximum(jnp.asarray(batch_tokens, jnp.float32), 1.0))
    return loss


def accumulate_grads(loss_fn, params, num_micro: int):
    """Sum of `jax.value_and_grad(loss_fn, has_aux=True)(params, j)` over micro-batches j (a scan, so one
    micro-batch's activations are live at a time). Returns (summed loss, metrics stacked over j, grads)."""
    def body(acc, j):
        (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params, j)
        return jax.tree.map(jnp.add, acc, g), (loss, m)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (loss_j, ms) = jax.lax.scan(body, zeros, jnp.arange(num_micro))
    return loss_j.sum(), ms, grads


def rl_step(state: TrainState, batch: dict[str, Array], *, graphdef, cfg: RLConfig, tx, lr_fn,
            reward_host: HostReward, mesh=None) -> tuple[TrainState, dict[str, Array]]:
    """One RL step. `batch`: prompt_NxP (int32), prompt_mask_NxP, answer_NxA (int32, -1 padded).

    With a `mesh`: rows are split over (data, fsdp), activations and the KV cache are pinned by the
    sharding rules, and the new state leaves in the same shardings as the rules give the old one (so
    a born-sharded state is donated in place and the step compiles once); metrics are replicated.
    """
    kw = dict(graphdef=graphdef, cfg=cfg, tx=tx, lr_fn=lr_fn, reward_host=reward_host, mesh=mesh)
    if mesh is None:
        return _rl_step(state, batch, **kw)
    shd.check_rows(batch["prompt"].shape[0] * cfg.group_size, mesh, "rows (prompts per step x rl.group_size)")
    if cfg.dynamic_sampling > 1:
        shd.check_rows(batch["prompt"].shape[0] // cfg.dynamic_sampling * cfg.group_size, mesh,
                       "rows trained on (data.batch_size x rl.group_size)")
    batch = jax.lax.with_sharding_constraint(batch, shd.batch_shardings(batch, mesh))
    with shd.activation_sharding(mesh):
        new_state, metrics = _rl_step(state, batch, **kw)
    new_state = jax.lax.with_sharding_constraint(new_state, shd.state_shardings(state, mesh))
    return new_state, jax.lax.with_sharding_constraint(metrics, shd.replicated(mesh))


def _rl_step(state: TrainState, batch: dict[str, Array], *, graphdef, cfg: RLConfig, tx, lr_fn,
             reward_host: HostReward, mesh=None) -> tuple[TrainState, dict[str, Array]]:
    G, M = cfg.group_size, cfg.num_minibatches
    temp = cfg.sampling.temperature or 1.0
    key = jax.random.fold_in(state.rng, state.step)
    k_sample, k_guide = jax.random.split(key)

    frozen = state.frozen_params
    merge = lambda p: merge_policy(graphdef, p, frozen)
    # LoRA: the reference is the same base arrays with zeroed adapters (exactly the base model; no copy)
    ref_params = state.ref_params if frozen is None else jax.tree.map(jnp.zeros_like, state.params)

    # ---- rollout, reward, advantages (and DAPO's sample-level options)
    policy = merge(jax.lax.stop_gradient(state.params))
    if batch["prompt"].shape[0] % cfg.dynamic_sampling:
        raise ValueError(f"{batch['prompt'].shape[0]} prompts sampled, not a multiple of rl.dynamic_sampling="
                         f"{cfg.dynamic_sampling}")
    ro = rollout(policy, batch, k_sample, cfg, reward_host, mesh)
    prompt_N, pmask_N, cmask, lmask, adv = ro.prompt_NxP, ro.pmask_NxP, ro.cmask_BxT, ro.loss_mask_BxT, ro.adv_B
    rep = lambda x: shd.constrain(jnp.repeat(x, G, axis=0), ("batch", None))
    prompt, pmask = rep(prompt_N), rep(pmask_N)
    B, P = prompt.shape
    if B % M:
        raise ValueError(f"rows B={B} (prompts x group_size) not divisible by rl.num_minibatches={M}")
    tokens = jnp.concatenate([prompt, ro.tokens_BxT], axis=1)
    fmask = jnp.concatenate([pmask.astype(jnp.int32), cmask], axis=1)
    num_tokens = lmask.sum()  # the tokens the loss reads

    C = cfg.score_chunks
    N = B // G
    if N % C:
        raise ValueError(f"rl.score_chunks={C} does not divide the step's {N} prompts")

    def chunked(x, per):
        """[N * per, ...] -> [C, N / C * per, ...]: chunk c holds prompts c, c + C, c + 2C, ... (interleaved,
        so that a batch sharded over its rows keeps every device's share in every chunk)."""
        x = x.reshape(N // C, C, per, *x.shape[1:])
        return jnp.moveaxis(x, 1, 0).reshape(C, N // C * per, *x.shape[3:])

    def unchunked(y):
        """The inverse of `chunked(., G)` for a [C, N / C * G, T] output."""
        y = y.reshape(C, N // C, G, *y.shape[2:])
        return jnp.moveaxis(y, 0, 1).reshape(B, *y.shape[3:])

    # (array, rows per prompt) of what a no-gradient pass reads, and the pass itself
    if cfg.share_prompt:
        score_args = ((prompt_N, 1), (pmask_N, 1), (ro.tokens_BxT, G), (cmask, G))
        score_rows = lambda model, p, pm, t, cm: grouped_logp_entropy(model, p, pm, t, cm, cfg.logp_chunk, temp)
    else:
        score_args = ((tokens, G), (fmask, G))
        score_rows = lambda model, t, fm: sequence_logp_entropy(model, t, fm, P, cfg.logp_chunk, temp)

    def score(params):
        """(logp_BxT, entropy_BxT) of the rollout under the model of `params`, no gradient; in `rl.score_chunks`
        sequential row chunks (whole groups each), so the attention of only B / C rows is live at a time. The
        params enter the loop as its (unchanged) carry and the model is built from them inside the body: an
        NNX transform in its blocks (a graphdef with remat) cannot update Variables of an outer trace."""
        if C == 1:
            return jax.lax.stop_gradient(score_rows(merge(params), *(x for x, _ in score_args)))
        body = lambda p, a: (p, score_rows(merge(p), *a))
        _, parts = jax.lax.scan(body, params, tuple(chunked(x, per) for x, per in score_args))
        return jax.lax.stop_gradient(tuple(unchunked(y) for y in parts))

    # ---- frozen reference (not compiled at all when beta == 0)
    ref_logp = ref_ent = None
    if cfg.needs_ref and cfg.loss.kl_mode == "reverse":
        ref_logp, ref_ent = score(ref_params)

    # ---- PPO's `old` log-probs, for several updates per rollout: the trainer's own forward under the params
    # that sampled (as TRL does), not the sampler's log-probs, which top-k / top-p / min-p renormalise (the
    # first update's ratio would be the kept mass, not 1). One update per rollout needs none: old = logp.
    old_logp = score(jax.lax.stop_gradient(state.params))[0] if cfg.multi_update else None
    # dapo's normaliser: the whole generation batch's completion tokens for each of the M updates (TRL 0.23,
    # the reference code's version), or one update's share of them (TRL >= 1.x rescales to the window).
    dapo_tokens = num_tokens if cfg.dapo_normalizer == "generation" else num_tokens / M

    A = cfg.grad_accum_steps
    if (B // M) % A:
        raise ValueError(f"rows per minibatch {B // M} not divisible by rl.grad_accum_steps={A}")
    rows = B // M // A  # rows of one micro-batch (= one minibatch without accumulation)
    # micro-batch index i over the whole batch: minibatch i // A, micro-batch i % A within it
    take = lambda x, i: None if x is None else jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=0)
    share_train = cfg.share_prompt and rows % G == 0  # a micro-batch of whole groups
    take_prompts = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * (rows // G), rows // G, axis=0)

    def loss_fn(params, i, step, gkey):
        model = merge(params)
        if cfg.remat is not None:
            model.remat = cfg.remat  # static attribute of this traced copy only
        if frozen is not None and model.lora_cfg.dropout > 0:
            lora_lib.set_dropout_key(model, jax.random.fold_in(gkey, 0x10A))  # training forward only
        tok, fm, cm, lm = take(tokens, i), take(fmask, i), take(cmask, i), take(lmask, i)
        if share_train:
            logp, ent = grouped_logp_entropy(model, take_prompts(prompt_N, i), take_prompts(pmask_N, i),
                                             take(ro.tokens_BxT, i), cm, cfg.logp_chunk, temp)
        else:
            logp, ent = sequence_logp_entropy(model, tok, fm, P, cfg.logp_chunk, temp)
        inputs = guides.GuideInputs(mask_BxT=lm, step=step, max_steps=cfg.max_steps, key=gkey,
                                    entropy_BxT=ent, logp_BxT=jax.lax.stop_gradient(logp),
                                    ref_logp_BxT=take(ref_logp, i), ref_entropy_BxT=take(ref_ent, i))
        log_q, q = guides.compute_log_q(cfg.guide, cfg.guide_cfg, inputs)
        fkl = None
        if cfg.needs_ref and cfg.loss.kl_mode == "forward":
            fkl = _forward_kl(model, merge(ref_params), tok, fm, P, cfg.logp_chunk, temp)
        old = take(old_logp, i)
        loss, m = losses.policy_loss(logp, old, take(ref_logp, i), log_q, take(adv, i), lm, cfg.loss,
                                     num_batch_tokens=dapo_tokens, forward_kl_BxT=fkl,
                                     sampler_logp_BxT=take(ro.raw_logp_BxT, i), entropy_BxT=ent)
        mf = lm.astype(jnp.float32)
        n = jnp.maximum(mf.sum(), 1.0)
        diff = jnp.abs(jax.lax.stop_gradient(logp) - take(ro.raw_logp_BxT, i)) * mf  # numerics: unfiltered both
        m.update(guides.guide_metrics(q, lm))
        m.update(entropy=(ent * mf).sum() / n, logp_diff_mean=diff.sum() / n, logp_diff_max=diff.max())
        return loss, m

    def update(carry, u):
        params, opt_state, step = carry
        i = u % M
        gkey = jax.random.fold_in(k_guide, u)
        if A == 1:
            (_, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, i, step, gkey)
        else:
            mb_tokens = jax.lax.dynamic_slice_in_dim(lmask, i * rows * A, rows * A, axis=0).sum()

            def micro_fn(p, j):
                loss, mj = loss_fn(p, i * A + j, step, jax.random.fold_in(gkey, j))
                shr = lambda x: micro_loss_share(x, take(lmask, i * A + j), cfg.loss.loss_type, A, mb_tokens)
                # the loss terms add up over micro-batches like the loss itself (for dapo a mean would be 1/A)
                mj.update({k: shr(mj[k]) for k in ("pg_loss", "kl_loss") if k in mj})
                return shr(loss), mj

            loss, ms_j, grads = accumulate_grads(micro_fn, params, A)
            red = {"logp_diff_max": jnp.max, "q_min": jnp.min, "q_max": jnp.max, "pg_loss": jnp.sum,
                   "kl_loss": jnp.sum}
            m = {k: red.get(k, jnp.mean)(v) for k, v in ms_j.items()}
            m["loss"] = jax.lax.stop_gradient(loss)  # the exact minibatch loss (sum of shares)
        m["grad_norm"] = optax.tree.norm(grads)
        m["lr"] = lr_fn(step)
        upd, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, upd), opt_state, step + 1), m

    n_updates = cfg.num_iterations * M
    (params, opt_state, step), ms = jax.lax.scan(
        update, (state.params, state.opt_state, state.step), jnp.arange(n_updates))

    metrics = {f"train/{k}": v.mean() for k, v in ms.items() if k not in ("logp_diff_max", "q_min", "q_max")}
    metrics["train/lr"] = ms["lr"][-1]
    # The sampler-vs-trainer gap is a numerics check: only the first update (minibatch 0 under the
    # params that sampled) is free of the drift of earlier updates.
    metrics["train/logp_diff_mean"] = ms["logp_diff_mean"][0]
    metrics["train/logp_diff_max"] = ms["logp_diff_max"][0]
    for k in ("q_mean", "q_min", "q_max", "frac_shaped"):
        metrics[f"sage/{k}"] = ms[k].min() if k == "q_min" else ms[k].max() if k == "q_max" else ms[k].mean()
        metrics.pop(f"train/{k}", None)
    metrics.update(ro.metrics)
    new_state = state.replace(step=step, params=params, opt_state=opt_state)
    return new_state, metrics


def make_rl_step(graphdef, cfg: RLConfig, tx, lr_fn, reward_host: HostReward, mesh=None):
    """The jitted step (state donated): `step_fn(state, batch) -> (state, metrics)`."""
    mesh = None if mesh is None else shd.as_auto(mesh)
    fn = functools.partial(rl_step, graphdef=graphdef, cfg=cfg, tx=tx, lr_fn=lr_fn, reward_host=reward_host,
                           mesh=mesh)
    return jax.jit(fn, donate_argnums=0)
