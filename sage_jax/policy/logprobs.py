"""Per-token log-probabilities and entropies without materialising float32 [B, T, V] logits.

Dimension key: B rows, S = P + T sequence, P prompt length, T completion length (the positions scored),
N prompts, G rows per prompt, D model, V vocab, C chunk length.

The sequence is cut into chunks of C positions; each chunk's logits (BxCxV, float32) live only inside a
`jax.checkpoint`ed scan body, so the backward pass recomputes them chunk by chunk instead of keeping
them all. At V = 152k, B = 8, T = 4k this is the difference between 20 GB and a few hundred MB.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sage_jax.models.decoder import gather_cache, init_cache, positions_from_mask, repeat_cache

Array = jax.Array


def _chunk_stats(hidden_BxCxD, unembed_DxV, targets_BxC, temperature, entropy_grad=False):
    logits = jnp.einsum("bcd,dv->bcv", hidden_BxCxD, unembed_DxV, preferred_element_type=jnp.float32)
    logits = logits / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BxC[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - logz[..., None])
    # H = logZ - sum_v p_v * logit_v; detached unless an entropy bonus differentiates it (the guides and the
    # entropy selection use it as a constant signal).
    if entropy_grad:
        return tgt - logz, logz - jnp.sum(probs * logits, axis=-1)
    entropy = logz - jnp.sum(jax.lax.stop_gradient(probs) * logits, axis=-1)
    return tgt - logz, jax.lax.stop_gradient(entropy)


def map_position_chunks(fn, arrays, chunk: int):
    """`fn` over the sequence in chunks of C = min(chunk, T) positions, one chunk live at a time.

    Every array of `arrays` is [B, T, ...]; `fn` takes their [B, C, ...] chunks and returns a tuple of
    [B, C] outputs, which come back as [B, T]. The chunk body is `jax.checkpoint`ed, so a backward pass
    recomputes each chunk's float32 logits instead of keeping them. T is zero-padded to a multiple of C.
    """
    B, T = arrays[0].shape[:2]
    C = min(chunk, T)
    pad = (-T) % C
    n = (T + pad) // C

    def split(a):  # [B, T, ...] -> [n, B, C, ...]
        if pad:
            a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
        return a.reshape(B, n, C, *a.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def body(_, xs):
        return None, fn(*xs)

    _, out = jax.lax.scan(body, None, tuple(split(a) for a in arrays))
    return tuple(y.swapaxes(0, 1).reshape(B, n * C)[:, :T] for y in out)


def token_logp_entropy(hidden_BxTxD: Array, unembed_DxV: Array, targets_BxT: Array, chunk: int = 256,
                       temperature: float = 1.0, entropy_grad: bool = False) -> tuple[Array, Array]:
    """log p(target_t) and the full-distribution entropy at every position, both BxT float32.

    `hidden_BxTxD[:, t]` predicts `targets_BxT[:, t]`. Differentiable in the log-probs; the entropy is
    stop-gradient unless `entropy_grad` (an entropy bonus).
    """
    stats = lambda h, y: _chunk_stats(h, unembed_DxV, y, temperature, entropy_grad)
    return map_position_chunks(stats, (hidden_BxTxD, targets_BxT), chunk)


def sequence_logp_entropy(model, tokens_BxS: Array, mask_BxS: Array, completion_start: int, chunk: int = 256,
                          temperature: float = 1.0, remat: str | None = None,
                          entropy_grad: bool = False) -> tuple[Array, Array]:
    """Log-probs / entropies of the completion tokens `tokens_BxS[:, completion_start:]`.

    `tokens_BxS` = left-padded prompt (P = completion_start) followed by the completion (T); returns BxT.
    The hidden state at position s predicts token s + 1.
    """
    hidden, _ = model.forward(tokens_BxS, positions_from_mask(mask_BxS), mask_BxS, remat=remat)
    h = hidden[:, completion_start - 1:-1]
    return token_logp_entropy(h, model.unembed_matrix(), tokens_BxS[:, completion_start:], chunk, temperature,
                              entropy_grad)


def grouped_logp_entropy(model, prompt_NxP: Array, prompt_mask_NxP: Array, completion_BxT: Array,
                         completion_mask_BxT: Array, chunk: int = 256, temperature: float = 1.0,
                         remat: str | None = None, entropy_grad: bool = False,
                         prompt_index_B: Array | None = None) -> tuple[Array, Array]:
    """`sequence_logp_entropy` of B rows whose row b is prompt b // G + completion b (or prompt
    `prompt_index_B[b]`), with each prompt's forward pass done once and its keys / values shared by its rows.

    The same numbers as the repeated-prompt call (up to float reassociation), gradients included (they
    reach the shared prompt positions summed over their rows); the prompt positions cost N rows instead
    of B, and the completion queries attend over P + T keys without scoring P x (P + T) prompt queries.
    """
    (N, P), (B, T) = prompt_NxP.shape, completion_BxT.shape
    pmask = prompt_mask_NxP.astype(jnp.int32)
    cache = init_cache(model.cfg, N, P, model.dtype)
    hidden_p, cache = model.forward(prompt_NxP, positions_from_mask(pmask), pmask, cache, 0, remat=remat)
    if prompt_index_B is None:  # groups in order: a repeat (cheaper than a gather)
        G = B // N
        if N * G != B:
            raise ValueError(f"{B} completion rows are not a whole number of groups of the {N} prompts")
        rows = lambda x: jnp.repeat(x, G, axis=0)
        cache = repeat_cache(cache, G, T)
    else:
        rows = lambda x: x[prompt_index_B]
        cache = gather_cache(cache, prompt_index_B, T)
    full_mask = jnp.concatenate([rows(pmask), completion_mask_BxT.astype(jnp.int32)], axis=1)
    positions = positions_from_mask(full_mask)[:, P:]
    hidden_c, _ = model.forward(completion_BxT, positions, full_mask, cache, P, remat=remat)
    # The prompt's last position predicts completion token 0; completion position t predicts t + 1.
    h = jnp.concatenate([rows(hidden_p[:, -1:]), hidden_c[:, :-1]], axis=1)
    return token_logp_entropy(h, model.unembed_matrix(), completion_BxT, chunk, temperature, entropy_grad)


# ---------------------------------------------------------------- real tokens only (length buckets)
def length_grid(T: int, buckets: int) -> tuple[int, ...]:
    """The static completion lengths a bucketed pass chooses from: ceil(k T / K) for k = 1..K, T the last."""
    return tuple(sorted({-(-T * k // buckets) for k in range(1, buckets + 1)}))


def row_lengths(cmask_BxT: Array) -> Array:
    """Each row's used completion positions, [B]: one past its last real token (0 when it has none)."""
    T = cmask_BxT.shape[1]
    return jnp.max(jnp.where(cmask_BxT > 0, jnp.arange(1, T + 1), 0), axis=1)


def used_length(cmask_BxT: Array) -> Array:
    """The completion positions the rows use: the longest `row_lengths`."""
    return row_lengths(cmask_BxT).max()


def bucketed(fn, cmask_BxT: Array, grid: tuple[int, ...], *operands):
    """`fn(t, *operands)` -> a tuple of [R, t] arrays, run at the smallest length t of `grid` that holds every
    row's completion (`used_length`), its outputs zero-padded back to [R, T]: a `lax.switch` among len(grid)
    static shapes, each compiled once, so the executed positions follow the real ones without recompiling.

    Exact: the decoder is causal, so no output at a position < t reads a position >= t; the cut positions are
    padding that the loss masks (and that a padded pass would have computed for nothing)."""
    T = cmask_BxT.shape[1]
    if len(grid) == 1:
        return fn(T, *operands)
    k = jnp.searchsorted(jnp.asarray(grid), used_length(cmask_BxT))

    def branch(t):
        pad = lambda y: jnp.pad(y, ((0, 0), (0, T - t)) + ((0, 0),) * (y.ndim - 2))
        return lambda *ops: tuple(pad(y) for y in fn(t, *ops))

    return jax.lax.switch(k, [branch(t) for t in grid], *operands)


def sorted_chunks(lengths_B: Array, n_chunks: int) -> Array:
    """A row order for `n_chunks` chunks by length, where chunk c is rows perm[c::n_chunks] (the interleaved
    layout of the chunked passes, so that rows sharded over a mesh keep every device's share in every chunk):
    chunk 0 holds the longest B / n_chunks rows, chunk 1 the next, and so on."""
    B = lengths_B.shape[0]
    by_length = jnp.argsort(-lengths_B, stable=True)  # rank r -> row
    # position j * n_chunks + c holds rank c * (B / n_chunks) + j
    return by_length.reshape(n_chunks, B // n_chunks).T.reshape(B)
