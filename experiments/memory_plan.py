"""Memory plan: per-device memory of the fused RL step for Qwen2.5-Math-1.5B / -7B, compiled ahead of time.

    python experiments/memory_plan.py --check-layers 28     # fake CPU devices: ~25 min on 2 busy cores
    pip install --target /tmp/libtpu "libtpu==0.0.42.*"     # the libtpu jax[tpu]==0.10.2 pins
    PYTHONPATH=/tmp/libtpu python experiments/memory_plan.py --backend tpu --layers 1,2 --only 0,1 \
        --out experiments/memory_plan_tpu.md                # libtpu's compiler, no TPU: ~6 min per compile
    PYTHONPATH=/tmp/libtpu python experiments/memory_plan.py --set long --backend tpu   # the paper-scale rows
    python experiments/memory_plan.py --from-json experiments/memory_plan.json   # re-render a table

Nothing is allocated: the train state and batch are `jax.ShapeDtypeStruct`s carrying their shardings,
and `jax.jit(rl_step).lower(...).compile().memory_analysis()` reports the per-device buffers of the
partitioned program. `--backend cpu` compiles for meshes of 4 / 8 / 32 fake CPU devices (one
subprocess per count, XLA_FLAGS=--xla_force_host_platform_device_count=N set before JAX starts);
`--backend tpu` compiles with libtpu's XLA:TPU for deviceless v5p topologies (2x2x1 = v5p-8,
2x2x2 = v5p-16, 2x4x4 = v5p-64), which is the real target compiler.

Per device: state = arguments (params, reference copy, Adam moments, all bf16 as loaded) and
peak = arguments + outputs - donated aliases + temporaries (activations saved for the backward, the
rollout's KV cache, logits chunks, gathered FSDP weights). The step includes sampling (prefill +
while-loop decode), the reference pass and the update.

Layers: the decoder unrolls its layers, and compiling 28 of them x (prefill, decode body, reference,
policy forward and backward) is slow, so each point is compiled at two small L and extrapolated
linearly to the real 28: every per-layer buffer (weights, moments, KV cache, saved activations)
scales with L, the rest (embedding / head, logits chunks, batch) does not:
mem(28) = mem(L2) + (28 - L2) (mem(L2) - mem(L1)) / (L2 - L1). `--check-layers 28` compiles the
first point at its full 28 layers and reports the extrapolation error (CPU, 1.5B on 4 devices: 0.1%).
Where the small-L compiles peak in another phase (the reference pass over all rows) than the 28-layer
program will (the policy backward), the extrapolation undershoots; such rows report the backward's
float32 softmax floor instead, marked `*` (`attention_floor`).

`--set long` (memory_plan_long.md) holds the paper-scale rows: the official LoRA recipe on one 80 GB GPU,
7B full fine-tuning at 512 x 3072 on 32 chips, 1.5B on 8; with block remat, the reference pass in row
chunks and attention in query chunks. Compile those with `--backend tpu`: XLA:CPU does not keep block
remat's memory saving (its schedule recomputes every layer's forward ahead of the backward). Measured on a
tiny model (h256, T=512, 4 rows), the forward + backward temporaries per layer are:

| compiler | remat none | remat full |
|---|---|---|
| XLA:CPU | 104 MiB | 96 MiB |
| libtpu | 42 MiB | 3.3 MiB |

So CPU rows with remat overstate memory by the saved activations of every layer.

Caveats: XLA:CPU computes bf16 matmuls in float32 and fuses less, so the CPU numbers overstate the
TPU / GPU temporaries by ~2-3x (see the TPU cross-check); read them as an upper bound. XLA:GPU (H100)
cannot be targeted without a GPU. The points are compiled with `remat="none"` (the table predates the
decoder's `model.remat` policies; only the log-prob chunks are checkpointed), so the lever for
activations here is `rl.num_minibatches` (M); "full" remat would lower the saved activations further. The reference pass is not split into minibatches, so at long T its
attention scores (rows x heads x S^2, float32, one layer at a time) set a floor that M does not lower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 1024 ** 3

MODELS = {  # Qwen2.5-Math config.json values
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                 vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
               vocab_size=152064, tie_word_embeddings=False),
}

# (model, devices, (data, fsdp, tensor), rows B, minibatches M, completion T); prompt P = 512, G = 8.
# 4 devices = a v5p-8 (4 chips, 95 GB HBM each); 8 = an 8xH100 node (80 GB); 32 = v5p-64 / 4 H100 nodes.
POINTS = [
    ("1.5B", 4, (1, 4, 1), 64, 4, 1024),
    ("7B", 4, (1, 4, 1), 64, 8, 1024),
    ("7B", 4, (1, 2, 2), 64, 8, 1024),
    ("1.5B", 8, (1, 8, 1), 64, 1, 1024),
    ("1.5B", 8, (1, 8, 1), 64, 4, 1024),
    ("1.5B", 8, (1, 4, 2), 64, 1, 1024),
    ("1.5B", 8, (1, 8, 1), 64, 4, 3072),
    ("7B", 8, (1, 8, 1), 64, 4, 1024),
    ("7B", 8, (1, 4, 2), 64, 4, 1024),
    ("7B", 8, (1, 2, 4), 64, 4, 1024),
    ("7B", 8, (1, 8, 1), 64, 8, 3072),
    ("7B", 32, (1, 32, 1), 512, 16, 3072),
    ("7B", 32, (1, 8, 4), 512, 16, 3072),
    ("7B", 32, (4, 8, 1), 512, 16, 3072),
]
PROMPT_LEN, GROUP = 512, 8

# The long-sequence points (`--set long`, written to memory_plan_long.md): a 7th element of options over the
# defaults above: prompt P, group G, LoRA rank, block remat, the reference pass in row chunks
# (rl.score_chunks) and attention in query chunks (model.attention_chunk). With remat "full" every block's
# scores are recomputed in the backward, so the float32 softmax floor of the table above does not apply.
OFFICIAL = dict(prompt=2048, group=8, lora=8, remat="full", score_chunks=2)  # configs/sage_official.py
LONG_POINTS = [
    # the official LoRA recipe on one 80 GB GPU: 2 prompts x 8 completions of 6144 tokens, 2 updates of 8 rows
    ("7B", 1, (1, 1, 1), 16, 2, 6144, OFFICIAL),
    ("7B", 1, (1, 1, 1), 16, 2, 6144, dict(OFFICIAL, attn_chunk=512)),
    # 7B full fine-tuning at 512 rows x 3072 on 32 chips, 16 updates per rollout
    ("7B", 32, (1, 32, 1), 512, 16, 3072, dict(remat="full", score_chunks=8)),
    ("7B", 32, (1, 32, 1), 512, 16, 3072, dict(remat="full", score_chunks=8, attn_chunk=512)),
    # 1.5B on 8 chips at the same completion length
    ("1.5B", 8, (1, 8, 1), 64, 4, 3072, dict(remat="full", score_chunks=2, attn_chunk=512)),
]


# ------------------------------------------------------------------------------------------ worker
TPU_TOPOLOGIES = {1: "v5p:2x2x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2", 32: "v5p:2x4x4"}  # v5p-8 (one chip of it), v5p-16, v5p-64


def target_devices(backend: str, n: int):
    import jax
    if backend == "cpu":
        assert jax.device_count() == n, jax.devices()
        return jax.devices()
    from jax.experimental import topologies  # deviceless AOT: libtpu's compiler, no TPU attached
    return topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[n], platform="tpu").devices[:n]


def compile_point(model: str, layers: int, mesh_shape, rows: int, minibatches: int, T: int, opts=None,
                  devices=None) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sage_jax import sharding as shd
    from sage_jax.models import lora as lora_lib
    from sage_jax.models.config import ModelConfig
    from sage_jax.models.decoder import Decoder
    from sage_jax.policy import optim, state as train_state
    from sage_jax.rl import losses, step as R
    from sage_jax.sampling import SamplingConfig

    o = {**dict(prompt=PROMPT_LEN, group=GROUP, lora=0, remat="none", score_chunks=1, attn_chunk=0), **(opts or {})}

    spec = MODELS[model]
    mcfg = ModelConfig(model_type="qwen2", head_dim=spec["hidden_size"] // spec["num_heads"], qkv_bias=True,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=o["prompt"] + T,
                       eos_token_ids=(151643,), pad_token_id=151643,
                       **{**spec, "num_layers": layers})
    G = o["group"]
    cfg = R.RLConfig(group_size=G, sampling=SamplingConfig(max_new_tokens=T, eos_ids=(151643, 151645),
                                                             pad_id=151643),
                     loss=losses.LossConfig(beta=0.05), guide="branch", num_minibatches=minibatches,
                     logp_chunk=512, score_chunks=o["score_chunks"], remat=o["remat"])  # as train.py sets it
    tx, lr_fn = optim.make_optimizer(optim.OptimConfig(learning_rate=5e-6))
    mesh = shd.make_mesh(mesh_shape, devices)

    def make_model():
        m = Decoder(mcfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                    attention_chunk=o["attn_chunk"])
        if o["lora"]:  # the official adapters: fp32 on a bf16 base, all seven projections
            lora_lib.add_lora(m, lora_lib.LoRAConfig(rank=o["lora"], alpha=2.0 * o["lora"]), seed=0,
                              param_dtype=jnp.float32)
        return m
    graphdef = lora_lib.split_trainable(nnx.eval_shape(make_model))[0]  # = nnx.graphdef(...) without LoRA
    abstract = jax.eval_shape(lambda: train_state.init_train_state(make_model(), cfg, tx, 0)[1])
    place = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    state = jax.tree.map(place, abstract, shd.state_shardings(abstract, mesh))
    N = rows // G
    raw = {"prompt": jax.ShapeDtypeStruct((N, o["prompt"]), jnp.int32),
           "prompt_mask": jax.ShapeDtypeStruct((N, o["prompt"]), jnp.int32),
           "answer": jax.ShapeDtypeStruct((N, 64), jnp.int32)}
    batch = jax.tree.map(place, raw, shd.batch_shardings(raw, mesh))

    class NoReward:  # never called: the program is compiled, not run
        def __call__(self, *a):
            raise RuntimeError("memory plan does not run the step")

    fn = lambda s, b: R.rl_step(s, b, graphdef=graphdef, cfg=cfg, tx=tx, lr_fn=lr_fn, reward_host=NoReward(),
                                mesh=mesh)
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=0).lower(state, batch).compile()
    ma = compiled.memory_analysis()
    return {"arg": ma.argument_size_in_bytes, "out": ma.output_size_in_bytes, "alias": ma.alias_size_in_bytes,
            "temp": ma.temp_size_in_bytes, "compile_s": time.perf_counter() - t0}


def worker(devices: int, points: list, layers: list[int], backend: str) -> None:
    devs = target_devices(backend, devices)
    for p in points:
        for L in layers:
            rec = compile_point(p[0], L, tuple(p[2]), p[3], p[4], p[5], p[6] if len(p) > 6 else None, devs)
            print(json.dumps({"point": p, "layers": L, **rec}), flush=True)


# ------------------------------------------------------------------------------------------ driver
def run_worker(devices: int, points: list, layers: list[int], backend: str) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if backend == "tpu":  # libtpu without a TPU: skip the metadata server and the worker discovery
        env.update(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE="v5p-8", TPU_WORKER_HOSTNAMES="localhost")
    cmd = [sys.executable, __file__, "--worker", str(devices), "--points", json.dumps(points),
           "--layers", ",".join(map(str, layers)), "--backend", backend]
    out = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            rec = json.loads(line)
            print(f"  {rec['point']} L={rec['layers']}: temp {rec['temp'] / GIB:.2f} GiB, "
                  f"args {rec['arg'] / GIB:.2f} GiB, compiled in {rec['compile_s']:.0f} s", flush=True)
            out.append(rec)
    if proc.returncode:
        raise SystemExit(f"worker for {devices} devices failed ({proc.returncode})")
    return out


def _norm(p) -> list:
    return json.loads(json.dumps(p))


def attention_floor(model: str, mesh, rows: int, minibatches: int, T: int, L: int = 28) -> float:
    """Bytes the policy backward must keep for the softmax of every layer: rows per device per update
    x local heads x S^2 x 4 (float32). A peak extrapolated from small L can sit below it when another
    phase (the reference pass over all rows) sets the peak at small L; then the floor is the better bound."""
    data, fsdp, tensor = mesh
    S = PROMPT_LEN + T
    local_rows = max(rows // minibatches // (data * fsdp), 1)
    heads = MODELS[model]["num_heads"] // (tensor if MODELS[model]["num_heads"] % tensor == 0 else 1)
    return L * local_rows * heads * S * S * 4


def extrapolate(recs: list[dict], L: int = 28) -> dict:
    by = {r["layers"]: r for r in recs}
    lo, hi = sorted(by)[:2]
    peak = lambda r: r["arg"] + r["out"] - r["alias"] + r["temp"]
    lin = lambda f: f(by[hi]) + (L - hi) * (f(by[hi]) - f(by[lo])) / (hi - lo)
    return {"state": lin(lambda r: r["arg"]), "temp": lin(lambda r: r["temp"]), "peak": lin(peak)}


# Usable memory per device: H100 80 GB as nvidia-smi reports it (81559 MiB); v5p 95 GB taken as 95e9 bytes.
HBM_GIB = {"H100": 81559 / 1024, "v5p": 95e9 / GIB}
HEADROOM = 0.9  # keep 10% for the runtime, fragmentation and the CPU compiler's differences from TPU / GPU
TARGETS = ((1, "H100", "one H100"), (4, "v5p", "v5p-8 (4 chips)"), (8, "H100", "an 8xH100 node"), (8, "v5p", "v5p-16 (8 chips)"),
           (32, "v5p", "v5p-64 (32 chips)"))


def fits(peak_bytes: float, kind: str) -> bool:
    return peak_bytes / GIB <= HEADROOM * HBM_GIB[kind]


def best_layout(rows: list[dict], devices: int, kind: str):
    """Among the points that fit, the one with the fewest minibatches (largest update), then least memory."""
    ok = [r for r in rows if r["devices"] == devices and fits(r["peak"], kind)]
    return min(ok, key=lambda r: (r["M"], r["peak"])) if ok else None


def setup_text(opts: dict | None) -> str:
    """A point's options in words (the table's setup column)."""
    o = opts or {}
    parts = [f"P={o.get('prompt', PROMPT_LEN)}", f"remat {o.get('remat', 'none')}"]
    parts += [f"LoRA r={o['lora']}"] if o.get("lora") else []
    parts += [f"score_chunks={o['score_chunks']}"] if o.get("score_chunks", 1) > 1 else []
    parts += [f"attention_chunk={o['attn_chunk']}"] if o.get("attn_chunk") else []
    return ", ".join(parts)


def table(rows: list[dict]) -> str:
    head = ("| model | devices | mesh (data, fsdp, tensor) | rows B | M | T | setup | state GiB/dev | "
            "temp GiB/dev | peak GiB/dev | fits H100 80 GB | fits v5p 95 GB |\n|" + "---|" * 12 + "\n")
    body = ""
    for r in rows:
        yn = lambda kind: "yes" if fits(r["peak"], kind) else "no"
        star = "*" if r.get("floored") else ""
        body += (f"| {r['model']} | {r['devices']} | {tuple(r['mesh'])} | {r['B']} | {r['M']} | {r['T']} | "
                 f"{setup_text(r.get('opts'))} | "
                 f"{r['state'] / GIB:.1f} | {r['temp'] / GIB:.1f}{star} | {r['peak'] / GIB:.1f}{star} | {yn('H100')} | "
                 f"{yn('v5p')} |\n")
    return head + body


LORA_RANK = 8  # the reference SAGE implementation's default, on all seven projections


def lora_state_section(rows: list[dict]) -> str:
    """Held state per device, full fine-tuning vs LoRA, from `gpu_estimates`' parameter counts
    (which tests/test_lora.py checks against the bytes of a real train state). The full-FT column is
    set beside the compiled 'state' of the table above: their agreement checks the counts at 7B scale."""
    sys.path.insert(0, ROOT)  # the estimates live beside the notebooks, which use them too
    from notebooks import gpu_estimates as ge

    head = (f"| model | devices | mesh | full FT state GiB/dev (compiled) | full FT (counted) | "
            f"LoRA r={LORA_RANK} state GiB/dev (counted) | LoRA trainable params |\n|" + "---|" * 7 + "\n")
    body, seen = "", set()
    for r in rows:
        key = (r["model"], r["devices"], tuple(r["mesh"]))
        if (r.get("opts") or {}).get("lora") or key in seen:  # (a LoRA row's compiled state is not full FT's)
            continue
        seen.add(key)
        m = MODELS[r["model"]]
        shape = ge.Shape(m["hidden_size"], m["intermediate_size"], m["num_layers"], m["num_heads"],
                         m["num_kv_heads"], 128, m["vocab_size"], m["tie_word_embeddings"])
        n, n_lora = ge.param_count(shape), ge.lora_param_count(shape, LORA_RANK)
        shards = r["mesh"][1] * r["mesh"][2]  # params shard over fsdp x tensor and replicate over data
        full = 2 * n * 4 / shards  # bf16: params, reference, Adam m and v
        lora = 2 * (n + 3 * n_lora) / shards  # bf16: frozen base (= the reference), adapters, m and v
        body += (f"| {key[0]} | {key[1]} | {key[2]} | {r['state'] / GIB:.2f} | {full / GIB:.2f} | {lora / GIB:.2f} | "
                 f"{n_lora / 1e6:.1f} M ({n_lora / n:.2%}) |\n")
    return ("\nHeld state (params, reference, optimizer moments) per device, full fine-tuning vs LoRA "
            f"(rank {LORA_RANK} on q, k, v, o, gate, up, down; the reference is the base with the adapters "
            "off, so no copy). Counted = `gpu_estimates` parameter counts x bf16 bytes / (fsdp x "
            "tensor); LoRA's temporaries (activations, KV cache) are those of the table above minus the "
            "full-size gradient.\n\n" + head + body)


def render(recs: list[dict], points: list, layers: list[int], backend: str, check: dict | None = None) -> tuple[str, list]:
    rows = []
    for p in points:
        mine = [r for r in recs if r["point"] == _norm(p) and r["layers"] in layers]
        if len({r["layers"] for r in mine}) >= 2:
            e = extrapolate(mine)
            opts = p[6] if len(p) > 6 else None
            floor = e["state"] + attention_floor(p[0], p[2], p[3], p[4], p[5])
            # (with block remat the backward recomputes each layer's scores: no 28-layer softmax floor)
            if (opts or {}).get("remat", "none") == "none" and floor > e["peak"]:
                e.update(peak=floor, temp=floor - e["state"], floored=True)  # small-L compiles peaked elsewhere
            rows.append({"model": p[0], "devices": p[1], "mesh": p[2], "B": p[3], "M": p[4], "T": p[5], "opts": opts,
                         **e})
    notes = []
    for devices, kind, name in TARGETS:
        for model in ("1.5B", "7B"):
            b = best_layout([r for r in rows if r["model"] == model], devices, kind)
            if b:
                notes.append(f"- best {model} layout on {name}: mesh {tuple(b['mesh'])}, M={b['M']} "
                             f"({b['B']} rows, T={b['T']}; peak {b['peak'] / GIB:.1f} GiB/device)")
            elif any(r["model"] == model and r["devices"] == devices for r in rows):
                notes.append(f"- {model} on {name}: none of the planned points fits; raise M or shard further")
    if check:
        p = check["point"]
        e = extrapolate([r for r in recs if r["point"] == p and r["layers"] in layers], L=check["layers"])
        peak = check["arg"] + check["out"] - check["alias"] + check["temp"]
        notes.append(f"- extrapolation check, {p[0]} on {p[1]} devices {tuple(p[2])}: L={check['layers']} compiled "
                     f"directly needs {peak / GIB:.2f} GiB/device, the L={layers} extrapolation says "
                     f"{e['peak'] / GIB:.2f} GiB ({100 * (e['peak'] / peak - 1):+.1f}%)")
    text = (f"Per-device memory of the fused RL step, compiled for {backend} ({'fake CPU devices' if backend == 'cpu' else 'deviceless TPU v5p topologies'}): "
            f"P={PROMPT_LEN} prompt tokens unless the setup column says otherwise, G={GROUP}, bf16 params, bf16 Adam "
            f"moments (optax follows the param dtype), beta > 0 so a reference copy is held (under LoRA the "
            f"reference is the base with the adapters off: no copy; fp32 adapters and moments); extrapolated to "
            f"28 layers from L={layers}. "
            f"'state' = params + reference + Adam moments; 'peak' = state + temporaries (donated outputs alias "
            f"the state). Fits = peak <= {HEADROOM:.0%} of the device memory. * = the extrapolation fell below "
            f"the policy backward's float32 softmax floor (28 layers x rows per device per update x local heads x "
            f"S^2 x 4 bytes), which is reported instead.\n\n" + table(rows) + "\n"
            + "\n".join(notes) + "\n" + lora_state_section(rows))
    return text, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--points", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="cpu", choices=("cpu", "tpu"),
                    help="cpu: fake CPU devices; tpu: libtpu's compiler on a deviceless v5p topology "
                         "(needs `pip install libtpu`, and ~5 min of compile per point on 2 cores)")
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--only", default="", help="comma-separated indices into the set's points (default: all)")
    ap.add_argument("--set", default="short", choices=("short", "long"),
                    help="short: POINTS (P=512, no remat); long: LONG_POINTS (the official LoRA recipe, 512 x 3072 "
                         "on 32 chips, 1.5B on 8; remat, row and query chunks), written to memory_plan_long.md")
    ap.add_argument("--out", default="")
    ap.add_argument("--check-layers", type=int, default=0,
                    help="also compile the first point at this many layers to check the extrapolation")
    ap.add_argument("--from-json", default="", help="re-render the table from a previous run's .json")
    a = ap.parse_args()
    a.out = a.out or os.path.join(HERE, "memory_plan.md" if a.set == "short" else "memory_plan_long.md")
    all_points = POINTS if a.set == "short" else LONG_POINTS
    layers = [int(x) for x in a.layers.split(",")]
    if a.worker:
        return worker(a.worker, json.loads(a.points), layers, a.backend)
    points = [all_points[int(i)] for i in a.only.split(",")] if a.only else all_points
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        recs, check, backend = saved["records"], saved.get("check"), saved.get("backend", "cpu")
    else:
        recs, check, backend = [], None, a.backend
        for devices in sorted({p[1] for p in points}):
            mine = [p for p in points if p[1] == devices]
            print(f"{devices} devices: {len(mine)} points x L={layers}", flush=True)
            recs += run_worker(devices, mine, layers, backend)
        if a.check_layers:
            check = run_worker(points[0][1], [points[0]], [a.check_layers], backend)[0]
    text, rows = render(recs, points, layers, backend, check)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"backend": backend, "records": recs, "check": check, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
