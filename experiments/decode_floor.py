"""Decode: one token step of the sampler against the memory-bandwidth floor, for Qwen2.5-Math-1.5B / -7B.

    PYTHONPATH=/tmp/libtpu python experiments/decode_floor.py           # libtpu's compiler (see memory_plan.py)
    python experiments/decode_floor.py --backend cpu                    # XLA:CPU's counts instead

A decode step of `sampling.generate` (`Decoder.forward` on one token per row over a `DecodeKV`, the LM head,
greedy choice) is compiled for one device, bf16, at the last step of a P = 512 + T = 3072 rollout with 4
cache segments (it reads the prompt once per group of G = 8, three finished segments and the current one).
Its `cost_analysis()` gives the bytes the program moves and its FLOPs; the floor of a step is
max(bytes / HBM bandwidth, FLOPs / peak bf16 matmul rate). Beside it, the analytic bytes: the weights
(read once per step, whatever the rows) plus the KV cache the step reads.

No device was lent to this project's sessions, so no decode time of these shapes is measured here: the
table is what a GPU / TPU run of `experiments/bench/h200.sh` should be compared with (ms per step of the
rollout = rollout seconds / T).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the repo root: studies import each other as experiments.<study>

from experiments.memory_plan import MODELS  # noqa: E402

P, T, G, SEGMENTS = 512, 3072, 8, 4
# bytes/s and bf16 FLOP/s (dense) per chip, from the vendors' data sheets
CHIPS = {"H100 SXM": (3.35e12, 989e12), "H200": (4.8e12, 989e12), "TPU v5p": (2.765e12, 459e12)}


def compile_step(model: str, rows: int, backend: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from sage_jax.models.config import ModelConfig
    from sage_jax.models.decoder import Decoder, DecodeKV
    from sage_jax.sampling import segment_lengths

    spec = MODELS[model]
    mcfg = ModelConfig(model_type="qwen2", head_dim=spec["hidden_size"] // spec["num_heads"], qkv_bias=True,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=P + T,
                       eos_token_ids=(151643,), pad_token_id=151643, **spec)
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: Decoder(mcfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    if backend == "tpu":
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        dev = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices[:1]
        sh = NamedSharding(Mesh(np.array(dev), ("x",)), PartitionSpec())
    else:
        sh = None
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    params = jax.tree.map(lambda a: S(a.shape, a.dtype), params)
    N, K, Dh = rows // G, mcfg.num_kv_heads, mcfg.head_dim
    segs = segment_lengths(T - 1, SEGMENTS)
    kv = [DecodeKV(S((N, K, P, Dh), jnp.bfloat16), S((N, K, P, Dh), jnp.bfloat16),
                   tuple(S((rows, K, n, Dh), jnp.bfloat16) for n in segs[:-1]),
                   tuple(S((rows, K, n, Dh), jnp.bfloat16) for n in segs[:-1]),
                   S((rows, K, segs[-1], Dh), jnp.bfloat16), S((rows, K, segs[-1], Dh), jnp.bfloat16))
          for _ in range(mcfg.num_layers)]

    def step(params, prev_B, pos_Bx1, pmask_NxP, kv):
        model = nnx.merge(graphdef, params)
        hidden, kv = model.forward(prev_B[:, None], pos_Bx1, pmask_NxP, kv, segs[-1] - 1)
        return jnp.argmax(model.logits(hidden)[:, 0], axis=-1), [(c.k, c.v) for c in kv]

    args = (params, S((rows,), jnp.int32), S((rows, 1), jnp.int32), S((N, P), jnp.int32), kv)
    compiled = jax.jit(step, donate_argnums=4).lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    kv_read = 2 * mcfg.num_layers * K * Dh * 2 * (N * P + rows * (T - 1))  # k and v, bf16, every slot read
    return {"model": model, "rows": rows, "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "flops": float(ca.get("flops", 0.0)), "weight_bytes": 2 * n_params, "kv_read_bytes": kv_read}


def render(recs: list[dict], backend: str) -> str:
    names = list(CHIPS)
    head = ("| model | rows | weights + KV read, analytic (GB) | compiled bytes / step (GB) | compiled / analytic | "
            "GFLOP / step | " + " | ".join(f"floor ms/step {c} (analytic)" for c in names) + " |\n|"
            + "---|" * (6 + len(names)) + "\n")
    body = ""
    for r in recs:
        analytic = r["weight_bytes"] + r["kv_read_bytes"]
        floor = lambda b, bw, fl: max(b / bw, r["flops"] / fl) * 1e3
        cells = [f"{floor(r['bytes_accessed'], bw, fl):.1f} ({floor(analytic, bw, fl):.1f})" for bw, fl in CHIPS.values()]
        body += (f"| {r['model']} | {r['rows']} | {analytic / 1e9:.1f} | {r['bytes_accessed'] / 1e9:.1f} | "
                 f"{r['bytes_accessed'] / analytic:.2f}x | {r['flops'] / 1e9:.0f} | " + " | ".join(cells) + " |\n")
    return (f"One decode step, bf16, compiled by {'libtpu (deviceless v5p)' if backend == 'tpu' else 'XLA:CPU'} "
            f"for one device: the last step of P = {P} + T = {T} with {SEGMENTS} cache segments, G = {G}. "
            "floor = max(bytes / HBM bandwidth, FLOPs / bf16 peak), of the compiled program's bytes (of the analytic ones in parentheses); bandwidths and peaks: "
            + ", ".join(f"{c} {bw / 1e12:.2f} TB/s, {fl / 1e12:.0f} TFLOP/s" for c, (bw, fl) in CHIPS.items())
            + ".\n\n" + head + body)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tpu", choices=("cpu", "tpu"))
    ap.add_argument("--out", default=os.path.join(HERE, "decode_floor.md"))
    ap.add_argument("--from-json", default="", help="re-render the table from a previous run's .json")
    a = ap.parse_args()
    if a.from_json:
        saved = json.load(open(a.from_json))
        text = render(saved["records"], saved["backend"])
        print(text)
        open(a.out, "w").write(text)
        return
    if a.backend == "tpu":
        os.environ.update(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE="v5p-8", TPU_WORKER_HOSTNAMES="localhost")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    recs = []
    for model in ("1.5B", "7B"):
        for rows in (64, 256):
            recs.append(compile_step(model, rows, a.backend))
            print(json.dumps(recs[-1]), flush=True)
    text = render(recs, a.backend)
    print(text)
    open(a.out, "w").write(text)
    json.dump({"backend": a.backend, "records": recs}, open(os.path.splitext(a.out)[0] + ".json", "w"), indent=1)


if __name__ == "__main__":
    main()
