"""The fused RL step, one jitted program (`make_rl_step`) that reads top to bottom as its phases:

  1. rollout      (`rollout.rollout`) generate G completions per prompt with the KV cache, verifier rewards
                  through a host callback, DAPO's sample-level options, advantages adv_B
  2. reference    (`no_gradient_passes`) the frozen reference's log-probs and entropies (only when beta > 0
                  with the reverse KL), and PPO's `old` log-probs (only with several updates per rollout)
  3. update scan  (`update.update_scan`) num_iterations x M minibatch updates: policy log-probs and
                  entropies (chunked), guide q, policy loss, gradients (summed over J micro-batches), one optax
                  update (skipped when its minibatch has no loss token)
  4. metrics      (`update.reduce_metrics`) each metric reduced as `update.METRIC_REDUCTION` says

Dimension key (docs/design.md §5.4): N prompts trained on, G completions per prompt, B = N x G rows
(group-contiguous), P prompt length (left padded), T completion length, S = P + T, A answer tokens, M
minibatches per iteration, J micro-batches per update (rl.grad_accum_steps), U = num_iterations x M updates.

`old` log-probs: with one update per rollout, old = stop_gradient(logp) (ratio 1, as in TRL); with several
updates, old = the trainer's forward under the sampling params, once before the updates (the sampler's
log-probs are after top-k / top-p / min-p, not the trainer's). The guide schedule's step, the RNG and the
counters live in `TrainState`; nothing lives on the Python side.

Gradient accumulation: each update sums the gradients of J equal micro-batches (each normalised by the whole
update's denominators, `losses.normalizer`, so they sum exactly to the minibatch loss for every `loss_type`),
then applies ONE optimizer update. LoRA (`models.lora.add_lora` before `init_train_state`): `params` = the adapters
(the only optimizer state), `frozen_params` = the base; the reference is the base with zeroed adapters (no
copy of the weights).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from sage_jax import sharding as shd
from sage_jax.rewards.host import HostReward
from sage_jax.rl import guides, losses
from sage_jax.policy.packing import packed_logp_entropy, row_grid
from sage_jax.policy.logprobs import (bucketed, grouped_logp_entropy, length_grid, sequence_logp_entropy, sorted_chunks,
                                      row_lengths)
from sage_jax.rl.rollout import Rollout, rollout
from sage_jax.policy.state import TrainState, merge_policy, reference_params
from sage_jax.rl.update import UPDATE_SHUFFLES, Scores, reduce_metrics, update_scan
from sage_jax.sampling import SamplingConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RLConfig:
    group_size: int = 8  # G completions per prompt
    sampling: SamplingConfig = SamplingConfig()
    loss: losses.LossConfig = losses.LossConfig()
    # the guide with its config (guides.make_guide); a registered name gives its defaults; "none" = GRPO + KL
    guide: guides.Guide | str = "branch"
    scale_rewards: str = "group"  # group | batch | none
    num_iterations: int = 1  # updates per rollout over the same samples (PPO epochs)
    num_minibatches: int = 1  # M, rows split into M sequential updates per iteration
    grad_accum_steps: int = 1  # micro-batches per update, gradients summed into ONE optimizer update
    max_steps: int = 100  # optimizer updates of the run: the guide schedules' horizon
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
    # Real tokens only: K > 1 sorts the rows by completion length into K chunks per micro-batch (and K chunks per
    # score chunk of the no-gradient passes), and runs each chunk at the smallest of K static lengths ceil(k T / K)
    # that holds its longest row (policy/logprobs.bucketed; each length compiled once, no recompilation as lengths
    # change). The same loss, gradients and metrics as K = 1 (the decoder is causal); what changes is the
    # padding computed. 1 = every pass over the whole [B, P + T] rectangle.
    length_buckets: int = 1
    # Real tokens only, packed: K >= 1 packs each prompt's completions into rows of T slots behind its one prefilled
    # prompt (policy/packing.py: segments that see the prompt and themselves), each pass run at the smallest of K
    # static row counts ceil(k B / K) that holds them. The same loss, gradients and metrics as the padded passes;
    # 0 = off. Exclusive with length_buckets > 1.
    pack_buckets: int = 0
    # DAPO's sample-level options (sage_jax/rl/dapo.py): sample dynamic_sampling x the trained prompts, train on
    # the groups with unequal rewards first (1 = off); the soft overlong penalty over the last
    # overlong_buffer tokens (0 = off), times overlong_penalty; truncated completions out of the loss.
    dynamic_sampling: int = 1
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    overlong_filter: bool = False
    # How the rows are split into the M minibatches (rl/update.py): none (batch order) | groups (a permutation
    # of whole groups) | rows (a permutation of the rows: TRL 0.23's shuffle; the training forward then repeats
    # the prompts). Drawn once per rollout.
    update_shuffle: str = "none"
    # A non-finite loss or gradient in an update: skip that update (parameters, optimizer state and step kept) and
    # count it in train/nonfinite; False only counts it (the training loop then stops the run at that step).
    skip_nonfinite: bool = False

    def __post_init__(self):
        """The rules on the step's settings, in one place, each naming the config field that sets it
        (`config_lib.rl_config` builds this and reports a failure as a config error)."""
        if isinstance(self.guide, str):  # a name: that guide with its defaults
            object.__setattr__(self, "guide", guides.make_guide(self.guide))
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size={self.group_size}: group advantages need >= 2")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"rl.scale_rewards={self.scale_rewards!r} is not one of group, batch, none")
        if self.num_iterations < 1 or self.num_minibatches < 1:
            raise ValueError("rl.num_iterations and rl.num_minibatches must be >= 1")
        if self.grad_accum_steps < 1:
            raise ValueError(f"rl.grad_accum_steps must be >= 1, got {self.grad_accum_steps}")
        if self.score_chunks < 1:
            raise ValueError(f"rl.score_chunks must be >= 1, got {self.score_chunks}")
        if not 1 <= self.length_buckets <= self.sampling.max_new_tokens:
            raise ValueError(f"rl.length_buckets={self.length_buckets} must be in [1, rollout.max_new_tokens="
                             f"{self.sampling.max_new_tokens}] (1 = off)")
        if self.pack_buckets < 0 or self.pack_buckets and self.length_buckets > 1:
            raise ValueError(f"rl.pack_buckets={self.pack_buckets} must be >= 0 (0 = off) and is exclusive with "
                             f"rl.length_buckets={self.length_buckets} > 1: both choose how the real tokens are run")
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
            raise ValueError(f"model.remat={self.remat!r} is not one of none, full, dots")
        if self.loss.beta == 0 and self.guide.name != "none":
            raise ValueError(f"sage.guide={self.guide.name!r} with rl.beta=0: a guide reshapes the KL anchor, which does "
                             "not exist without a KL term; set sage.guide='none' or rl.beta > 0")
        if self.update_shuffle not in UPDATE_SHUFFLES:
            raise ValueError(f"rl.update_shuffle={self.update_shuffle!r} is not one of {UPDATE_SHUFFLES}")
        if self.pass_at_k and self.overlong_buffer:
            raise ValueError(f"rl.pass_at_k={self.pass_at_k} with rl.overlong_buffer={self.overlong_buffer}: the pass@k "
                             "advantage reads the verifier's 0/1 rewards, so the length penalty would have no effect; "
                             "set one of them to 0")
        if self.loss.kl_mode == "forward" and self.guide.name != "none":
            raise ValueError(f"sage.guide={self.guide.name!r} with rl.kl_mode='forward': the forward KL is taken to pi_ref "
                             "itself and a guide would be ignored; set sage.guide='none' or rl.kl_mode='reverse'")

    def check_batch(self, num_prompts: int) -> None:
        """The rules on the batch shape, before anything is traced: `num_prompts` sampled per step, of which
        N = num_prompts / rl.dynamic_sampling are trained on as B = N x G rows, in M minibatches of J
        micro-batches."""
        if num_prompts % self.dynamic_sampling:
            raise ValueError(f"{num_prompts} prompts sampled per step, not a multiple of rl.dynamic_sampling="
                             f"{self.dynamic_sampling}")
        N = num_prompts // self.dynamic_sampling
        B, M, J = N * self.group_size, self.num_minibatches, self.grad_accum_steps
        if N % self.score_chunks:
            raise ValueError(f"rl.score_chunks={self.score_chunks} does not divide the step's {N} prompts "
                             "(data.batch_size; chunks of whole groups)")
        if B % M:
            raise ValueError(f"{B} rows (data.batch_size x rollout.group_size) not divisible by "
                             f"rl.num_minibatches={M}")
        if (B // M) % J:
            raise ValueError(f"{B // M} rows per minibatch not divisible by rl.grad_accum_steps={J}")
        K = self.length_buckets
        if (B // M // J) % K or (B // self.score_chunks) % K:
            raise ValueError(f"rl.length_buckets={K} does not divide the {B // M // J} rows of a micro-batch or the "
                             f"{B // self.score_chunks} rows of a score chunk (rl.score_chunks={self.score_chunks})")

    def with_tokenizer(self, eos_ids, pad_id: int, stop=None) -> "RLConfig":
        """This config with the sampler's stop ids, pad id and compiled stop strings, which come with the
        tokenizer (a config is resolved and checked before any tokenizer loads)."""
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling, eos_ids=tuple(eos_ids),
                                                                      pad_id=int(pad_id), stop=stop))

    @property
    def needs_ref(self) -> bool:
        """A KL term exists (beta > 0): the reference is kept (its copy, or under LoRA the base)."""
        return self.loss.beta > 0

    @property
    def reference_pass(self) -> bool:
        """The no-gradient reference pass runs: reverse KL (the forward KL scores the reference in the loss)."""
        return self.needs_ref and self.loss.kl_mode == "reverse"

    @property
    def forward_kl(self) -> bool:
        return self.needs_ref and self.loss.kl_mode == "forward"

    @property
    def multi_update(self) -> bool:
        return self.num_iterations > 1 or self.num_minibatches > 1


def rl_step(state: TrainState, batch: dict[str, Array], *, graphdef, cfg: RLConfig, tx, lr_fn,
            reward_host: HostReward, mesh=None) -> tuple[TrainState, dict[str, Array]]:
    """One RL step. `batch`: prompt_NxP (int32), prompt_mask_NxP, answer_NxA (int32, -1 padded).

    With a `mesh`: rows are split over (data, fsdp), activations and the KV cache are pinned by the
    sharding rules, and the new state leaves in the same shardings as the rules give the old one (so
    a born-sharded state is donated in place and the step compiles once); metrics are replicated.
    """
    cfg.check_batch(batch["prompt"].shape[0])
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
    k_sample, k_guide = jax.random.split(jax.random.fold_in(state.rng, state.step))
    merge = lambda p: merge_policy(graphdef, p, state.frozen_params)

    ro = rollout(merge(jax.lax.stop_gradient(state.params)), batch, k_sample, cfg, reward_host, mesh)
    scores = no_gradient_passes(state, ro, merge, cfg)
    (params, opt_state, step), ms = update_scan(state, ro, scores, merge, cfg, tx, lr_fn, k_guide)
    metrics = {**reduce_metrics(ms), **ro.metrics}
    return state.replace(step=step, params=params, opt_state=opt_state), metrics


def full_rows(ro: Rollout, G: int) -> tuple[Array, Array]:
    """(tokens_BxS, mask_BxS): each row's prompt (repeated G times) followed by its completion, for the passes
    that do not share a prompt's forward across its group (`rl.share_prompt=False`, partial groups in a
    micro-batch, the forward KL). XLA drops them when nothing reads them."""
    rep = lambda x: shd.constrain(jnp.repeat(x, G, axis=0), ("batch", None))
    tokens = jnp.concatenate([rep(ro.prompt_NxP), ro.tokens_BxT], axis=1)
    mask = jnp.concatenate([rep(ro.pmask_NxP).astype(jnp.int32), ro.cmask_BxT], axis=1)
    return tokens, mask


def no_gradient_passes(state: TrainState, ro: Rollout, merge, cfg: RLConfig) -> Scores:
    """`Scores` (ref_logp_BxT, ref_entropy_BxT, old_logp_BxT) of the rollout, each None when not needed: the reference
    only with beta > 0 and the reverse KL (no reference pass is compiled otherwise), `old` only with several
    updates per rollout: the trainer's own forward under the params that sampled (as TRL does), not the
    sampler's log-probs, which top-k / top-p / min-p renormalise (the first ratio would be the kept mass).

    Under rl.pack_buckets each chunk's real tokens are packed behind its prompts (policy/packing.py).

    Both run in `rl.score_chunks` sequential row chunks of whole groups (interleaved prompts, so a batch
    sharded over its rows keeps every device's share in every chunk): the attention of only
    B / score_chunks rows is live at a time. The params enter the chunk loop as its (unchanged) carry and the
    model is built from them inside the body: an NNX transform in its blocks (a graphdef with remat) cannot
    update Variables of an outer trace."""
    if cfg.length_buckets > 1:
        return _scores_by_length(state, ro, merge, cfg)
    G, n_chunks = cfg.group_size, cfg.score_chunks
    temp = cfg.sampling.temperature or 1.0
    N, P = ro.prompt_NxP.shape
    B = N * G
    shared_args = ((ro.prompt_NxP, 1), (ro.pmask_NxP, 1), (ro.tokens_BxT, G), (ro.cmask_BxT, G))
    if cfg.pack_buckets:  # a chunk's N / C prompts once, their rows' real tokens packed behind them
        args, grid, prompt_of = shared_args, row_grid(B // n_chunks, cfg.pack_buckets), jnp.arange(B // n_chunks) // G
        score_rows = lambda params, p, pm, t, cm: packed_logp_entropy(merge, params, p, pm, t, cm, prompt_of, grid,
                                                                      cfg.logp_chunk, temp)
    elif cfg.share_prompt:
        args = shared_args
        score_rows = lambda params, p, pm, t, cm: grouped_logp_entropy(merge(params), p, pm, t, cm, cfg.logp_chunk,
                                                                       temp)
    else:
        tokens, mask = full_rows(ro, G)
        args = ((tokens, G), (mask, G))
        score_rows = lambda params, t, m: sequence_logp_entropy(merge(params), t, m, P, cfg.logp_chunk, temp)

    def chunked(x, per):  # [N * per, ...] -> [n_chunks, N / n_chunks * per, ...], chunk c = prompts c, c + C, ...
        x = x.reshape(N // n_chunks, n_chunks, per, *x.shape[1:])
        return jnp.moveaxis(x, 1, 0).reshape(n_chunks, N // n_chunks * per, *x.shape[3:])

    def unchunked(y):  # the inverse of chunked(., G) for a [n_chunks, N / n_chunks * G, T] output
        y = y.reshape(n_chunks, N // n_chunks, G, *y.shape[2:])
        return jnp.moveaxis(y, 0, 1).reshape(B, *y.shape[3:])

    def score(params):
        if n_chunks == 1:
            return jax.lax.stop_gradient(score_rows(params, *(x for x, _ in args)))
        body = lambda p, a: (p, score_rows(p, *a))
        _, parts = jax.lax.scan(body, params, tuple(chunked(x, per) for x, per in args))
        return jax.lax.stop_gradient(tuple(unchunked(y) for y in parts))

    ref_logp = ref_ent = None
    if cfg.reference_pass:
        ref_logp, ref_ent = score(reference_params(state))
    old_logp = score(jax.lax.stop_gradient(state.params))[0] if cfg.multi_update else None
    return Scores(ref_logp, ref_ent, old_logp)


def _scores_by_length(state: TrainState, ro: Rollout, merge, cfg: RLConfig) -> Scores:
    """`no_gradient_passes` under rl.length_buckets = K: the rows sorted by completion length into score_chunks x K
    chunks (`sorted_chunks`: interleaved, so a row-sharded batch keeps every device's share in every chunk), each
    run at the smallest grid length that holds it; the results go back to the rollout's row order. A chunk's rows
    come from any prompts: every prompt's forward once per chunk when there are fewer prompts than rows in it,
    else each row with its own prompt."""
    G, temp = cfg.group_size, cfg.sampling.temperature or 1.0
    (N, P), (B, T) = ro.prompt_NxP.shape, ro.tokens_BxT.shape
    C = cfg.score_chunks * cfg.length_buckets
    grid = length_grid(T, cfg.length_buckets)
    perm = sorted_chunks(row_lengths(ro.cmask_BxT), C)
    rows = lambda x: shd.constrain(x[perm], ("batch",) + (None,) * (x.ndim - 1))
    chunked = lambda x: jnp.swapaxes(x.reshape(B // C, C, *x.shape[1:]), 0, 1)  # chunk c = rows c, c + C, ...
    prompt_of = rows(jnp.arange(B) // G)
    shared = cfg.share_prompt and N < B // C

    def at_length(t, params, tokens, cmask, prompt_index):
        model = merge(params)
        if shared:
            return grouped_logp_entropy(model, ro.prompt_NxP, ro.pmask_NxP, tokens[:, :t], cmask[:, :t],
                                        cfg.logp_chunk, temp, prompt_index_B=prompt_index)
        full = jnp.concatenate([ro.prompt_NxP[prompt_index], tokens[:, :t]], axis=1)
        mask = jnp.concatenate([ro.pmask_NxP[prompt_index].astype(jnp.int32), cmask[:, :t]], axis=1)
        return sequence_logp_entropy(model, full, mask, P, cfg.logp_chunk, temp)

    def score(params):
        body = lambda p, a: (p, bucketed(at_length, a[1], grid, p, *a))
        args = tuple(chunked(x) for x in (rows(ro.tokens_BxT), rows(ro.cmask_BxT), prompt_of))
        _, parts = jax.lax.scan(body, params, args)
        inverse = jnp.argsort(perm)
        return jax.lax.stop_gradient(tuple(jnp.swapaxes(y, 0, 1).reshape(B, T)[inverse] for y in parts))

    ref_logp = ref_ent = None
    if cfg.reference_pass:
        ref_logp, ref_ent = score(reference_params(state))
    old_logp = score(jax.lax.stop_gradient(state.params))[0] if cfg.multi_update else None
    return Scores(ref_logp, ref_ent, old_logp)


def make_rl_step(graphdef, cfg: RLConfig, tx, lr_fn, reward_host: HostReward, mesh=None):
    """The jitted step (state donated): `step_fn(state, batch) -> (state, metrics)`."""
    mesh = None if mesh is None else shd.as_auto(mesh)
    fn = functools.partial(rl_step, graphdef=graphdef, cfg=cfg, tx=tx, lr_fn=lr_fn, reward_host=reward_host,
                           mesh=mesh)
    return jax.jit(fn, donate_argnums=0)
