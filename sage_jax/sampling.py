"""Jitted generation with a static-shape KV cache.

Dimension key: B batch (rows), P prompt length (left padded), T max new tokens, S = P + T cache slots,
V vocab.

One prefill pass writes each prompt into an N-row cache (positions from the attention mask), read once
per group of rows at every step. `lax.while_loop`s then decode one token per iteration until every row
has emitted an EOS / stop id, completed a stop string, or T tokens exist. The completion's cache is split into
`decode_segments` segments with one loop each: a step reads the prompt, the finished segments and its
own, not the empty slots after it (`decoder.DecodeKV`). Each layer's current segment is a separate
array in the loop carry, updated in place with `dynamic_update_slice` (no per-step re-stacking).

Sampling: logits / temperature, then top-k, top-p (nucleus) and min-p filters (in that order, as in
transformers and vLLM); `temperature == 0` is greedy. `logp_BxT` is the log-probability of each sampled
token under the distribution it was sampled from (after temperature and filters; under greedy, the
model's temperature-1 distribution). `entropy_BxT` is the entropy of the temperature-scaled, unfiltered
distribution. The completion mask is 1 up to and including the first EOS and 0 after it; tokens after
it are `pad_id`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax import sharding as shd
from sage_jax.models.decoder import DecodeKV, init_cache, positions_from_mask

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64  # T, tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens with p < min_p * p_max; 0 = off
    eos_ids: tuple[int, ...] = ()  # stop ids (EOS and e.g. <|im_end|>)
    # text-level stop strings (sage_jax.stop_strings.StopStrings): a row stops after the token that completes
    # one in its decoded text, which is kept, as transformers' stop_strings / vLLM's include_stop_str_in_output
    stop: object = None
    pad_id: int = 0
    # Speed only (the samples do not depend on it): the completion cache in this many segments, each
    # decoded by a loop that reads the filled segments only (at most T - 1 are used; 1 = one loop).
    decode_segments: int = 4

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):  # NaN and inf fail too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:  # NaN fails it
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.decode_segments < 1:
            raise ValueError(f"decode_segments must be >= 1, got {self.decode_segments}")


class SampleOutput(NamedTuple):
    tokens_BxT: Array  # int32, pad_id after the first EOS
    mask_BxT: Array  # int32, 1 on real completion tokens (incl. the EOS)
    logp_BxT: Array  # float32, 0 where mask == 0
    entropy_BxT: Array  # float32, 0 where mask == 0
    num_steps: Array  # decode iterations run (<= T)
    # float32, 0 where mask == 0: the sampled token's log-prob under the temperature-scaled distribution before
    # top-k / top-p / min-p (what the trainer's forward computes; `logp_BxT` is after the filters)
    raw_logp_BxT: Array | None = None
    # bool: the row ended with an end-of-sequence id or a stop string (else it was truncated at max_new_tokens)
    stopped_B: Array | None = None


def filter_logits(logits_BxV: Array, cfg: SamplingConfig) -> Array:
    """Temperature-scaled logits with the filtered-out tokens at -inf."""
    x = logits_BxV.astype(jnp.float32) / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        srt = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # keep a token if the mass before it < top_p
        keep = mass_before < cfg.top_p
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < thresh, -jnp.inf, x)
    if cfg.min_p > 0.0:
        logp = jax.nn.log_softmax(x, axis=-1)
        x = jnp.where(logp < jnp.log(cfg.min_p) + jnp.max(logp, axis=-1, keepdims=True), -jnp.inf, x)
    return x


def sample_token(logits_BxV: Array, key: Array, cfg: SamplingConfig) -> tuple[Array, Array, Array, Array]:
    """(token_B, logp_B, entropy_B, raw_logp_B) for one decode step (raw: before the filters)."""
    if cfg.temperature == 0.0:
        lsm = jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1)
        tok = jnp.argmax(lsm, axis=-1)
        lp = raw = jnp.take_along_axis(lsm, tok[:, None], axis=-1)[:, 0]
    else:
        lsm = jax.nn.log_softmax(logits_BxV.astype(jnp.float32) / cfg.temperature, axis=-1)
        filtered = filter_logits(logits_BxV, cfg)
        tok = jax.random.categorical(key, filtered, axis=-1)
        lp = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), tok[:, None], axis=-1)[:, 0]
        raw = jnp.take_along_axis(lsm, tok[:, None], axis=-1)[:, 0]
    ent = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
    return tok.astype(jnp.int32), lp, ent, raw


def _is_stop(tok_B: Array, cfg: SamplingConfig) -> Array:
    if not cfg.eos_ids:
        return jnp.zeros(tok_B.shape, bool)
    return jnp.isin(tok_B, jnp.asarray(cfg.eos_ids, jnp.int32))


def segment_lengths(slots: int, segments: int) -> list[int]:
    """Sizes of the completion cache's segments: `slots` split as evenly as possible into at most
    `segments` parts (none when there are no slots)."""
    n = min(segments, slots)
    if n < 1:
        return []
    base, extra = divmod(slots, n)
    return [base + (i < extra) for i in range(n)]


def generate(model, prompt_NxP: Array, prompt_mask_NxP: Array, key: Array, cfg: SamplingConfig,
             cache_dtype=None, group_size: int = 1) -> SampleOutput:
    """Samples up to T tokens for each of B = N * group_size rows (row b continues prompt b // group_size).

    `model` is a Decoder (merged inside the caller's jit). Each prompt is prefilled once and its keys /
    values are read once per group at each step, which is the same as `jnp.repeat(prompt, group_size, 0)`.
    The completion's keys / values live in `cfg.decode_segments` segments, each decoded by its own loop
    that attends over the finished segments and itself only, so early steps do not read empty slots.
    """
    N, P = prompt_NxP.shape
    B, T = N * group_size, cfg.max_new_tokens
    mcfg = model.cfg
    dtype = cache_dtype or model.dtype
    rep = lambda x: jnp.repeat(x, group_size, axis=0)
    pmask = prompt_mask_NxP.astype(jnp.int32)
    prefill = init_cache(mcfg, N, P, dtype)
    hidden, prefill = model.forward(prompt_NxP, positions_from_mask(pmask), pmask, prefill, 0)
    logits = rep(model.logits(hidden[:, -1:])[:, 0])
    prompt_len_B = rep(jnp.sum(pmask, axis=1))

    tok, lp, ent, raw = sample_token(logits, jax.random.fold_in(key, 0), cfg)
    zeros_f = jnp.zeros((B, T), jnp.float32)
    tokens = jnp.full((B, T), cfg.pad_id, jnp.int32).at[:, 0].set(tok)
    logps, ents, raws = zeros_f.at[:, 0].set(lp), zeros_f.at[:, 0].set(ent), zeros_f.at[:, 0].set(raw)
    mask = jnp.zeros((B, T), jnp.int32).at[:, 0].set(1)
    done = _is_stop(tok, cfg)
    if cfg.stop is not None:
        stop_state, hit = cfg.stop.advance(cfg.stop.start(B), tok)
        done = done | hit
    else:
        stop_state = jnp.zeros((B, 0), jnp.int32)
    state = (jnp.int32(1), tokens, logps, ents, mask, done, tok, raws, stop_state)

    # Step t (1 <= t < T) feeds token t - 1, writes completion slot t - 1 and samples token t.
    past = [((), ()) for _ in range(mcfg.num_layers)]
    start = 0  # completion slots in the finished segments
    for length in segment_lengths(T - 1, cfg.decode_segments):
        shape = (B, mcfg.num_kv_heads, length, mcfg.head_dim)
        cur = shd.constrain_cache([{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in past])

        def step(carry, start=start, past=past):
            (t, tokens, logps, ents, mask, done, prev, raws, stop_state), cur = carry
            kv = [DecodeKV(p["k"], p["v"], pk, pv, c["k"], c["v"]) for p, (pk, pv), c in zip(prefill, past, cur)]
            pos = (prompt_len_B + t - 1)[:, None]
            hidden, kv = model.forward(prev[:, None], pos, pmask, kv, t - 1 - start)
            tok, lp, ent, raw = sample_token(model.logits(hidden)[:, 0], jax.random.fold_in(key, t), cfg)
            live = ~done
            tok = jnp.where(live, tok, cfg.pad_id)
            upd = lambda buf, v: jax.lax.dynamic_update_slice(buf, v[:, None], (0, t))
            stop_now = _is_stop(tok, cfg)
            if cfg.stop is not None:
                stop_state, hit = cfg.stop.advance(stop_state, tok)
                stop_now = stop_now | (hit & live)
            state = (t + 1, upd(tokens, tok), upd(logps, jnp.where(live, lp, 0.0)),
                     upd(ents, jnp.where(live, ent, 0.0)), upd(mask, live.astype(jnp.int32)),
                     done | stop_now, tok, upd(raws, jnp.where(live, raw, 0.0)), stop_state)
            # Under a sharded step the carry keeps the cache's sharding (rows x kv heads); identity otherwise.
            return state, shd.constrain_cache([{"k": c.k, "v": c.v} for c in kv])

        def running(carry, stop=start + length):
            t, done = carry[0][0], carry[0][5]
            return (t < stop + 1) & ~jnp.all(done)

        state, cur = jax.lax.while_loop(running, step, (state, cur))
        past = [(pk + (c["k"],), pv + (c["v"],)) for (pk, pv), c in zip(past, cur)]
        start += length
    t, tokens, logps, ents, mask, done = state[:6]
    return SampleOutput(tokens, mask, logps, ents, t, state[7], done)


def make_generate_fn(graphdef: nnx.GraphDef, cfg: SamplingConfig, cache_dtype=None):
    """jit(state, prompt_BxP, prompt_mask_BxP, key) -> SampleOutput, compiled once per prompt shape."""
    @jax.jit
    def fn(state, prompt_BxP, prompt_mask_BxP, key):
        return generate(nnx.merge(graphdef, state), prompt_BxP, prompt_mask_BxP, key, cfg, cache_dtype)
    return fn


# ------------------------------------------------------------------------------------------ text
class Completion(NamedTuple):
    """One sampled completion (text without the prompt)."""
    text: str
    num_tokens: int  # real tokens, EOS included
    mean_entropy: float  # nats, mean over the completion's tokens (NaN when it has none)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists to a length rounded up to `multiple` (bounds recompilation)."""
    P = max(1, max(len(r) for r in rows))
    P = -(-P // multiple) * multiple
    toks = np.full((len(rows), P), pad_id, np.int32)
    mask = np.zeros((len(rows), P), np.int32)
    for i, r in enumerate(rows):
        if len(r):
            toks[i, P - len(r):] = r
            mask[i, P - len(r):] = 1
    return toks, mask


class TextSampler:
    """Strings in, completions out: the `Generator` that evaluation and the demo use.

    `generate(prompts, n, seed)` returns, for each prompt, n sampled `Completion`s. Rows are processed in
    batches of `batch_size` (a fixed shape, so one compilation serves all batches).
    """

    def __init__(self, model, tokenizer, cfg: SamplingConfig, batch_size: int = 64, chat_template: bool = False,
                 mesh=None):
        self.graphdef, self.state = nnx.split(model)
        self.tokenizer, self.cfg, self.batch_size = tokenizer, cfg, batch_size
        self.chat_template = chat_template
        if mesh is not None:
            mesh = shd.as_auto(mesh)
        self.mesh = mesh  # rows split over the mesh's batch axes (params keep the shardings they carry)
        if mesh is not None:
            shd.check_rows(batch_size, mesh, "eval.batch_size (sampler rows)")
        self._fn = make_generate_fn(self.graphdef, cfg)

    def _place(self, x: np.ndarray):
        if self.mesh is None:
            return x
        return jax.device_put(x, shd.batch_sharding(self.mesh, x.ndim))

    def encode(self, prompt: str) -> list[int]:
        if self.chat_template:  # render to text, then tokenize: special tokens in the text are matched
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=False)
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def generate(self, prompts: Sequence[str], n: int, seed: int) -> list[list[Completion]]:
        rows = [ids for ids in (self.encode(p) for p in prompts) for _ in range(n)]
        out: list[Completion] = []
        key = jax.random.key(seed)
        for b, start in enumerate(range(0, len(rows), self.batch_size)):
            chunk = rows[start:start + self.batch_size]
            filler = self.batch_size - len(chunk)
            toks, mask = left_pad(chunk + [chunk[-1]] * filler, self.cfg.pad_id)
            res = jax.device_get(self._fn(self.state, self._place(toks), self._place(mask),
                                          jax.random.fold_in(key, b)))
            for i in range(len(chunk)):
                m = res.mask_BxT[i].astype(bool)
                ids = res.tokens_BxT[i][m].tolist()
                ent = float(res.entropy_BxT[i][m].mean()) if m.any() else float("nan")
                out.append(Completion(self.tokenizer.decode(ids, skip_special_tokens=True), int(m.sum()), ent))
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]
