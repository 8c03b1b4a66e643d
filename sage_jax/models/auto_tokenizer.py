"""Whether outside tools read an exported tokenizer as this project does.

TRL, vLLM, lm-eval and `pipeline()` load a model directory's tokenizer with `transformers.AutoTokenizer`, which
maps some model types (qwen2 among them) to their own tokenizer class whatever `tokenizer_class` says. The
check compares its ids with `hf.load_tokenizer`'s on a probe text and warns in one line when they differ. Its
verdict is remembered per content in the user's cache: where torch is installed, importing AutoTokenizer
imports it (~4 s), and every export of a run writes the same tokenizer files.
"""

from __future__ import annotations

import json
import logging
import os

from sage_jax.models.hf import TOKENIZER_FILES, load_tokenizer

log = logging.getLogger(__name__)

AUTO_PROBE = "Compute 3 + 4*2.\n\tThen  say: \\boxed{11} (ok)!"


def auto_tokenizer_mismatch(path: str, text: str = AUTO_PROBE) -> str | None:
    """None when `transformers.AutoTokenizer` gives the ids this project's `load_tokenizer` gives on `text`
    (and on the chat template around it); otherwise a one-line description of the difference."""
    from transformers import AutoTokenizer
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(path)
    texts = [text]
    if getattr(ours, "chat_template", None):
        texts.append(ours.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True))
    for t in texts:
        a, b = ours(t, add_special_tokens=False)["input_ids"], theirs(t, add_special_tokens=False)["input_ids"]
        if a != b:
            return (f"AutoTokenizer reads {path} as {type(theirs).__name__}, whose ids differ from tokenizer.json's "
                    f"({len(b)} vs {len(a)} tokens on {t[:40]!r}); load it with "
                    f"PreTrainedTokenizerFast.from_pretrained")
    return None


def check_auto_tokenizer(path: str) -> None:
    """Warns (one line) when outside tools that load `path` with `AutoTokenizer` would get other ids than the
    tokenizer.json holds; the verdict is remembered per content (`_auto_check_key`)."""
    key = _auto_check_key(path)
    cache = _auto_check_cache()
    if key in cache:
        msg = cache[key]
    else:
        try:
            msg = auto_tokenizer_mismatch(path)
        except Exception as e:  # noqa: BLE001  (a check, never a reason to fail an export)
            msg = (f"AutoTokenizer cannot load {path} ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:120] if str(e) else ''})")
        _auto_check_remember(key, msg, path)
    if msg:
        log.warning(msg.replace(AUTO_PATH, path))


AUTO_PATH = "<path>"  # the checked directory in a remembered message


def _auto_check_key(path: str) -> str:
    """What AutoTokenizer's ids on `path` depend on: the tokenizer files, the model type and tokenizer class
    that pick its class, the transformers version and the probe text."""
    import hashlib
    from importlib.metadata import version
    h = hashlib.sha256(f"{version('transformers')}\0{AUTO_PROBE}".encode())
    for fn in sorted(TOKENIZER_FILES):
        f = os.path.join(path, fn)
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                h.update(fn.encode() + b"\0" + fh.read() + b"\0")
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as fh:
            c = json.load(fh)
        h.update(json.dumps([c.get("model_type"), c.get("tokenizer_class")]).encode())
    return h.hexdigest()


def _auto_check_file() -> str:
    root = os.environ.get("SAGE_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sage_jax")
    return os.path.join(root, "auto_tokenizer_checks.json")


def _auto_check_cache() -> dict:
    try:
        with open(_auto_check_file()) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):  # none yet, unreadable or damaged: check again
        return {}


def _auto_check_remember(key: str, msg: str | None, checked: str) -> None:
    """Adds a verdict, `checked`'s path made a placeholder, to the cache (atomic replace; a concurrent writer may drop one entry: it is checked
    again next time). A cache that cannot be written is skipped silently: it only saves time."""
    import tempfile
    path = _auto_check_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cache = _auto_check_cache()
        cache[key] = None if msg is None else msg.replace(checked, AUTO_PATH)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError:
        pass
