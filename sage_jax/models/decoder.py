"""Flax NNX decoder for the Qwen2 / Qwen2.5 / Qwen3 / Llama 3 families: one code path, config flags.

Dimension key: B batch, T query length, S key/cache length, D model, F MLP, H query heads, K kv heads,
G = H / K (query heads per kv head), Dh head dim, V vocab, L layers.

Every weight carries its logical axis names (`axes=` metadata on the `nnx.Param`); `sage_jax.sharding`
maps them to mesh axes with one rules table. Parameters are stored in `param_dtype` and cast to the
compute `dtype` at use; normalisation statistics, softmax and RoPE run in float32.

Positions come from the attention mask (`cumsum(mask) - 1`), so left-padded batches give each real
token the position it would have unpadded. Causality is by cache slot: with left padding, slot order
is token order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax import sharding as shd
from sage_jax.models.config import ModelConfig
from sage_jax.models.lora import adapted

Array = jax.Array
_NEG_INF = -1e30  # finite, so a fully masked (padding) query row gives a uniform softmax, not NaN


def _init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return std * jax.random.normal(rngs.params(), shape, dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32, axis_name: str = "norm"):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=(axis_name,))

    def __call__(self, x: Array) -> Array:
        # As in HF: statistics in float32, cast back, then scale in the input dtype.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


# ------------------------------------------------------------------------------------------ RoPE
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [Dh/2] (float64 on the host; a compile-time constant)."""
    dh = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    if cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        # Llama 3.1 "llama3" rope: long wavelengths divided by `factor`, short ones kept, smooth in between.
        factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_positions
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(cfg: ModelConfig, positions_BxT: Array) -> tuple[Array, Array]:
    inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv  # BxTx(Dh/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # BxTx1xDh, broadcast over heads
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BxTxNxDh: Array, cos: Array, sin: Array) -> Array:
    x = x_BxTxNxDh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # HF rotate_half (non-interleaved halves)
    return (x * cos + rotated * sin).astype(x_BxTxNxDh.dtype)


# ------------------------------------------------------------------------------------------ blocks
class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        D, H, K, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.dtype = cfg, dtype
        self.q_chunk = 0  # static: multi-token calls attend in query chunks of this size (0 = all at once)
        self.wq = nnx.Param(_init(rngs, (D, H, Dh), param_dtype), axes=("embed", "q_heads", "head_dim"))
        self.wk = nnx.Param(_init(rngs, (D, K, Dh), param_dtype), axes=("embed", "kv_heads", "head_dim"))
        self.wv = nnx.Param(_init(rngs, (D, K, Dh), param_dtype), axes=("embed", "kv_heads", "head_dim"))
        self.wo = nnx.Param(_init(rngs, (H, Dh, D), param_dtype), axes=("q_heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((H, Dh), param_dtype), axes=("q_heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((K, Dh), param_dtype), axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((K, Dh), param_dtype), axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, param_dtype=param_dtype, axis_name="head_dim")
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, param_dtype=param_dtype, axis_name="head_dim")

    def _proj(self, x, w, b, target):
        y = adapted(self, target, x, jnp.einsum("btd,dnh->btnh", x, w[...].astype(self.dtype)), self.dtype)
        return y if b is None else y + b[...].astype(self.dtype)

    def __call__(self, x_BxTxD, cos, sin, kv_mask_BxS, cache=None, cache_index=None):
        cfg = self.cfg
        bias = cfg.qkv_bias
        q = self._proj(x_BxTxD, self.wq, self.bq if bias else None, "q")  # BxTxHxDh
        k = self._proj(x_BxTxD, self.wk, self.bk if bias else None, "k")  # BxTxKxDh
        v = self._proj(x_BxTxD, self.wv, self.bv if bias else None, "v")
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        B, T = x_BxTxD.shape[:2]
        qg = q.reshape(B, T, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        if cache is None:  # training / scoring: keys are this chunk, BxTxKxDh
            out = _attend_causal(qg, k, v, 0, kv_mask_BxS, "bskd", self.dtype, self.q_chunk)
        elif isinstance(cache, DecodeKV):  # one-token decode step: write the slot, attend over the parts
            cache = cache._replace(k=_write(cache.k, k, cache_index), v=_write(cache.v, v, cache_index))
            out = _decode_attention(qg[:, 0], cache, kv_mask_BxS, cache_index, self.dtype)[:, None]
        else:  # a chunk (prefill, prompt-shared scoring) into the (donated) static-shape BxKxSxDh cache
            cache = {"k": _write(cache["k"], k, cache_index), "v": _write(cache["v"], v, cache_index)}
            out = _attend_causal(qg, cache["k"].astype(self.dtype), cache["v"].astype(self.dtype), cache_index,
                                 kv_mask_BxS, "bksd", self.dtype, self.q_chunk)
        out = out.reshape(B, T, cfg.num_heads, cfg.head_dim)
        y = adapted(self, "o", out, jnp.einsum("bthd,hdo->bto", out, self.wo[...].astype(self.dtype)), self.dtype)
        return y, cache


def _mask(start, T, S, kv_mask_BxS):
    """BxTxS: query t (at cache slot start + t) sees slot s <= its slot that holds a real token: mask value 1 (seen
    by all) or a segment id >= 2, seen by that segment's queries only (sage_jax.policy.packing); 0 is padding."""
    kv = kv_mask_BxS.astype(jnp.int32)[:, None, :]
    q_ids = jax.lax.dynamic_slice_in_dim(jnp.pad(kv[:, 0], ((0, 0), (0, T))), start, T, axis=1)[:, :, None]
    return (jnp.arange(S)[None, :] <= (start + jnp.arange(T))[:, None])[None] & ((kv == 1) | (kv > 1) & (kv == q_ids))


def _attend_causal(qg_BxTxKxGxDh, k, v, start, kv_mask_BxS, kv_spec, dtype, q_chunk=0):
    """Causal attention of T queries (at slots start ... start + T - 1) against S keys.

    `q_chunk` > 0 and < T: the queries in chunks of `q_chunk` under a checkpointed map, so the float32
    scores of only q_chunk x S (not T x S) per row and head are live, in the forward and in the backward
    (which recomputes each chunk's scores). Each query's softmax reads only its own row, so the numbers are
    those of one pass."""
    B, T = qg_BxTxKxGxDh.shape[:2]
    S = kv_mask_BxS.shape[1]
    if not q_chunk or T <= q_chunk:
        return _attend(qg_BxTxKxGxDh, k, v, _mask(start, T, S, kv_mask_BxS), kv_spec, dtype)
    n = -(-T // q_chunk)
    q = jnp.pad(qg_BxTxKxGxDh, ((0, 0), (0, n * q_chunk - T), (0, 0), (0, 0), (0, 0)))
    q = jnp.moveaxis(q.reshape(B, n, q_chunk, *q.shape[2:]), 1, 0)  # n x B x C x K x G x Dh

    @jax.checkpoint
    def one(args):
        q_c, i = args  # padded query rows (past T) see keys like the last ones and are dropped below
        return _attend(q_c, k, v, _mask(start + i * q_chunk, q_chunk, S, kv_mask_BxS), kv_spec, dtype)

    out = jax.lax.map(one, (q, jnp.arange(n)))
    return jnp.moveaxis(out, 0, 1).reshape(B, n * q_chunk, *out.shape[3:])[:, :T]


def _attend(qg_BxTxKxGxDh, k, v, mask_BxTxS, kv_spec, dtype):
    """T queries per row against S keys; `kv_spec` names the key/value layout ("bskd" or "bksd")."""
    scores = jnp.einsum(f"btkgd,{kv_spec}->bkgts", qg_BxTxKxGxDh, k) * (qg_BxTxKxGxDh.shape[-1] ** -0.5)
    probs = _softmax(scores, mask_BxTxS[:, None, None], dtype)
    return jnp.einsum(f"bkgts,{kv_spec}->btkgd", probs, v)


def _softmax(scores, mask, dtype):
    """Masked softmax over the last axis in float32, cast back to the compute dtype."""
    return _softmax_last(jnp.where(mask, scores.astype(jnp.float32), _NEG_INF)).astype(dtype)


@jax.custom_jvp
def _softmax_last(x):
    """Softmax over the last axis whose derivative is written in terms of its output, dx = y * (g - sum(y g)).
    `jax.nn.softmax` differentiates through its division unless `jax_softmax_custom_jvp` is set (off by
    default in jax 0.10): its backward keeps exp(x - max) and the sum, and on XLA:CPU the fused quotient-rule
    backward of the attention probabilities was the training phase's slowest fusion (bench README, item 10)."""
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


@_softmax_last.defjvp
def _softmax_last_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = _softmax_last(x)
    return y, y * (x_dot - jnp.sum(y * x_dot, axis=-1, keepdims=True))


def _write(cache_BxKxSxDh, x_BxTxKxDh, index):
    """In-place write of a chunk's keys or values at cache slots [index, index + T)."""
    x = x_BxTxKxDh.swapaxes(1, 2).astype(cache_BxKxSxDh.dtype)
    return jax.lax.dynamic_update_slice(cache_BxKxSxDh, x, (0, 0, index, 0))


class DecodeKV(NamedTuple):
    """One layer's cache for one-token decode steps, attended in parts under one softmax.

    A decode step reads only slots that can hold tokens: the prompt once per group, and the completion in
    segments of which only the finished ones and the current one exist (`sampling.generate`).
    - prompt_k / prompt_v: NxKxPxDh, the prefilled prompts; prompt n serves rows [n * G, (n + 1) * G) of
      the B = N * G decode rows; its valid slots are the prompt mask (the `kv_mask` of the call).
    - past_k / past_v: the finished completion segments, BxKxLjxDh each, every slot written.
    - k / v: the segment being written, BxKxLxDh; the step at `cache_index` writes slot `cache_index`
      and sees the slots up to it.
    """
    prompt_k: Array
    prompt_v: Array
    past_k: tuple[Array, ...]
    past_v: tuple[Array, ...]
    k: Array
    v: Array


def _decode_attention(q_BxKxGxDh, kv: DecodeKV, prompt_mask_NxP, index, dtype):
    """One query per row against the parts of a `DecodeKV` (float32 scores, softmax and accumulation).

    The caches are BxKxSxDh so that (b, k) are their leading dims: both contractions are batched matmuls
    over each part in its own layout. With a BxSxKxDh cache XLA:CPU transpose-copied every layer's cache
    at every step, and multiply-and-reduce over it ran at ~2 GFLOP/s (experiments/bench/README.md).
    """
    f32 = jnp.float32
    B, K, g, Dh = q_BxKxGxDh.shape
    N = kv.prompt_k.shape[0]
    G = B // N
    q = q_BxKxGxDh
    qn = q.reshape(N, G, K, g, Dh)  # rows of one prompt together: its keys are read once for the group
    parts_k, parts_v = (*kv.past_k, kv.k), (*kv.past_v, kv.v)
    scores = [jnp.einsum("nrkgd,nksd->nrkgs", qn, kv.prompt_k.astype(q.dtype),
                         preferred_element_type=f32).reshape(B, K, g, -1)]
    scores += [jnp.einsum("bkgd,bksd->bkgs", q, k.astype(q.dtype), preferred_element_type=f32) for k in parts_k]
    L = kv.k.shape[2]
    masks = ([jnp.repeat(prompt_mask_NxP.astype(bool), G, axis=0)]
             + [jnp.ones((B, k.shape[2]), bool) for k in kv.past_k]
             + [jnp.broadcast_to(jnp.arange(L) <= index, (B, L))])
    probs = _softmax(jnp.concatenate(scores, -1) * Dh ** -0.5, jnp.concatenate(masks, -1)[:, None, None], f32)
    p_prompt, *p_parts = jnp.split(probs, np.cumsum([s.shape[-1] for s in scores])[:-1], axis=-1)
    out = jnp.einsum("nrkgs,nksd->nrkgd", p_prompt.reshape(N, G, K, g, -1), kv.prompt_v.astype(f32)).reshape(B, K, g, Dh)
    for p, v in zip(p_parts, parts_v):
        out = out + jnp.einsum("bkgs,bksd->bkgd", p, v.astype(f32))
    return out.astype(dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype
        self.w_gate = nnx.Param(_init(rngs, (D, F), param_dtype), axes=("embed", "mlp"))
        self.w_up = nnx.Param(_init(rngs, (D, F), param_dtype), axes=("embed", "mlp"))
        self.w_down = nnx.Param(_init(rngs, (F, D), param_dtype), axes=("mlp", "embed"))

    def __call__(self, x_BxTxD):
        # Tokens flattened to one axis: with [B, T, D] operands XLA:CPU wrote the backward's [F, B*T]
        # operands of the weight-gradient dots as transposed copies, 20% of the small benchmark's training
        # phase (experiments/bench/README.md, item 8). The attention projections gained nothing from it.
        x = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])
        c = lambda p: p[...].astype(self.dtype)
        lin = lambda x, w, t: adapted(self, t, x, x @ c(w), self.dtype)  # + LoRA when that target has one
        h = jax.nn.silu(lin(x, self.w_gate, "gate")) * lin(x, self.w_up, "up")
        return lin(h, self.w_down, "down").reshape(x_BxTxD.shape)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_mask, cache=None, cache_index=None):
        h, cache = self.attn(self.input_norm(x), cos, sin, kv_mask, cache, cache_index)
        x = x + h
        return x + self.mlp(self.post_attn_norm(x)), cache


# Rematerialisation of each block in the (cache-free) training forward: "full" saves only the block's
# input and recomputes everything in the backward pass; "dots" keeps the matmul outputs (recomputes the
# cheap elementwise ops). Decoding with a cache never remats (no backward pass).
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_saveable}


def _call_block(layer, x, cos, sin, kv_mask, cache, cache_index):
    return layer(x, cos, sin, kv_mask, cache, cache_index)


def _block_call(remat: str):
    if remat == "none":
        return _call_block
    return nnx.remat(_call_block, policy=REMAT_POLICIES[remat], prevent_cse=True)


def positions_from_mask(mask_BxT: Array) -> Array:
    """Position ids that follow the attention mask (left padding gets the unpadded positions)."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


class Decoder(nnx.Module):
    """Causal LM. `model(tokens_BxT, attention_mask=None) -> logits_BxTxV (float32)`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None, remat: str = "none", attention_chunk: int = 0):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r} is not one of {tuple(REMAT_POLICIES)}")
        self.cfg, self.dtype = cfg, dtype
        self.remat = remat  # static: training forward rematerialisation per block (cache-free calls only)
        self.embed = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), param_dtype), axes=("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(_init(rngs, (cfg.hidden_size, cfg.vocab_size), param_dtype),
                                     axes=("embed", "vocab"))
        self.set_attention_chunk(attention_chunk)

    def set_attention_chunk(self, q_chunk: int) -> None:
        """Multi-token calls (training, scoring, prefill) attend in query chunks of `q_chunk` (0 = all at once):
        float32 scores of q_chunk x S per row and head are live instead of T x S; the same numbers. A static
        attribute, so `nnx.split` carries it in the graphdef to every model merged from it."""
        if q_chunk < 0:
            raise ValueError(f"attention chunk must be >= 0 (0 = off), got {q_chunk}")
        for layer in self.layers:
            layer.attn.q_chunk = int(q_chunk)

    def unembed_matrix(self) -> Array:
        """DxV output projection in the compute dtype (the transposed embedding when tied)."""
        w = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return w.astype(self.dtype)

    def forward(self, tokens_BxT: Array, positions_BxT: Array, kv_mask_BxS: Array,
                cache: list[dict[str, Array]] | list[DecodeKV] | None = None,
                cache_index: Array | int | None = None, remat: str | None = None):
        """Final hidden states BxTxD (after the final norm) and the updated cache.

        `remat` (none | full | dots) overrides the model's own block rematerialisation for this call: the RL
        step's training forward passes `rl.remat` here, the no-gradient passes keep the model's.

        Without a cache, S == T and `kv_mask_BxS` is the attention mask. With a cache of S slots (per layer
        a dict of k, v), this chunk is written at slots [cache_index, cache_index + T) and `kv_mask_BxS`
        marks valid slots. With `DecodeKV`s (T == 1), the token is written at slot `cache_index` of the
        current segment and `kv_mask_BxS` is the NxP prompt mask.
        """
        # `shd.constrain` pins the residual stream at block boundaries under a sharded step (rows over
        # data x fsdp); it is the identity otherwise.
        act = lambda h: shd.constrain(h, ("batch", "seq", "act_embed"))
        x = act(jnp.take(self.embed[...], tokens_BxT, axis=0).astype(self.dtype))
        cos, sin = rope_cos_sin(self.cfg, positions_BxT)
        new_cache = [] if cache is not None else None
        # One-token decode steps never remat (no backward pass); a multi-token chunk over a cache may be
        # trained through (the prompt-shared scoring in sage_jax.policy.logprobs), so it remats like a cache-free call.
        remat = self.remat if remat is None else remat
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r} is not one of {tuple(REMAT_POLICIES)}")
        call = _block_call(remat if cache is None or tokens_BxT.shape[1] > 1 else "none")
        for i, layer in enumerate(self.layers):
            x, c = call(layer, x, cos, sin, kv_mask_BxS, None if cache is None else cache[i], cache_index)
            x = act(x)
            if cache is not None:
                new_cache.append(c)
        return self.final_norm(x), new_cache

    def logits(self, hidden_BxTxD: Array) -> Array:
        return jnp.einsum("btd,dv->btv", hidden_BxTxD, self.unembed_matrix(),
                          preferred_element_type=jnp.float32)

    def __call__(self, tokens_BxT: Array, attention_mask: Array | None = None) -> Array:
        if attention_mask is None:
            attention_mask = jnp.ones(tokens_BxT.shape, jnp.int32)
        hidden, _ = self.forward(tokens_BxT, positions_from_mask(attention_mask), attention_mask)
        return self.logits(hidden)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> list[dict[str, Array]]:
    """Static-shape KV cache: per layer k, v of shape BxKxSxDh (kept in the decode loop carry)."""
    shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
    return shd.constrain_cache([{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                                for _ in range(cfg.num_layers)])


def gather_cache(cache: list[dict[str, Array]], rows: Array, extra_slots: int) -> list[dict[str, Array]]:
    """An N-row cache of S slots -> len(rows) rows (row r a copy of cache row rows[r]) of S + extra_slots: each
    prompt is prefilled once and its keys / values are shared by the rows that continue it; the empty slots
    that follow receive the completion tokens."""
    return _grow_cache(cache, lambda x: x[rows], extra_slots)


def repeat_cache(cache: list[dict[str, Array]], group: int, extra_slots: int) -> list[dict[str, Array]]:
    """`gather_cache` of rows 0, 0, ..., 1, 1, ... (each `group` times), as a repeat."""
    return _grow_cache(cache, lambda x: jnp.repeat(x, group, axis=0), extra_slots)


def _grow_cache(cache, rows_of, extra_slots):
    grow = lambda x: jnp.pad(rows_of(x), ((0, 0), (0, 0), (0, extra_slots), (0, 0)))
    return shd.constrain_cache([{name: grow(x) for name, x in c.items()} for c in cache])


def param_count(model: nnx.Module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
