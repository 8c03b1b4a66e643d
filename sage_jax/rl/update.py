"""The RL step's update phase: U = num_iterations x M optimizer updates over one rollout, a scan.

Dimension key (docs/design.md §5.4): N prompts trained on, G completions per prompt, B = N x G rows, P prompt
length, T completion length, M minibatches per iteration, J micro-batches per update (rl.grad_accum_steps),
R = B / M / J rows of a micro-batch, U = num_iterations x M updates.

- Composition (`rl.update_shuffle`): the rows are split into the M minibatches in batch order ("none"), after
  one permutation of the groups ("groups", prompt sharing kept) or of the rows ("rows", TRL 0.23's
  `shuffle_sequence_dict` before `split_tensor_dict`; each micro-batch then repeats its prompts), drawn once
  per rollout from the step's key.
- Denominators: each update's loss is normalised over the whole update (`losses.normalizer` of its loss
  mask, its entropy selection and dapo's generation-batch count), so the J micro-batch losses and gradients
  sum exactly to the one-big-batch ones for every `loss_type`.
- An update with no loss token (every row of its minibatch masked: a dynamic-sampling shortfall, an overlong
  filter) is skipped: parameters, optimizer state and the step counter (lr and guide schedules) stay as they
  are, as if the update did not exist (DAPO trains on kept groups only). `train/updates_skipped` counts them,
  and the per-update metrics are reduced over the updates that ran.
- `rl.entropy_top_frac` with J > 1: the top fraction is taken over the whole update, from a no-gradient
  forward of its rows before the micro-batches (one extra forward per update), so accumulation stays memory,
  not math.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sage_jax import sharding as shd
from sage_jax.models import lora as lora_lib
from sage_jax.rl import guides, losses
from sage_jax.rl.forward_kl import sequence_forward_kl
from sage_jax.policy.logprobs import bucketed, grouped_logp_entropy, length_grid, row_lengths, sequence_logp_entropy
from sage_jax.policy.packing import packed_logp_entropy, row_grid
from sage_jax.policy.state import reference_params

Array = jax.Array
UPDATE_SHUFFLES = ("none", "groups", "rows")


class Scores(NamedTuple):
    """What the no-gradient passes computed over the rollout (None where not needed)."""
    ref_logp_BxT: Array | None = None
    ref_entropy_BxT: Array | None = None
    old_logp_BxT: Array | None = None


class Rows(NamedTuple):
    """The rollout's per-row arrays in update order, and each row's prompt."""
    tokens_BxT: Array
    cmask_BxT: Array
    lmask_BxT: Array  # the loss mask
    raw_logp_BxT: Array | None
    adv_B: Array
    scores: Scores
    prompt_BxP: Array  # each row's prompt (full rows: prompt then completion)
    pmask_BxP: Array
    prompt_NxP: Array  # the prompts, one per group (in update order when whole groups move)
    pmask_NxP: Array
    prompt_of_B: Array  # each row's prompt, an index into prompt_NxP


_first = lambda v: v[0]
_last = lambda v: v[-1]

# How each metric of the update scan reduces: over the J micro-batches of one update (jnp.mean: weighted by their
# loss tokens, the metrics being token means, so J micro-batches report what one batch would), then over the
# step's updates that ran; and its namespace in metrics.jsonl. Not listed: the mean, then the mean, under train/.
METRIC_REDUCTION = {
    # name:          (micro-batches, updates, namespace)
    "loss": (jnp.sum, jnp.mean, "train"),  # a micro-batch's loss is its share of the update's loss
    "pg_loss": (jnp.sum, jnp.mean, "train"),
    "kl_loss": (jnp.sum, jnp.mean, "train"),
    "entropy_loss": (jnp.sum, jnp.mean, "train"),
    # sampler-vs-trainer numerics: only update 0 runs under the params that sampled, free of earlier drift
    "logp_diff_mean": (jnp.mean, _first, "train"),
    "logp_diff_max": (jnp.max, _first, "train"),
    "grad_norm": (None, jnp.mean, "train"),  # once per update
    "nonfinite": (None, jnp.max, "train"),  # 1 when the loss or the gradient of an update was NaN / inf
    "lr": (None, _last, "train"),
    "q_mean": (jnp.mean, jnp.mean, "sage"),
    "q_min": (jnp.min, jnp.min, "sage"),
    "q_max": (jnp.max, jnp.max, "sage"),
    "frac_shaped": (jnp.mean, jnp.mean, "sage"),
    "frac_shaped_first": (jnp.mean, jnp.mean, "sage"),
    "frac_shaped_later": (jnp.mean, jnp.mean, "sage"),
}
_DEFAULT_REDUCTION = (jnp.mean, jnp.mean, "train")


def reduction(name: str):
    return METRIC_REDUCTION.get(name, _DEFAULT_REDUCTION)


def accumulate_grads(loss_fn, params, num_micro: int):
    """Sum of `jax.value_and_grad(loss_fn, has_aux=True)(params, j)` over micro-batches j (a scan, so one
    micro-batch's activations are live at a time). Returns (summed loss, metrics stacked over j, grads)."""
    def body(acc, j):
        (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params, j)
        return jax.tree.map(jnp.add, acc, g), (loss, m)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (loss_j, ms) = jax.lax.scan(body, zeros, jnp.arange(num_micro))
    return loss_j.sum(), ms, grads


def update_order(ro, scores: Scores, cfg, key) -> Rows:
    """The rollout's rows in the order the minibatches take them (`rl.update_shuffle`)."""
    G = cfg.group_size
    N = ro.prompt_NxP.shape[0]
    B = N * G
    group_of = jnp.arange(B) // G
    if cfg.update_shuffle == "none":
        perm, gperm = None, None
    elif cfg.update_shuffle == "groups":
        gperm = jax.random.permutation(key, N)
        perm = (gperm[:, None] * G + jnp.arange(G)).reshape(B)
    else:
        perm, gperm = jax.random.permutation(key, B), None
    rows = lambda x: None if x is None or perm is None else shd.constrain(x[perm], ("batch",) + (None,) * (x.ndim - 1))
    take = lambda x: x if perm is None else rows(x)
    prompt_of = group_of if perm is None else group_of[perm]
    rep = lambda x: shd.constrain(x[prompt_of], ("batch", None))
    prompts = (ro.prompt_NxP, ro.pmask_NxP) if gperm is None else (ro.prompt_NxP[gperm], ro.pmask_NxP[gperm])
    return Rows(take(ro.tokens_BxT), take(ro.cmask_BxT), take(ro.loss_mask_BxT),
                None if ro.raw_logp_BxT is None else take(ro.raw_logp_BxT), take(ro.adv_B),
                Scores(*(None if s is None else take(s) for s in scores)), rep(ro.prompt_NxP), rep(ro.pmask_NxP),
                *prompts, group_of if gperm is not None else prompt_of)


def update_scan(state, ro, scores: Scores, merge, cfg, tx, lr_fn, key) -> tuple[tuple[Any, Any, Array], dict]:
    """U = num_iterations x M optimizer updates over the rollout, a scan: update u trains minibatch u mod M, as J
    micro-batches whose gradients are summed. Returns ((params, opt_state, step), per-update metrics [U], with
    `applied`: whether each update ran)."""
    up = _Updates(state, ro, scores, merge, cfg, tx, lr_fn, key)
    n_updates = cfg.num_iterations * cfg.num_minibatches
    return jax.lax.scan(up.update, (state.params, state.opt_state, state.step), jnp.arange(n_updates))


class _Updates:
    """One rollout's update scan, phase by phase: the rows in update order (`update_order`), micro-batch i's
    forward, its loss, the update's entropy selection, one optimizer step, and the skip of an empty update."""

    def __init__(self, state, ro, scores: Scores, merge, cfg, tx, lr_fn, key):
        self.cfg, self.merge, self.tx, self.lr_fn = cfg, merge, tx, lr_fn
        self.lora_dropout = state.frozen_params is not None
        self.k_guide = key  # update u's guide key: fold_in(key, u); the order's key is a stream of its own
        rw = update_order(ro, scores, cfg, jax.random.fold_in(key, 0x5EED))
        M, K = cfg.num_minibatches, cfg.length_buckets
        # rl.length_buckets = K > 1: each micro-batch in K chunks, the minibatch's rows sorted by length, each chunk
        # run at the smallest of K static lengths that holds it (policy/logprobs.bucketed): J x K micro-batches
        self.J = cfg.grad_accum_steps * K
        self.grid = length_grid(rw.tokens_BxT.shape[1], K)
        self.rw = rw = rw if K == 1 else _by_length(rw, M)
        B, self.P = rw.tokens_BxT.shape[0], rw.prompt_BxP.shape[1]
        self.tokens = jnp.concatenate([rw.prompt_BxP, rw.tokens_BxT], axis=1)
        self.fmask = jnp.concatenate([rw.pmask_BxP.astype(jnp.int32), rw.cmask_BxT], axis=1)
        self.lmask = rw.lmask_BxT
        J = self.J
        # dapo / cispo's normaliser: the whole generation batch's loss tokens for each of the M updates (TRL 0.23,
        # the reference code's version), or one update's share of them (TRL >= 1.x rescales to the window).
        self.dapo_tokens = self.lmask.sum() if cfg.dapo_normalizer == "generation" else self.lmask.sum() / M
        self.ref_params = reference_params(state) if cfg.forward_kl else None
        self.rows = B // M // J  # rows of a micro-batch; micro-batch i = minibatch i // J, micro-batch i % J in it
        # Each prompt's forward once for its rows: micro-batches of whole groups, or (rows in any order) every
        # prompt once per micro-batch when there are no more prompts than rows in it (the official preset)
        self.grouped = cfg.update_shuffle != "rows" and K == 1
        N, G = rw.prompt_NxP.shape[0], cfg.group_size
        self.share = cfg.share_prompt and (self.rows % G == 0 if self.grouped else N <= self.rows)
        self.pack_grid = row_grid(self.rows, cfg.pack_buckets) if cfg.pack_buckets else None

    def take(self, x, i, n=None):
        """Rows [i * n, (i + 1) * n) of x (n: a micro-batch's rows)."""
        n = self.rows if n is None else n
        return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * n, n, axis=0)

    def model(self, params, gkey=None):
        """The policy from `params`; under LoRA dropout, keyed for this micro-batch (training forward only)."""
        model = self.merge(params)
        if gkey is not None and self.lora_dropout and model.lora_cfg.dropout > 0:
            lora_lib.set_dropout_key(model, jax.random.fold_in(gkey, 0x10A))
        return model

    def forward(self, params, i, gkey=None, remat=None, grad=None):
        """Policy log-probs and entropies of micro-batch i, [R, T], at the smallest length of the grid that holds
        its rows (the model is built inside, as an NNX transform in its blocks must be)."""
        cfg, rw, take = self.cfg, self.rw, self.take
        kw = dict(remat=cfg.remat if remat is None else remat,
                  entropy_grad=cfg.loss.entropy_coef > 0 if grad is None else grad)
        temp = cfg.sampling.temperature or 1.0
        tokens_BxT, cmask_BxT = take(rw.tokens_BxT, i), take(rw.cmask_BxT, i)

        def at_length(t, params):
            model = self.model(params, gkey)
            if self.share and self.grouped:
                tp = lambda x: take(x, i, self.rows // cfg.group_size)
                return grouped_logp_entropy(model, tp(rw.prompt_NxP), tp(rw.pmask_NxP), tokens_BxT[:, :t],
                                            cmask_BxT[:, :t], cfg.logp_chunk, temp, **kw)
            if self.share:
                return grouped_logp_entropy(model, rw.prompt_NxP, rw.pmask_NxP, tokens_BxT[:, :t], cmask_BxT[:, :t],
                                            cfg.logp_chunk, temp, prompt_index_B=take(rw.prompt_of_B, i), **kw)
            return sequence_logp_entropy(model, take(self.tokens, i)[:, :self.P + t],
                                         take(self.fmask, i)[:, :self.P + t], self.P, cfg.logp_chunk, temp, **kw)

        if cfg.pack_buckets:  # the micro-batch's prompts once, its rows' real tokens packed behind them
            if self.share and self.grouped:
                tp = lambda x: take(x, i, self.rows // cfg.group_size)
                prompts, prompt_of = (tp(rw.prompt_NxP), tp(rw.pmask_NxP)), jnp.arange(self.rows) // cfg.group_size
            else:
                prompts, prompt_of = (rw.prompt_NxP, rw.pmask_NxP), take(rw.prompt_of_B, i)
            return packed_logp_entropy(lambda p: self.model(p, gkey), params, *prompts, tokens_BxT, cmask_BxT,
                                       prompt_of, self.pack_grid, cfg.logp_chunk, temp, **kw)
        return bucketed(at_length, cmask_BxT, self.grid, params)

    def loss(self, params, i, step, gkey, norm, selected):
        """Micro-batch i's loss (its share of the update's, under `norm`) and metrics."""
        cfg, rw, take = self.cfg, self.rw, self.take
        lm = take(self.lmask, i)
        logp, ent = self.forward(params, i, gkey)
        sc = Scores(*(take(s, i) for s in rw.scores))
        inputs = guides.GuideInputs(mask_BxT=lm, step=step, max_steps=cfg.max_steps, key=gkey,
                                    entropy_BxT=jax.lax.stop_gradient(ent), logp_BxT=jax.lax.stop_gradient(logp),
                                    ref_logp_BxT=sc.ref_logp_BxT, ref_entropy_BxT=sc.ref_entropy_BxT)
        log_q, q = cfg.guide.log_q(inputs)
        fkl = None
        if cfg.forward_kl:
            fkl = sequence_forward_kl(self.model(params, gkey), self.merge(self.ref_params), take(self.tokens, i), take(self.fmask, i),
                                      self.P, cfg.logp_chunk, cfg.sampling.temperature or 1.0, remat=cfg.remat)
        sampler_logp = take(rw.raw_logp_BxT, i)
        loss, m = losses.policy_loss(logp, sc.old_logp_BxT, sc.ref_logp_BxT, log_q, take(rw.adv_B, i), lm, cfg.loss,
                                     num_batch_tokens=self.dapo_tokens, forward_kl_BxT=fkl,
                                     sampler_logp_BxT=sampler_logp, entropy_BxT=ent, norm=norm,
                                     selected_BxT=take(selected, i))
        mf = lm.astype(jnp.float32)
        n = jnp.maximum(mf.sum(), 1.0)
        diff = jnp.abs(jax.lax.stop_gradient(logp) - sampler_logp) * mf  # numerics: unfiltered both
        m.update(guides.guide_metrics(q, lm))
        m.update(entropy=(jax.lax.stop_gradient(ent) * mf).sum() / n, logp_diff_mean=diff.sum() / n,
                 logp_diff_max=diff.max())
        return loss, m

    def selection(self, params, i):
        """J > 1 with entropy_top_frac < 1: the minibatch's top-entropy tokens, from a no-gradient forward of
        its J micro-batches (at the update's params), as J = 1 chooses them from its one forward."""
        J, frac = self.J, self.cfg.loss.entropy_top_frac
        if J == 1 or frac >= 1:
            return None
        # params as the scan's (unchanged) carry: the model is built inside the body (see rl.step's passes)
        body = lambda p, j: (p, self.forward(p, i * J + j, remat="none", grad=False)[1])
        ent = jax.lax.stop_gradient(jax.lax.scan(body, params, jnp.arange(J))[1].reshape(self.rows * J, -1))
        return losses.top_entropy_tokens(ent, self.take(self.lmask, i, self.rows * J), frac)

    def apply(self, carry, u):
        """Update u: minibatch u mod M's gradient (summed over its J micro-batches), one optimizer step."""
        params, opt_state, step = carry
        J, rows, M = self.J, self.rows, self.cfg.num_minibatches
        i = u % M
        gkey = jax.random.fold_in(self.k_guide, u)
        if J == 1:
            (_, m), grads = jax.value_and_grad(self.loss, has_aux=True)(params, i, step, gkey, None, None)
        else:
            selected = self.selection(params, i)
            lmask = self.take(self.lmask, i, rows * J)
            norm = losses.normalizer(lmask, self.dapo_tokens, selected)
            micro = lambda p, j: self.loss(p, i * J + j, step, jax.random.fold_in(gkey, j), norm,
                                           _micro_rows(selected, j, rows))
            _, ms_j, grads = accumulate_grads(micro, params, J)
            m = reduce_micro_batches(ms_j, lmask.reshape(J, rows, -1).sum((1, 2)))
        m["grad_norm"] = optax.tree.norm(grads)
        m["lr"] = self.lr_fn(step)
        finite = jnp.isfinite(m["grad_norm"]) & jnp.isfinite(m["loss"])
        m["nonfinite"] = jnp.logical_not(finite).astype(jnp.float32)
        upd, new_opt = self.tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, upd), new_opt, step + 1)
        if self.cfg.skip_nonfinite:  # keep what was there: no NaN reaches the parameters or Adam's moments
            new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (params, opt_state, step))
        return new, m

    def update(self, carry, u):
        """`apply`, or (no loss token in minibatch u mod M) no optimizer step at all, zero metrics."""
        rows = self.rows * self.J
        has_tokens = self.take(self.lmask, u % self.cfg.num_minibatches, rows).any()
        out_shape = jax.eval_shape(self.apply, carry, u)[1]

        def skip(carry, u):
            m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
            return carry, {**m, "lr": self.lr_fn(carry[2])}

        carry, m = jax.lax.cond(has_tokens, self.apply, skip, carry, u)
        return carry, {**m, "applied": has_tokens}


def _by_length(rw: Rows, M: int) -> Rows:
    """`rw` with each of its M minibatches' rows sorted by completion length, longest first (`row_lengths`):
    which rows an update trains on is unchanged, only the order within it, which its loss does not see."""
    B, T = rw.tokens_BxT.shape
    length_B = row_lengths(rw.cmask_BxT)
    perm = jnp.argsort((jnp.arange(B) // (B // M)) * (T + 1) + (T - length_B), stable=True)
    rows = lambda x: None if x is None else shd.constrain(x[perm], ("batch",) + (None,) * (x.ndim - 1))
    return rw._replace(tokens_BxT=rows(rw.tokens_BxT), cmask_BxT=rows(rw.cmask_BxT), lmask_BxT=rows(rw.lmask_BxT),
                       raw_logp_BxT=rows(rw.raw_logp_BxT), adv_B=rows(rw.adv_B),
                       scores=Scores(*(rows(x) for x in rw.scores)), prompt_BxP=rows(rw.prompt_BxP),
                       pmask_BxP=rows(rw.pmask_BxP), prompt_of_B=rows(rw.prompt_of_B))


def reduce_micro_batches(ms_j: dict[str, Array], tokens_J: Array) -> dict[str, Array]:
    """One update's metrics from its J micro-batches' (stacked over j): `METRIC_REDUCTION`'s first entry, a
    mean weighted by each micro-batch's loss tokens."""
    w = tokens_J.astype(jnp.float32)
    out = {}
    for k, v in ms_j.items():
        over_micro = reduction(k)[0]
        if over_micro is jnp.mean:
            out[k] = (v * w.reshape(w.shape + (1,) * (v.ndim - 1))).sum(0) / jnp.maximum(w.sum(), 1.0)
        else:
            out[k] = over_micro(v)
    return out


def _micro_rows(selected, j, rows):
    """Micro-batch j's rows of a minibatch-wide mask (J x rows rows)."""
    if selected is None:
        return None
    return jax.lax.dynamic_slice_in_dim(selected, j * rows, rows, axis=0)


def reduce_metrics(ms: dict[str, Array]) -> dict[str, Array]:
    """The per-update metrics [U] of `update_scan` -> the step's, as `METRIC_REDUCTION` says, over the updates
    that ran (`applied`); `train/updates_skipped` counts the others."""
    applied = ms["applied"]
    n = applied.sum()
    out = {"train/updates_skipped": applied.size - n}
    first = jnp.argmax(applied)  # the first update that ran (0 when none did)
    last = applied.size - 1 - jnp.argmax(applied[::-1])
    for k, v in ms.items():
        if k == "applied":
            continue
        _, over_updates, namespace = reduction(k)
        w = applied.reshape(applied.shape + (1,) * (v.ndim - 1))
        if over_updates is jnp.mean:
            r = jnp.where(w, v, 0).sum(0) / jnp.maximum(n, 1)
        elif over_updates is _first:
            r = v[first]
        elif over_updates is _last:
            r = v[last]
        elif over_updates is jnp.min:
            r = jnp.where(n > 0, jnp.where(w, v, jnp.inf).min(0), 0)
        elif over_updates is jnp.max:
            r = jnp.where(n > 0, jnp.where(w, v, -jnp.inf).max(0), 0)
        else:
            r = over_updates(v)
        out[f"{namespace}/{k}"] = r
    return out
