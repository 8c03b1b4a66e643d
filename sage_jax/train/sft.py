"""Supervised fine-tuning: cross-entropy on prompt + solution with the prompt tokens masked.

Dimension key: B batch, S sequence (prompt + completion, right padded).

Loss = sum over target tokens of -log p(token) / number of target tokens (a token mean over the
batch), where target tokens are the completion and its closing EOS (`data.sft_loss_on = "completion"`) or
every token after the first (`"all"`: TRL's SFTTrainer on a plain text field, as the official SFT stage). Used for a pre-RL SFT stage and to
train the embedded tiny base model from scratch. Under LoRA only the adapters train (`state.params`),
the base rides along frozen in `state.frozen_params`, as in the RL step.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sage_jax.models.decoder import positions_from_mask
from sage_jax.policy.logprobs import token_logp_entropy
from sage_jax.policy.state import merge_policy


def sft_lengths(tokenizer, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """Tokens per example as `encode_sft` lays it out: prompt + completion + EOS."""
    p = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    c = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    return np.array([len(a) + len(b) + 1 for a, b in zip(p, c)], np.int64)


def encode_sft(tokenizer, prompts: Sequence[str], completions: Sequence[str], eos_id: int, length: int,
               pad_id: int = 0, loss_on: str = "completion") -> dict[str, np.ndarray]:
    """Right-padded `tokens`, `mask` (attention) and `loss_mask` of shape BxS. `loss_on="completion"`: the
    completion and its EOS are the targets; `"all"`: every token (TRL's SFTTrainer on a plain text field)."""
    B = len(prompts)
    tokens = np.full((B, length), pad_id, np.int32)
    mask = np.zeros((B, length), np.int32)
    loss_mask = np.zeros((B, length), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        pi = tokenizer(p, add_special_tokens=False)["input_ids"]
        ci = tokenizer(c, add_special_tokens=False)["input_ids"] + [eos_id]
        n = len(pi) + len(ci)
        if n > length:
            raise ValueError(f"example {i}: {n} tokens (prompt {len(pi)} + completion {len(ci)}) exceed "
                             f"data.max_sft_tokens={length}; raise it (nothing is truncated silently)")
        tokens[i, :n] = pi + ci
        mask[i, :n] = 1
        loss_mask[i, (0 if loss_on == "all" else len(pi)):n] = 1
    return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask}


def sft_loss(params, graphdef, batch, chunk: int = 256, frozen_params=None):
    """`params`: what trains (under LoRA the adapters, with the base in `frozen_params`)."""
    model = merge_policy(graphdef, params, frozen_params)
    tokens, mask = batch["tokens"], batch["mask"]
    hidden, _ = model.forward(tokens, positions_from_mask(mask), mask)
    # hidden[:, s] predicts tokens[:, s + 1]
    logp, ent = token_logp_entropy(hidden[:, :-1], model.unembed_matrix(), tokens[:, 1:], chunk)
    lm = batch["loss_mask"][:, 1:].astype(jnp.float32)
    n = jnp.maximum(lm.sum(), 1.0)
    loss = -(logp * lm).sum() / n
    acc = ((jnp.exp(logp) > 0.5) * lm).sum() / n  # share of target tokens the model is sure of
    return loss, {"train/loss": loss, "train/entropy": (ent * lm).sum() / n, "train/token_conf": acc,
                  "train/tokens": lm.sum()}


def sft_step(state, batch, *, graphdef, tx, lr_fn, chunk=256, skip_nonfinite=False):
    """One SFT update. A non-finite loss or gradient is counted in train/nonfinite; with `skip_nonfinite` the
    update is then skipped (the state kept), else it is applied and the training loop stops the run."""
    (_, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(state.params, graphdef, batch, chunk,
                                                                    state.frozen_params)
    metrics["train/grad_norm"] = optax.tree.norm(grads)
    metrics["train/lr"] = lr_fn(state.step)
    finite = jnp.isfinite(metrics["train/grad_norm"]) & jnp.isfinite(metrics["train/loss"])
    metrics["train/nonfinite"] = jnp.logical_not(finite).astype(jnp.float32)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = (state.step + 1, optax.apply_updates(state.params, updates), opt_state)
    if skip_nonfinite:
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (state.step, state.params, state.opt_state))
    return state.replace(step=new[0], params=new[1], opt_state=new[2]), metrics


def make_sft_step(graphdef, tx, lr_fn, chunk: int = 256, skip_nonfinite: bool = False):
    return jax.jit(functools.partial(sft_step, graphdef=graphdef, tx=tx, lr_fn=lr_fn, chunk=chunk,
                                     skip_nonfinite=skip_nonfinite), donate_argnums=0)
