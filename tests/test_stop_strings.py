"""Text-level stop strings (sage_jax.stop_strings) against a brute-force reference and inside the sampler."""

import dataclasses

import numpy as np
import pytest

from sage_jax.stop_strings import StopStrings, token_bytes


def _first_stop(tokens: list[bytes], seq: list[int], strings: list[str]) -> int | None:
    """Reference: the first position whose decoded prefix contains a stop string (None: never)."""
    text = b""
    for i, t in enumerate(seq):
        text += tokens[t]
        if any(s.encode() in text for s in strings):
            return i
    return None


def _run(stop: StopStrings, seq: list[int]) -> int | None:
    import jax.numpy as jnp
    state = stop.start(1)
    for i, t in enumerate(seq):
        state, hit = stop.advance(state, jnp.asarray([t], jnp.int32))
        if bool(hit[0]):
            return i
    return None


def test_split_and_merged_pieces_are_found():
    tokens = [b"</", b"SOL", b"UTION", b">", b">\n\n", b"</SOLUTION>", b"x", b"", b"N><"]
    stop = StopStrings(["</SOLUTION>"], tokens)
    assert _run(stop, [6, 0, 1, 2, 3, 6]) == 4  # split across four tokens
    assert _run(stop, [0, 1, 2, 4]) == 3  # the closing '>' merged into '>\n\n'
    assert _run(stop, [6, 5]) == 1  # one token
    assert _run(stop, [0, 1, 7, 2, 6, 3]) is None  # an 'x' breaks it
    assert _run(stop, [0, 1, 6, 0, 1, 2, 3]) == 6  # a false start, then the match


@pytest.mark.parametrize("seed", range(4))
def test_automaton_equals_substring_search(seed):
    rng = np.random.default_rng(seed)
    alphabet = b"ab<>/"
    tokens = [bytes(rng.choice(list(alphabet), size=rng.integers(0, 4))) for _ in range(40)]
    strings = ["abab", "a<b", "/>>"]  # self-overlapping, so a naive restart misses matches
    stop = StopStrings(strings, tokens)
    for _ in range(40):
        seq = rng.integers(0, len(tokens), size=30).tolist()
        assert _run(stop, seq) == _first_stop(tokens, seq, strings), seq


def test_token_bytes_decode_like_the_tokenizer():
    from sage_jax.defaults import TINY_BASE
    from sage_jax.models import hf
    tok = hf.load_tokenizer(TINY_BASE)
    pieces = token_bytes(tok, len(tok) + 3)
    assert pieces[-3:] == [b"", b"", b""]  # ids past the tokenizer are empty
    text = "3*4+5 = 17.\n\\boxed{17} </SOLUTION>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert b"".join(pieces[i] for i in ids).decode() == tok.decode(ids) == text


def test_stop_strings_are_hashable_by_content():
    a, b = StopStrings(["ab"], [b"a", b"b"]), StopStrings(["ab"], [b"a", b"b"])
    assert a == b and hash(a) == hash(b) and a != StopStrings(["ab"], [b"a", b"ba"])
    with pytest.raises(ValueError):
        StopStrings([""], [b"a"])


def test_sampler_stops_right_after_the_string_and_keeps_it():
    """With a stop string, every row is the same row without it cut right after the first occurrence."""
    from sage_jax.defaults import TINY_BASE
    from sage_jax.models import hf
    from sage_jax.sampling import SamplingConfig, TextSampler
    model, _ = hf.load(TINY_BASE)
    tok = hf.load_tokenizer(TINY_BASE)
    eos = (tok.convert_tokens_to_ids("<|im_end|>"),) if "<|im_end|>" in tok.get_vocab() else ()
    cfg = SamplingConfig(max_new_tokens=64, temperature=1.0, eos_ids=eos, pad_id=tok.pad_token_id or 0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "3*4+5*2"}], add_generation_prompt=True,
                                     tokenize=False)
    free = TextSampler(model, tok, cfg, batch_size=16).generate([prompt], n=16, seed=0)[0]
    stop_s = " = "
    assert sum(stop_s in c.text for c in free) >= 8, [c.text for c in free]  # the property is exercised
    stop = StopStrings.for_tokenizer([stop_s], tok, model.cfg.vocab_size)
    cut = TextSampler(model, tok, dataclasses.replace(cfg, stop=stop), batch_size=16).generate([prompt], 16, 0)[0]
    for f, c in zip(free, cut):
        i = f.text.find(stop_s)
        want = f.text if i < 0 else f.text[: i + len(stop_s)]
        assert c.text == want, (f.text, c.text)
        assert c.num_tokens == (f.num_tokens if i < 0 else len(tok(want, add_special_tokens=False)["input_ids"]))


def test_strings_that_can_never_fire_are_refused():
    """A stop string no token sequence can write (characters outside a character vocabulary), or one needing more
    tokens than the budget, never stops anything: refused by name instead of accepted silently."""
    from sage_jax import config_lib, defaults
    from sage_jax.models import hf
    tok = hf.load_tokenizer(defaults.TINY_BASE)
    V = len(tok)
    assert StopStrings.for_tokenizer([" = ", "Ω≠", "x" * 50], tok, V).min_tokens() == [3, None, 50]  # chars
    c = defaults.default_config()
    c.rollout.max_new_tokens = 40
    for strings, words in (((" = ",), None), (("Ω≠",), "can never be written"), (("x" * 50,), "at least 50 tokens")):
        c.rollout.stop_strings = strings
        if words is None:
            assert config_lib.stop_strings(c, tok, V).strings == strings
        else:
            with pytest.raises(config_lib.ConfigValidationError, match=words) as e:
                config_lib.stop_strings(c, tok, V)
            assert "rollout.stop_strings" in str(e.value)
