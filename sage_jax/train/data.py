"""The training records of a run: opened through TFDS, the first `data.max_train_problems` kept, every row
checked against the token limits before the model loads (SFT rows over the limit dropped and counted if so
configured), then batched by the grain pipeline with an exact, checkpointable position."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

from sage_jax import config_lib

log = logging.getLogger(__name__)


def data_source(c, workdir: str, split: str):
    from sage_jax.data import builders
    data_dir = c.data.data_dir or os.path.join(workdir, "tfds")
    return builders.load_split(c.data.name, split, data_dir=data_dir, manual_dir=c.data.manual_dir or None,
                               config=c.data.builder_config if c.data.name == "procedural_arithmetic" else None)


def train_source(c, s, split: str):
    """The training records: the split, its first `data.max_train_problems`, every row checked against the
    token limits before the first step (SFT rows over the limit dropped, and counted, if so configured)."""
    source = data_source(c, s.workdir, split)
    if c.data.max_train_problems:
        source = _Head(source, c.data.max_train_problems)
    if c.mode == "rl":
        check_prompt_lengths(c, s, source, split)
    else:
        source = check_sft_lengths(c, s, source, split)
    return source


def prompt_iterator(c, s, source, seed: int):
    from sage_jax.data.pipeline import make_prompt_iterator
    n_proc = jax.process_count()
    # DAPO's dynamic sampling draws rl.dynamic_sampling x the prompts it trains on
    sampled = c.data.batch_size * (c.rl.get("dynamic_sampling", 1) if c.mode == "rl" else 1)
    if sampled % n_proc:
        raise config_lib.ConfigValidationError(
            f"data.batch_size={c.data.batch_size} (x rl.dynamic_sampling) is not divisible by the {n_proc} processes")
    return make_prompt_iterator(source, batch_size=sampled // n_proc, seed=seed,
                                template=c.data.template, tokenizer=s.tokenizer, system_prompt=c.data.system_prompt)


def check_sft_lengths(c, s, source, split: str, chunk: int = 1024):
    """Every SFT example (prompt + solution + EOS) fits `data.max_sft_tokens`, checked before the first step.
    Over the limit: an error naming the first such row, or with `data.sft_drop_longer` those rows left out
    (the official SFT keeps rows up to max_seq_len / 2 tokens) and their count logged."""
    from sage_jax.data.sources import decode_record
    from sage_jax.data.templates import make_template_fn
    from sage_jax.train.sft import sft_lengths
    fmt = make_template_fn(c.data.template, s.tokenizer, c.data.system_prompt)
    limit, keep = c.data.max_sft_tokens, []
    for start in range(0, len(source), chunk):
        idx = list(range(start, min(start + chunk, len(source))))
        recs = [decode_record(source[i]) for i in idx]
        n = sft_lengths(s.tokenizer, [fmt(r["problem"]) for r in recs], [r["solution"] for r in recs])
        over = np.flatnonzero(n > limit)
        if len(over) and not c.data.sft_drop_longer:
            i = int(over[0])
            raise config_lib.ConfigValidationError(
                f"{c.data.name}:{split} row {idx[i]} (id {recs[i]['id']}): {int(n[i])} tokens (prompt + "
                f"solution + EOS) exceed data.max_sft_tokens={limit}; raise it, or set data.sft_drop_longer=True")
        keep += [j for j, m in zip(idx, n) if m <= limit]
    if len(keep) == len(source):
        return source
    log.warning("%s:%s: %d of %d SFT rows are longer than data.max_sft_tokens=%d and left out "
                "(data.sft_drop_longer)", c.data.name, split, len(source) - len(keep), len(source), limit)
    if not keep:
        raise config_lib.ConfigValidationError(
            f"{c.data.name}:{split}: no row fits data.max_sft_tokens={limit}")
    return _Rows(source, keep)


def check_prompt_lengths(c, s, source, split: str, chunk: int = 8192) -> None:
    """Every prompt of `source` fits `data.max_prompt_tokens`, checked before the first step (a long row found
    when its batch comes up would end a run hours in); the error names the first row that does not fit."""
    from sage_jax.data.sources import decode_record
    limit = c.data.max_prompt_tokens
    lengths = prompt_lengths(c, s, source)
    over = np.flatnonzero(lengths > limit)
    if len(over):
        row = int(over[0])
        rec = decode_record(source[row])
        raise config_lib.ConfigValidationError(
            f"data.max_prompt_tokens={limit}: {len(over)} prompt(s) of {c.data.name}:{split} are longer, the first "
            f"at row {row} (id {rec['id']}, {int(lengths[row])} tokens: {rec['problem'][:60]!r}); raise the limit "
            "or filter the data (prompts are never truncated)")


def prompt_lengths(c, s, source, chunk: int = 8192) -> np.ndarray:
    """The templated prompt length (tokens) of every record of `source`, int32 [len(source)].

    Reading and tokenizing every record costs about 0.4 ms each (18 s for the embedded task's 50k problems, at
    every start), so the lengths of a prepared split are cached beside it (`<split dir>/prompt_lengths/`), keyed
    on the split's files (size and mtime), the tokenizer and the rendered template."""
    base = source.source if isinstance(source, _Head) else source
    cache = _lengths_cache_path(c, s, base)
    if cache is not None and os.path.isfile(cache):
        try:
            lengths = np.load(cache)
            if lengths.shape == (len(base),):
                return lengths[:len(source)]
        except (OSError, ValueError):
            pass  # unreadable: recompute (and rewrite it)
    lengths = _count_prompt_tokens(c, s, base, chunk)
    if cache is not None:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp.npy"
            np.save(tmp, lengths)
            os.replace(tmp, cache)
        except OSError as e:  # a read-only data dir: the check still ran
            log.info("prompt lengths not cached (%s)", e)
    return lengths[:len(source)]


def _count_prompt_tokens(c, s, source, chunk: int) -> np.ndarray:
    from sage_jax.data.sources import decode_record
    from sage_jax.data.templates import make_template_fn
    fmt = make_template_fn(c.data.template, s.tokenizer, c.data.system_prompt)
    # Render the template once around a marker, when it inserts the problem verbatim (checked on the
    # first rows below): jinja per row costs more than the tokenizer.
    marker = "\x00problem\x00"
    parts = fmt(marker).split(marker)
    render = (lambda p: parts[0] + p + parts[1]) if len(parts) == 2 else fmt
    out = np.zeros((len(source),), np.int32)
    for start in range(0, len(source), chunk):
        idx = list(range(start, min(start + chunk, len(source))))
        raw = source.__getitems__(idx) if hasattr(source, "__getitems__") else [source[i] for i in idx]
        recs = [decode_record(r) for r in raw]
        if start == 0 and any(render(r["problem"]) != fmt(r["problem"]) for r in recs[:16]):
            render = fmt
        ids = s.tokenizer([render(r["problem"]) for r in recs], add_special_tokens=False)["input_ids"]
        out[start:start + len(idx)] = [len(x) for x in ids]
    return out


def _lengths_cache_path(c, s, source) -> str | None:
    """Where `prompt_lengths` caches the lengths of a prepared TFDS split, or None (not a local prepared split)."""
    import hashlib
    import json
    info = getattr(source, "dataset_info", None)
    split = getattr(source, "split", None)
    data_dir = str(getattr(info, "data_dir", "") or "")
    if not data_dir or split is None or "://" in data_dir or not os.path.isdir(data_dir):
        return None
    files = sorted(f for f in os.listdir(data_dir) if f"-{split}." in f)
    stats = [(f, os.path.getsize(os.path.join(data_dir, f)), os.path.getmtime(os.path.join(data_dir, f)))
             for f in files]
    from sage_jax.data.templates import make_template_fn
    marker = "\x00problem\x00"
    rendered = make_template_fn(c.data.template, s.tokenizer, c.data.system_prompt)(marker)
    tok = s.tokenizer
    vocab = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else json.dumps(
        sorted(tok.get_vocab().items()))
    key = hashlib.sha1(json.dumps([stats, rendered, hashlib.sha1(vocab.encode()).hexdigest()]).encode())
    return os.path.join(data_dir, "prompt_lengths", f"{split}-{key.hexdigest()[:16]}.npy")


class _Rows:
    """The records of a random-access source at the given indexes."""

    def __init__(self, source, rows: list[int]):
        self.source, self.rows = source, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.source[self.rows[i]]


class _Head:
    """The first n records of a random-access source (a smaller training pool)."""

    def __init__(self, source, n: int):
        if n > len(source):
            raise config_lib.ConfigValidationError(
                f"data.max_train_problems={n} exceeds the {len(source)} training problems")
        self.source, self.n = source, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.source[i]
