"""Sampler demo on a tiny checkpoint: save a random tiny Qwen2 in HF format, load it back, sample.

    python -m sage_jax.demo --workdir=/tmp/sage_jax_demo
"""

import argparse
import os

import jax
from flax import nnx

from sage_jax.models import hf
from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import char_tokenizer, tiny_config
from sage_jax.sampling import SamplingConfig, TextSampler


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/sage_jax_demo")
    args = ap.parse_args(argv)
    out = os.path.join(args.workdir, "tiny_random_hf")
    cfg = tiny_config()
    hf.save(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, out, tokenizer=char_tokenizer())
    model, cfg = hf.load(out)
    tok = hf.load_tokenizer(out)
    sampler = TextSampler(model, tok, SamplingConfig(max_new_tokens=32, temperature=1.0, eos_ids=cfg.eos_token_ids,
                                                     pad_id=tok.pad_token_id), batch_size=8, chat_template=True)
    prompts = ["Compute 3+4*2.", "Compute 12-5."]
    for p, comps in zip(prompts, sampler.generate(prompts, n=2, seed=0)):
        for c in comps:
            print(f"{p!r} -> {c.text!r} ({c.num_tokens} tokens, mean entropy {c.mean_entropy:.2f} nats)")
    print(f"saved and reloaded {out} ({jax.devices()[0].platform})")


if __name__ == "__main__":
    main()
