"""Sampler decode throughput (tokens/s) for a tiny and a small random Qwen2 (not a test).

    .venv/bin/python experiments/bench_sampler.py [--rows 64] [--new 128]

Prints, per config: prefill+decode wall time (median of 3 after a compile run), completion tokens/s,
and the decode step time against the matmul floor of the machine (see docs/design.md §7).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax.models.config import ModelConfig
from sage_jax.models.decoder import Decoder
from sage_jax.sampling import SamplingConfig, make_generate_fn

SHAPES = {"tiny": dict(hidden_size=128, num_layers=4, intermediate_size=384),
          "small": dict(hidden_size=512, num_layers=8, intermediate_size=1536)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; rows={args.rows} prompt={args.prompt} new={args.new}")
    for name, kw in SHAPES.items():
        cfg = ModelConfig(model_type="qwen2", vocab_size=1024, num_heads=kw["hidden_size"] // 64, num_kv_heads=2,
                          head_dim=64, qkv_bias=True, tie_word_embeddings=True, **kw)
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        g, s = nnx.split(model)
        fn = make_generate_fn(g, SamplingConfig(max_new_tokens=args.new, eos_ids=()))
        prompt = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (args.rows, args.prompt)), jnp.int32)
        mask = jnp.ones_like(prompt)
        jax.block_until_ready(fn(s, prompt, mask, jax.random.key(0)))
        times = []
        for i in range(3):
            t = time.perf_counter()
            out = jax.block_until_ready(fn(s, prompt, mask, jax.random.key(i + 1)))
            times.append(time.perf_counter() - t)
        dt = float(np.median(times))
        toks = int(np.asarray(out.mask_BxT).sum())
        print(f"{name:6s} h{kw['hidden_size']}/L{kw['num_layers']}: {dt:.3f} s per generate, "
              f"{toks / dt:,.0f} completion tokens/s, {1e3 * dt / args.new:.2f} ms per decode step")


if __name__ == "__main__":
    main()
