"""Scoring on real tokens by packing: each prompt's completions packed into rows of T slots behind its one
prefilled prompt (rl.pack_buckets).

Dimension key: B completion rows, T completion slots, N prompts, P prompt length, R pack rows, D model, K the
number of static pack-row counts a pass chooses among.

A pass prefills the N prompts once. Each completion's real tokens (its `row_lengths`) then take consecutive slots
of a pack row that holds completions of its prompt only (first fit, longest first): the row's keys are its prompt's
cached keys / values followed by its T slots, each completion's slots a segment of its own that sees the prompt and
its own earlier tokens (the decoder's segment mask), at the positions the padded row gives them. The pass runs at
the smallest of K static row counts ceil(k B / K) that holds the packing (a `lax.switch`, each count compiled
once), and its log-probs and entropies go back to [B, T], zero past each row's length.

Exact against the padded pass up to float reassociation: every real token sees the same keys at the same
positions; only the padding it no longer computes is gone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sage_jax.models.decoder import gather_cache, init_cache, positions_from_mask
from sage_jax.policy.logprobs import row_lengths, token_logp_entropy

Array = jax.Array


def row_grid(B: int, buckets: int) -> tuple[int, ...]:
    """The static pack-row counts a pass chooses from: ceil(k B / K) for k = 1..K, B the last."""
    return tuple(sorted({-(-B * k // buckets) for k in range(1, buckets + 1)}))


def pack(lengths_B: Array, prompt_of_B: Array, T: int) -> tuple[Array, Array, Array]:
    """(row_B, offset_B, rows): completion b's pack row and first slot, and the rows used. Rows hold one prompt's
    completions: within a prompt, longest first, each goes into the first of the prompt's rows that still has
    room for it, else into a new row (first fit decreasing: no completion is split, no row exceeds T slots)."""
    B = lengths_B.shape[0]
    order = jnp.argsort(prompt_of_B * (T + 1) + (T - lengths_B), stable=True)
    idx = jnp.arange(B)

    def place(carry, b):
        fill, next_row, first_row, prev = carry
        n, q = lengths_B[b], prompt_of_B[b]
        first_row = jnp.where(q != prev, next_row, first_row)  # this prompt's rows: [first_row, next_row)
        fits = (idx >= first_row) & (idx < next_row) & (fill + n <= T)
        row = jnp.where(jnp.any(fits), jnp.argmax(fits), next_row)
        offset = fill[row]
        return (fill.at[row].add(n), next_row + (row == next_row), first_row, q), (row, offset)

    init = (jnp.zeros((B,), lengths_B.dtype), jnp.int32(0), jnp.int32(0), jnp.asarray(-1, prompt_of_B.dtype))
    (_, rows, _, _), (row_o, off_o) = jax.lax.scan(place, init, order)
    inverse = jnp.argsort(order)
    return row_o[inverse], off_o[inverse], rows


def packed_logp_entropy(build, params, prompt_NxP: Array, prompt_mask_NxP: Array, completion_BxT: Array,
                        completion_mask_BxT: Array, prompt_of_B: Array, grid: tuple[int, ...], chunk: int = 256,
                        temperature: float = 1.0, remat: str | None = None,
                        entropy_grad: bool = False) -> tuple[Array, Array]:
    """`grouped_logp_entropy` of B rows (row b continues prompt `prompt_of_B[b]`) over their packed real tokens:
    log-probs and entropies [B, T], zero past each row's `row_lengths`. `build(params)` makes the model inside
    each static branch (an NNX transform in its blocks cannot touch an outer trace's Variables)."""
    (N, P), (B, T) = prompt_NxP.shape, completion_BxT.shape
    pmask = prompt_mask_NxP.astype(jnp.int32)
    cmask = completion_mask_BxT.astype(jnp.int32)
    lengths = row_lengths(cmask)
    row_B, off_B, rows = pack(lengths, prompt_of_B, T)
    t_T = jnp.arange(T)
    used_BxT = t_T[None, :] < lengths[:, None]
    # the padded row's positions: the prompt's real tokens, then the completion's
    pos_BxT = positions_from_mask(jnp.concatenate([pmask[prompt_of_B], cmask], axis=1))[:, P:]

    def at_rows(R, params):
        model = build(params)
        cache = init_cache(model.cfg, N, P, model.dtype)
        hidden_p, cache = model.forward(prompt_NxP, positions_from_mask(pmask), pmask, cache, 0, remat=remat)
        slot_BxT = jnp.where(used_BxT, (row_B * T + off_B)[:, None] + t_T[None, :], R * T)  # R * T: not placed
        scatter = lambda fill, x: jnp.full((R * T,), fill, x.dtype).at[slot_BxT].set(x, mode="drop").reshape(R, T)
        tokens = scatter(0, completion_BxT.astype(jnp.int32))
        segment = scatter(0, jnp.where(cmask > 0, 2 + jnp.arange(B)[:, None], 0))  # ids >= 2: one per completion
        first = scatter(False, jnp.broadcast_to(t_T[None, :] == 0, (B, T)))
        positions = scatter(0, pos_BxT)
        prompt_R = jnp.zeros((R,), jnp.int32).at[row_B].set(prompt_of_B.astype(jnp.int32), mode="drop")
        kv = jnp.concatenate([pmask[prompt_R], segment], axis=1)
        hidden_c, _ = model.forward(tokens, positions, kv, gather_cache(cache, prompt_R, T), P, remat=remat)
        # slot s predicts its token from slot s - 1, or from the prompt's last position at a completion's start
        before = jnp.concatenate([jnp.zeros_like(hidden_c[:, :1]), hidden_c[:, :-1]], axis=1)
        h = jnp.where(first[..., None], hidden_p[prompt_R, -1][:, None, :], before)
        logp, ent = token_logp_entropy(h, model.unembed_matrix(), tokens, chunk, temperature, entropy_grad)
        back = lambda y: jnp.where(used_BxT, y.reshape(R * T)[jnp.minimum(slot_BxT, R * T - 1)], 0.0)
        return back(logp), back(ent)

    if len(grid) == 1:
        return at_rows(grid[0], params)
    branches = [lambda p, R=R: at_rows(R, p) for R in grid]
    return jax.lax.switch(jnp.searchsorted(jnp.asarray(grid), rows), branches, params)
