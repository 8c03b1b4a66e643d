"""The embedded default's model family: a character-level tokenizer and a tiny Qwen2 config.

Characters are printable ASCII (the procedural task needs nothing else); three special tokens follow
the Qwen2 chat convention so the same templates and stop ids work for tiny and real models.

The tokenizer is written as a byte-level BPE with no merges, the exact pipeline of transformers'
`Qwen2Tokenizer`: `AutoTokenizer` turns any tokenizer of a `qwen2` checkpoint into that class
(whatever `tokenizer_class` says), so outside tools (TRL, vLLM, lm-eval, `pipeline()`) get the same
ids as this project only if the file already is what that class rebuilds. With no merges every
character stays one token; space, newline and tab are stored as their byte-level symbols.
"""

from __future__ import annotations

import string

from sage_jax.models import hf
from sage_jax.models.config import ModelConfig
from sage_jax.models.decoder import Decoder

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, turn end (= EOS)
CHARS = tuple(c for c in string.printable if c not in "\x0b\x0c\r")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """A `transformers` fast tokenizer: one token per character (id = 3 + index in CHARS), specials
    matched whole; byte-level BPE without merges, so `AutoTokenizer` reads it back with the same ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    symbol = bytes_to_unicode()  # byte -> the printable symbol byte-level BPE stores it as
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({symbol[ord(c)]: len(SPECIALS) + i for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], eos_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 384) -> ModelConfig:
    return ModelConfig(model_type="qwen2", vocab_size=len(SPECIALS) + len(CHARS), hidden_size=hidden_size,
                       intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=hidden_size // num_heads, qkv_bias=True,
                       tie_word_embeddings=True, max_position_embeddings=1024, rope_theta=10000.0,
                       bos_token_id=None, eos_token_ids=(2,), pad_token_id=0)


def write_random_init(out_dir: str, seed: int = 0, num_layers: int = 4) -> str:
    """A random-init tiny Qwen2 + char tokenizer in HF format: the starting point of its SFT. Tests that exercise
    the training loop's machinery, not what it learns, take one layer (a quarter of the program to compile)."""
    from flax import nnx

    cfg = tiny_config(num_layers=num_layers)
    return hf.save(Decoder(cfg, rngs=nnx.Rngs(seed)), cfg, out_dir, tokenizer=char_tokenizer())


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=write_random_init.__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write_random_init(a.out, a.seed))
