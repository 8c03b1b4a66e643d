"""The tiny model's char tokenizer survives save / load (transformers 5 would rebuild it as byte-level BPE)."""

import numpy as np
from flax import nnx

from sage_jax.config_lib import TINY_BASE
from sage_jax.data import procedural
from sage_jax.models import hf
from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import CHARS, char_tokenizer, tiny_config

TEXTS = [ex["solution"] for ex in procedural.generate(procedural.ArithmeticSpec(), "train", 20)] + [
    "Compute 4-5.", "a  b\tc\nd", "".join(CHARS)]


def _round_trip(tok):
    for t in TEXTS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(t), t  # one token per character, spaces included
        assert tok.decode(ids) == t


def test_fresh_char_tokenizer_round_trips():
    _round_trip(char_tokenizer())


def test_saved_char_tokenizer_round_trips(tmp_path):
    cfg = tiny_config(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    out = hf.save(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, str(tmp_path / "m"), tokenizer=char_tokenizer())
    tok = hf.load_tokenizer(out)
    _round_trip(tok)
    again = hf.save(hf.load(out)[0], cfg, str(tmp_path / "m2"), tokenizer=tok)  # a second generation
    _round_trip(hf.load_tokenizer(again))


def test_shipped_tiny_base_tokenizer_round_trips():
    tok = hf.load_tokenizer(TINY_BASE)
    _round_trip(tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Compute 4-5."}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nCompute 4-5.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
