"""The RL-step benchmark's shared setup (bench.py, varlen.py, profile_train.py, profile_decode.py): the model shapes,
their random checkpoints, the batches, the step's config, one `Setup` per side of a comparison, and its timing
with a count of backend compiles.

Dimension key: N prompts, G group size, B = N * G rows, P prompt length, T completion length.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from experiments.bench.reward import count_ones  # noqa: E402

from sage_jax.models import hf  # noqa: E402
from sage_jax.models.decoder import Decoder  # noqa: E402
from sage_jax.models.tiny import char_tokenizer, tiny_config  # noqa: E402
from sage_jax.policy import optim, state as train_state  # noqa: E402
from sage_jax.rewards.host import HostReward, encode_answers  # noqa: E402
from sage_jax.rl import losses, step as R  # noqa: E402
from sage_jax.sampling import SamplingConfig, left_pad  # noqa: E402

SHAPES = {  # the two shapes; heads of 32 (tiny) / 64 (small) dims, 2 kv heads
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, prompts=8, group=8, T=64),
    "small": dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536, prompts=8, group=8, T=128),
    # Accelerator-sized: Qwen2.5-0.5B's width, MLP and head layout at half its depth (not a default shape).
    "medium": dict(hidden_size=896, num_layers=12, num_heads=14, intermediate_size=4864, prompts=8, group=8, T=256),
}
LR, BETA, P_LEN = 1e-6, 0.04, 16

# ------------------------------------------------------------------------------------------ compile counter
_COMPILES = [0]


def _on_event(name, *a, **k):
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


# ------------------------------------------------------------------------------------------ setup
def prompts(n: int) -> list[str]:
    """n distinct 16-character prompts without spaces (one token per character, no padding)."""
    out = [f"Q{i}:{i * 137 % 1000:03d}+{i * 71 % 1000:03d}=" for i in range(n)]
    return [p + "?" * (P_LEN - len(p)) for p in out]


def model_config(shape):
    s = SHAPES[shape]
    return tiny_config(hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
                       num_kv_heads=2, intermediate_size=s["intermediate_size"])


def save_random(mcfg, out: str) -> str:
    """A random-init (seed 0) model of `mcfg` with the char tokenizer in HF format at `out`, once."""
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        hf.save(Decoder(mcfg, rngs=nnx.Rngs(0)), mcfg, out, tokenizer=char_tokenizer())
    return out


def write_checkpoint(shape: str, workdir: str) -> str:
    return save_random(model_config(shape), os.path.join(workdir, f"ckpt_{shape}"))


def make_batch(tok, n):
    ids = np.asarray([tok(p, add_special_tokens=False)["input_ids"] for p in prompts(n)], np.int32)
    assert ids.shape == (n, P_LEN), ids.shape
    return dict(prompt=jnp.asarray(ids), prompt_mask=jnp.ones_like(jnp.asarray(ids)),
                answer=jnp.asarray(encode_answers(tok, ["0"] * n, 4)))


def padded_batch(tok, texts):
    """Prompts of varied length, left-padded to the longest (as TRL's tokenizer call pads them)."""
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in texts]
    assert all(len(r) == len(t) for r, t in zip(rows, texts)), "one token per character"
    ids, mask = left_pad(rows, tok.pad_token_id, multiple=1)
    return dict(prompt=jnp.asarray(ids), prompt_mask=jnp.asarray(mask),
                answer=jnp.asarray(encode_answers(tok, ["0"] * len(texts), 4)))


DECODE_SEGMENTS = SamplingConfig.decode_segments  # the sampler's default; --decode-segments sets it for the run


def rl_config(T, G, guide, share_prompt=True, stop=None, minibatches=1, **real):
    """The bench's step: no stop id (completions run to T, or to `stop`'s forced lengths on the varlen workload)."""
    sampling = SamplingConfig(max_new_tokens=T, temperature=1.0, eos_ids=(), pad_id=0, stop=stop,
                              decode_segments=DECODE_SEGMENTS)
    return R.RLConfig(group_size=G, sampling=sampling,
                      loss=losses.LossConfig(beta=BETA, loss_type="grpo"), guide=guide, scale_rewards="group",
                      share_prompt=share_prompt, num_minibatches=minibatches, **real)


def optimizer():
    # TRL's defaults: AdamW (0.9, 0.999, 1e-8), weight decay 0, grad clip 1.0, constant lr.
    return optim.make_optimizer(optim.OptimConfig(learning_rate=LR, weight_decay=0.0, grad_clip_norm=1.0))


class Setup:
    """One side of a comparison: the model from `ckpt`, the fused step and its batch. The uniform workload's
    batch is `n_prompts` of the 16-token prompts; `texts` (the varlen workload) gives prompts left-padded to the
    longest, and `stop` / `minibatches` / `real` its forced lengths, updates per rollout and real-token setting
    (rl.length_buckets or rl.pack_buckets)."""

    def __init__(self, ckpt, T, G, guide, n_prompts, dtype="float32", share_prompt=True, texts=None, stop=None,
                 minibatches=1, **real):
        self.tok = char_tokenizer()
        # Parameters stay float32 (the optimizer's master copy); `dtype` is the compute dtype, like torch AMP.
        model, self.mcfg = hf.load(ckpt, dtype=jnp.dtype(dtype), param_dtype=jnp.float32)
        self.cfg = rl_config(T, G, guide, share_prompt, stop, minibatches, **real)
        self.tx, self.lr_fn = optimizer()
        self.host = HostReward(self.tok, count_ones)
        self.graphdef, self.state = train_state.init_train_state(model, self.cfg, self.tx, seed=0)
        self.batch = make_batch(self.tok, n_prompts) if texts is None else padded_batch(self.tok, texts)
        self.step_fn = R.make_rl_step(self.graphdef, self.cfg, self.tx, self.lr_fn, self.host)
        self.T, self.G, self.N = T, G, n_prompts
        # the rollout's completion tokens: every row at T, or the forced lengths
        self.expected_tokens = n_prompts * G * T if stop is None else sum(stop.lengths)


def timed_step(s: Setup) -> float:
    """Seconds of one fused step (blocked until done); then checks the rollout's completion tokens."""
    t0 = time.perf_counter()
    s.state, m = s.step_fn(s.state, s.batch)
    jax.block_until_ready((s.state, m))
    dt = time.perf_counter() - t0
    tokens = int(jax.device_get(m["rollout/tokens"]))
    assert tokens == s.expected_tokens, (tokens, s.expected_tokens, "completions were not of the forced lengths")
    return dt


def time_fused(s: Setup, warmup: int, steps: int):
    """Median wall time of the fused step after `warmup` steps, and the compiles during the timed steps."""
    times, compiles_before = [], None
    for i in range(warmup + steps):
        if i == 1:
            compiles_before = _COMPILES[0]
        times.append(timed_step(s))
    return dict(step_s=times, median_step_s=statistics.median(times[warmup:]), first_step_s=times[0],
                compiles_after_first_step=_COMPILES[0] - compiles_before, completion_tokens=s.expected_tokens,
                jit_cache_size=s.step_fn._cache_size(), device_peak_bytes=device_peak_bytes())


def device_peak_bytes():
    """The accelerator allocator's peak since the process started (None on CPU, which keeps no stats)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")
