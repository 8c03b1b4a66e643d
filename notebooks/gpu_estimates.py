"""Arithmetic estimates of GPU memory and RL-step time for one-GPU runs (the Colab notebooks' tables).

Nothing here is measured on a GPU: memory is the sum of the buffers the fused RL step must hold at its
largest phase, counted from the shapes; time is FLOPs / (peak x efficiency) plus bytes / (bandwidth x
efficiency). Both are estimates for planning (expect +-30% on memory, a factor ~2 on time); the
compiled program's real peak can be read with `experiments/memory_plan.py`-style AOT compilation.

Dimension key: B rollout rows (prompts x G), b rows of one micro-batch, P prompt tokens, T completion
tokens, S = P + T, C log-prob chunk, D model, F MLP, L layers, H / K query / kv heads, Dh head dim,
V vocab, r LoRA rank.

Memory model (bytes). Parameters and LoRA state are held throughout; the phases run one after the other:

    weights   N * param_bytes                           (no reference copy under LoRA: zeroed adapters)
    lora      4 * N_lora * param_bytes                  (adapters, gradients, Adam m and v)
    rollout   KV cache 2 L B S K Dh c + prefill scores B H P^2 4 + last logits 2 B V 4
    reference max(one layer: B S (6D + 2K Dh + 3F) c + B H S^2 (4 + c),  logits: 3 B C V 4) + B S D c
    train     saved block inputs (remat=full: L b S D c; none: L b S per-layer activations)
              + max(one layer recomputed + its gradients: 2 x layer(b),  logits fwd + bwd: 5 b C V 4)

with c the compute bytes (2 for bfloat16). The attention scores are float32 (B H S^2 4), as in
`sage_jax.models.decoder`. Time model: decode is bandwidth-bound (weights in their storage dtype plus
the average KV cache read per token, plus a fixed per-layer launch cost), the reference and policy
passes are compute-bound (2 N tokens FLOPs forward, x3 for forward + remat recompute + backward of
the activations; LoRA adds no base-weight gradients).
"""

from __future__ import annotations

import dataclasses

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # usable device memory as Colab reports it
    bandwidth_gbs: float  # HBM / GDDR bandwidth, GB/s (spec sheet)
    matmul_tflops: float  # dense bf16 tensor-core peak; T4: fp32 FMA peak (no bf16 tensor cores)
    note: str = ""


# Spec-sheet numbers (NVIDIA data sheets); memory as reported on Colab runtimes.
GPUS = {
    "T4": GPU("T4", 15.0, 320.0, 8.1, "no bf16 tensor cores: bf16 matmuls run near the fp32 rate"),
    "L4": GPU("L4", 22.5, 300.0, 121.0),
    "A100-40GB": GPU("A100-40GB", 39.6, 1555.0, 312.0),
}
MATMUL_EFFICIENCY = 0.35  # fraction of peak FLOPs reached by the step's matmuls (typical for XLA:GPU)
BANDWIDTH_EFFICIENCY = 0.6  # fraction of peak bandwidth reached by the decode loop
LAUNCH_S_PER_LAYER = 25e-6  # fixed cost of one layer's kernels per decode step (launch / sync)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The decoder dimensions the estimates need (a ModelConfig subset)."""
    hidden: int  # D
    mlp: int  # F
    layers: int  # L
    heads: int  # H
    kv_heads: int  # K
    head_dim: int  # Dh
    vocab: int  # V
    tied: bool = True

    @classmethod
    def of(cls, model_cfg) -> "Shape":
        """From a `sage_jax.models.config.ModelConfig`."""
        m = model_cfg
        return cls(m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                   m.vocab_size, m.tie_word_embeddings)


# config.json values of the notebooks' models (so the tables need no download)
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": Shape(896, 4864, 24, 14, 2, 64, 151936, True),
    "Qwen/Qwen2.5-Math-1.5B": Shape(1536, 8960, 28, 12, 2, 128, 151936, True),
}


def param_count(s: Shape) -> int:
    qo, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_layer = 2 * s.hidden * qo + 2 * s.hidden * kv + (qo + 2 * kv) + 3 * s.hidden * s.mlp + 2 * s.hidden
    return s.vocab * s.hidden * (1 if s.tied else 2) + s.layers * per_layer + s.hidden


def lora_param_count(s: Shape, rank: int, targets=("q", "k", "v", "o", "gate", "up", "down")) -> int:
    if rank <= 0:
        return 0
    qo, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    dims = {"q": (s.hidden, qo), "k": (s.hidden, kv), "v": (s.hidden, kv), "o": (qo, s.hidden),
            "gate": (s.hidden, s.mlp), "up": (s.hidden, s.mlp), "down": (s.mlp, s.hidden)}
    return s.layers * sum(rank * (dims[t][0] + dims[t][1]) for t in targets)


@dataclasses.dataclass(frozen=True)
class Run:
    """The run shape the estimates depend on (see `Run.of_config`)."""
    rows: int  # B = prompts per step x group size
    prompt_tokens: int  # P (prompts are left padded to data.max_prompt_tokens)
    new_tokens: int  # T
    micro_rows: int  # b = B / (num_minibatches x grad_accum_steps)
    logp_chunk: int  # C
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    param_bytes: int = 4
    compute_bytes: int = 2
    remat: str = "full"
    beta: float = 0.05  # 0: no reference pass

    @classmethod
    def of_config(cls, c) -> "Run":
        """From an RL config (`sage_jax.defaults.default_config()` layout)."""
        rows = c.data.batch_size * c.rollout.group_size
        nbytes = {"float32": 4, "bfloat16": 2}
        targets = tuple(t.strip() for t in c.model.lora.targets.split(",") if t.strip())
        return cls(rows=rows, prompt_tokens=c.data.max_prompt_tokens, new_tokens=c.rollout.max_new_tokens,
                   micro_rows=max(1, rows // (c.rl.num_minibatches * c.rl.get("grad_accum_steps", 1))),
                   logp_chunk=min(c.rl.logp_chunk, c.rollout.max_new_tokens), lora_rank=c.model.lora.rank,
                   lora_targets=targets, param_bytes=nbytes[c.model.param_dtype],
                   compute_bytes=nbytes[c.model.dtype], remat=c.model.get("remat", "none"), beta=c.rl.beta)


def _layer_bytes(s: Shape, rows: int, seq: int, c: int) -> float:
    """One layer's activations for `rows` x `seq` tokens: projections, MLP, float32 scores + probs."""
    kv = s.kv_heads * s.head_dim
    per_token = c * (9 * s.hidden + 3 * kv + 4 * s.mlp)
    return rows * seq * per_token + rows * s.heads * seq * seq * (4 + c)


def memory(s: Shape, r: Run) -> dict[str, float]:
    """Per-phase memory in GiB and the `peak` (held state + the largest phase)."""
    S, P, c = r.prompt_tokens + r.new_tokens, r.prompt_tokens, r.compute_bytes
    n, n_lora = param_count(s), lora_param_count(s, r.lora_rank, r.lora_targets)
    weights = n * r.param_bytes
    if r.lora_rank:
        trainable = 4 * n_lora * r.param_bytes
    else:  # full fine-tuning: gradients, Adam m and v, and the reference copy when beta > 0
        trainable = n * r.param_bytes * (3 + (1 if r.beta > 0 else 0))
    kv = 2 * s.layers * r.rows * S * s.kv_heads * s.head_dim * c
    rollout = kv + r.rows * s.heads * P * P * 4 + 2 * r.rows * s.vocab * 4
    hidden = r.rows * S * s.hidden * c
    reference = 0.0
    if r.beta > 0:
        ref_layer = r.rows * S * (6 * s.hidden + 2 * s.kv_heads * s.head_dim + 3 * s.mlp) * c \
            + r.rows * s.heads * S * S * (4 + c)
        reference = max(ref_layer, 3 * r.rows * r.logp_chunk * s.vocab * 4) + hidden
    b = r.micro_rows
    layer = _layer_bytes(s, b, S, c)
    saved = s.layers * b * S * s.hidden * c if r.remat == "full" else s.layers * layer
    train = saved + max(2 * layer, 5 * b * r.logp_chunk * s.vocab * 4)
    phases = {"rollout": rollout, "reference": reference, "train": train}
    out = {"weights": weights, "trainable_state": trainable, **phases}
    out["peak"] = weights + trainable + max(phases.values())
    return {k: v / GIB for k, v in out.items()}


def step_seconds(s: Shape, r: Run, gpu: GPU) -> dict[str, float]:
    """Estimated seconds of one RL step on `gpu`: rollout (decode), reference pass, policy update."""
    S, P, T = r.prompt_tokens + r.new_tokens, r.prompt_tokens, r.new_tokens
    flops_rate = gpu.matmul_tflops * 1e12 * MATMUL_EFFICIENCY
    n_body = param_count(s) - s.vocab * s.hidden * (1 if s.tied else 2)
    kv_avg = 2 * s.layers * r.rows * (P + T / 2) * s.kv_heads * s.head_dim * r.compute_bytes
    per_token = ((param_count(s) * r.param_bytes + kv_avg) / (gpu.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)
                 + s.layers * LAUNCH_S_PER_LAYER)
    prefill = 2 * n_body * r.rows * P / flops_rate
    rollout = prefill + T * per_token
    fwd = (2 * n_body * r.rows * S + 4 * s.layers * r.rows * S * S * s.heads * s.head_dim
           + 2 * r.rows * T * s.hidden * s.vocab) / flops_rate
    reference = fwd if r.beta > 0 else 0.0
    train = fwd * (3 if r.remat == "full" else 2)
    return {"rollout": rollout, "reference": reference, "train": train, "step": rollout + reference + train}


def sample_seconds(s: Shape, rows: int, prompt_tokens: int, new_tokens: int, gpu: GPU,
                   param_bytes: int = 4, compute_bytes: int = 2) -> float:
    """Estimated seconds to sample `new_tokens` for `rows` rows in one batch (evaluation)."""
    kv_avg = 2 * s.layers * rows * (prompt_tokens + new_tokens / 2) * s.kv_heads * s.head_dim * compute_bytes
    per_token = ((param_count(s) * param_bytes + kv_avg) / (gpu.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)
                 + s.layers * LAUNCH_S_PER_LAYER)
    return new_tokens * per_token


def sample_memory_gib(s: Shape, rows: int, prompt_tokens: int, new_tokens: int, param_bytes: int = 4,
                      compute_bytes: int = 2) -> float:
    """Weights + KV cache + prefill scores of one sampler batch, GiB."""
    S = prompt_tokens + new_tokens
    kv = 2 * s.layers * rows * S * s.kv_heads * s.head_dim * compute_bytes
    return (param_count(s) * param_bytes + kv + rows * s.heads * prompt_tokens ** 2 * 4) / GIB


def describe(s: Shape, r: Run, gpu: GPU | None = None) -> str:
    """A short human-readable summary (printed by the notebooks for the chosen config)."""
    m = memory(s, r)
    lines = [f"params {param_count(s) / 1e6:.0f}M, LoRA params {lora_param_count(s, r.lora_rank, r.lora_targets) / 1e6:.1f}M",
             "memory (GiB, estimate): " + ", ".join(f"{k} {v:.2f}" for k, v in m.items())]
    for g in ([gpu] if gpu else GPUS.values()):
        t = step_seconds(s, r, g)
        fits = "fits" if m["peak"] <= 0.9 * g.memory_gib else "does NOT fit"
        lines.append(f"{g.name}: {fits} in {g.memory_gib:.1f} GiB; ~{t['step']:.0f} s per RL step (estimate: "
                     f"rollout {t['rollout']:.1f}, reference {t['reference']:.1f}, update {t['train']:.1f})")
    return "\n".join(lines)


def shape_of_path(path: str) -> Shape:
    """The Shape of an HF directory or hub id (reads only its config.json; KNOWN_SHAPES first)."""
    if path in KNOWN_SHAPES:
        return KNOWN_SHAPES[path]
    from sage_jax.models import hf
    from sage_jax.models.config import ModelConfig
    return Shape.of(ModelConfig.from_hf_dir(hf.resolve_path(path))[0])


def gpu_of(device_kind: str) -> GPU | None:
    """The GPUS entry whose name appears in a JAX `device_kind` (e.g. 'NVIDIA L4'), else None."""
    kind = device_kind.upper()
    for name, g in GPUS.items():
        if name.split("-")[0] in kind:
            return g
    return None
