"""The tiny model's char tokenizer survives save / load, and outside tools that load exports through
transformers' auto classes get the same ids and the same greedy text as this project."""

import pytest
from flax import nnx

from sage_jax.defaults import TINY_BASE
from sage_jax.data import procedural
from sage_jax.models import auto_tokenizer, hf
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


# --- outside tools: transformers' AutoTokenizer / AutoModelForCausalLM read our exports as we do ---------

def _old_word_level_tokenizer():
    """The char tokenizer as it was before (a WordLevel model): AutoTokenizer misreads it under qwen2."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sage_jax.models.tiny import CHAT_TEMPLATE, SPECIALS
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + CHARS)}, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], eos_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _auto_ids_equal_file_ids(path):
    """AutoTokenizer ids == the ids of tokenizer.json read by the `tokenizers` library itself."""
    import os

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    raw = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(path)
    chat = auto.apply_chat_template([{"role": "user", "content": "Compute 4-5*2."}], tokenize=False,
                                    add_generation_prompt=True)
    for text in TEXTS + [chat + "rule: 4-5*2 = 4-10 = -6. \\boxed{-6}<|im_end|>\n", " lead\n\n  trail  "]:
        want = raw.encode(text, add_special_tokens=False).ids
        assert auto(text, add_special_tokens=False)["input_ids"] == want, (type(auto).__name__, text)
        assert auto.decode(want) == text
    return auto


def test_auto_tokenizer_reads_the_shipped_base():
    auto = _auto_ids_equal_file_ids(TINY_BASE)
    assert auto.eos_token_id == 2 and auto.pad_token_id == 0
    assert auto_tokenizer.auto_tokenizer_mismatch(TINY_BASE) is None


def test_auto_tokenizer_reads_a_fresh_export(tmp_path):
    cfg = tiny_config(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    out = hf.save(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, str(tmp_path / "m"), tokenizer=char_tokenizer())
    _auto_ids_equal_file_ids(out)
    out = hf.save(hf.load(out)[0], cfg, str(tmp_path / "m2"), tokenizer=hf.load_tokenizer(out))  # an export of an export
    _auto_ids_equal_file_ids(out)


def test_misread_export_is_detected(tmp_path, caplog):
    """The check is not vacuous: the old WordLevel char tokenizer under model_type qwen2 is misread and the
    export's check says so in one warning line."""
    cfg = tiny_config(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    with caplog.at_level("WARNING", logger="sage_jax.models.auto_tokenizer"):
        out = hf.save(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, str(tmp_path / "m"), tokenizer=_old_word_level_tokenizer())
        auto_tokenizer.check_auto_tokenizer(out)
    msg = auto_tokenizer.auto_tokenizer_mismatch(out)
    assert msg is not None and "Qwen2Tokenizer" in msg
    assert any("Qwen2Tokenizer" in r.getMessage() for r in caplog.records)


def test_the_auto_tokenizer_verdict_is_remembered_per_content(tmp_path, caplog, monkeypatch):
    """A second export of the same tokenizer files does not load AutoTokenizer again (it imports torch where
    torch is installed: ~4 s per export) and repeats a remembered warning, naming its own directory; other
    tokenizer files are checked anew."""
    monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    calls = []
    real = auto_tokenizer.auto_tokenizer_mismatch
    monkeypatch.setattr(auto_tokenizer, "auto_tokenizer_mismatch", lambda path: calls.append(path) or real(path))
    export = lambda name, tok: auto_tokenizer.check_auto_tokenizer(hf.save(model, cfg, str(tmp_path / name),
                                                                           tokenizer=tok))
    with caplog.at_level("WARNING", logger="sage_jax.models.auto_tokenizer"):
        for name in ("a", "b"):
            export(name, _old_word_level_tokenizer())
    assert calls == [str(tmp_path / "a")]
    warned = [r.getMessage() for r in caplog.records if "Qwen2Tokenizer" in r.getMessage()]
    assert len(warned) == 2 and str(tmp_path / "b") in warned[1] and str(tmp_path / "a") not in warned[1]
    export("c", char_tokenizer())  # other files: checked, and fine
    assert calls == [str(tmp_path / "a"), str(tmp_path / "c")]
    (tmp_path / "cache" / "auto_tokenizer_checks.json").write_text("{damaged")  # a damaged cache: check again
    export("d", char_tokenizer())
    assert calls[-1] == str(tmp_path / "d")


@pytest.mark.parametrize("which", ["shipped", "export"])
def test_transformers_greedy_generate_matches_our_sampler(which, tmp_path):
    """The shipped base, and a fresh export of it (what a run's export_hf holds), through AutoTokenizer +
    AutoModelForCausalLM.generate (greedy) write the same text as this project's sampler at temperature 0,
    on several held-out prompts."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sage_jax.data.templates import format_prompt
    from sage_jax.sampling import SamplingConfig, TextSampler
    path = TINY_BASE
    if which == "export":
        model, cfg = hf.load(TINY_BASE)
        path = hf.save(model, cfg, str(tmp_path / "export_hf"), tokenizer=hf.load_tokenizer(TINY_BASE))
    auto_tok = AutoTokenizer.from_pretrained(path)
    auto_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = TextSampler(hf.load(path)[0], hf.load_tokenizer(path),
                       SamplingConfig(max_new_tokens=96, temperature=0.0, eos_ids=(2,), pad_id=0), batch_size=4)
    problems = ["Compute 3+4*2-5.", "Compute 9-2*3*4+1.", "Compute 7*6-5+4*3-2.", "Compute 2+2+2."]
    prompts = [format_prompt(p, "chat", auto_tok) for p in problems]
    mine = [g[0].text for g in ours.generate(prompts, n=1, seed=0)]
    for prompt, text in zip(prompts, mine):
        ids = auto_tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = auto_model.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=2, pad_token_id=0)
        theirs = auto_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert theirs == text, (prompt, theirs, text)
        assert "\\boxed{" in text  # a real worked answer, not an empty or garbled string
