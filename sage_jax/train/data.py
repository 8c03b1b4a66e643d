"""The training records of a run: opened through TFDS, the first `data.max_train_problems` kept, every row
checked against the token limits before the model loads (SFT rows over the limit dropped and counted if so
configured), then batched by the grain pipeline with an exact, checkpointable position."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

from sage_jax import config_lib
from sage_jax.data import builders
from sage_jax.data.files import find_local_files
from sage_jax.data.pipeline import make_prompt_iterator
from sage_jax.data.sources import SPECS, decode_record
from sage_jax.data.templates import make_template_fn
from sage_jax.train.sft import sft_lengths

log = logging.getLogger(__name__)


def data_source(data, workdir: str, split: str):
    """The random-access records of `split` of the `DataSpec`'s dataset (prepared on first use)."""
    return builders.load_split(data.name, split, data_dir=data.tfds_dir(workdir), manual_dir=data.manual_dir,
                               config=data.builder_config)


def train_source(data, mode: str, tokenizer, workdir: str):
    """The training records: the split, its first `data.max_train_problems`, every row checked against the
    token limits before the first step (SFT rows over the limit dropped, and counted, if so configured), and at
    least one batch of them."""
    source = data_source(data, workdir, data.train_split)
    if data.max_train_problems:
        source = _Head(source, data.max_train_problems)
    if mode == "rl":
        check_prompt_lengths(data, tokenizer, source)
    else:
        source = check_sft_lengths(data, tokenizer, source)
    if len(source) < data.sampled_per_step:
        files = _source_files(data)
        raise config_lib.ConfigValidationError(
            f"{data.name}:{data.train_split} has {len(source)} training record(s)" + (f" ({files})" if files else "")
            + f", fewer than one batch: data.batch_size={data.batch_size}"
            + (" x rl.dynamic_sampling" if data.sampled_per_step != data.batch_size else "")
            + f" = {data.sampled_per_step} prompts per step; lower it or give more data")
    return source


def _source_files(data) -> str:
    if data.name not in SPECS or not data.manual_dir:
        return ""
    return ", ".join(str(p) for p in find_local_files(SPECS[data.name], data.manual_dir))


def prompt_iterator(data, tokenizer, source, seed: int):
    n_proc = jax.process_count()
    if data.sampled_per_step % n_proc:
        raise config_lib.ConfigValidationError(
            f"data.batch_size={data.batch_size} (x rl.dynamic_sampling) is not divisible by the {n_proc} processes")
    return make_prompt_iterator(source, batch_size=data.sampled_per_step // n_proc, seed=seed,
                                template=data.template, tokenizer=tokenizer, system_prompt=data.system_prompt)


def check_sft_lengths(data, tokenizer, source, chunk: int = 1024):
    """Every SFT example (prompt + solution + EOS) fits `data.max_sft_tokens`, checked before the first step.
    Over the limit: an error naming the first such row, or with `data.sft_drop_longer` those rows left out
    (the official SFT keeps rows up to max_seq_len / 2 tokens) and their count logged."""
    fmt = make_template_fn(data.template, tokenizer, data.system_prompt)
    limit, keep, split = data.max_sft_tokens, [], data.train_split
    for start in range(0, len(source), chunk):
        idx = list(range(start, min(start + chunk, len(source))))
        recs = [decode_record(source[i]) for i in idx]
        n = sft_lengths(tokenizer, [fmt(r["problem"]) for r in recs], [r["solution"] for r in recs])
        over = np.flatnonzero(n > limit)
        if len(over) and not data.sft_drop_longer:
            i = int(over[0])
            raise config_lib.ConfigValidationError(
                f"{data.name}:{split} row {idx[i]} (id {recs[i]['id']}): {int(n[i])} tokens (prompt + "
                f"solution + EOS) exceed data.max_sft_tokens={limit}; raise it, or set data.sft_drop_longer=True")
        keep += [j for j, m in zip(idx, n) if m <= limit]
    if len(keep) == len(source):
        return source
    log.warning("%s:%s: %d of %d SFT rows are longer than data.max_sft_tokens=%d and left out "
                "(data.sft_drop_longer)", data.name, split, len(source) - len(keep), len(source), limit)
    if not keep:
        raise config_lib.ConfigValidationError(f"{data.name}:{split}: no row fits data.max_sft_tokens={limit}")
    return _Rows(source, keep)


def check_prompt_lengths(data, tokenizer, source) -> None:
    """Every prompt of `source` fits `data.max_prompt_tokens`, checked before the first step (a long row found
    when its batch comes up would end a run hours in); the error names the first row that does not fit."""
    limit = data.max_prompt_tokens
    lengths = prompt_lengths(data, tokenizer, source)
    over = np.flatnonzero(lengths > limit)
    if len(over):
        row = int(over[0])
        rec = decode_record(source[row])
        raise config_lib.ConfigValidationError(
            f"data.max_prompt_tokens={limit}: {len(over)} prompt(s) of {data.name}:{data.train_split} are longer, "
            f"the first at row {row} (id {rec['id']}, {int(lengths[row])} tokens: {rec['problem'][:60]!r}); raise "
            "the limit or filter the data (prompts are never truncated)")


def prompt_lengths(data, tokenizer, source, chunk: int = 8192) -> np.ndarray:
    """The templated prompt length (tokens) of every record of `source`, int32 [len(source)].

    Reading and tokenizing every record costs about 0.4 ms each (18 s for the embedded task's 50k problems, at
    every start), so the lengths of a prepared split are cached beside it (`<split dir>/prompt_lengths/`), keyed
    on the split's files (size and mtime), the tokenizer and the rendered template."""
    base = source.source if isinstance(source, _Head) else source
    cache = _lengths_cache_path(data, tokenizer, base)
    if cache is not None and os.path.isfile(cache):
        try:
            lengths = np.load(cache)
            if lengths.shape == (len(base),):
                return lengths[:len(source)]
        except (OSError, ValueError):
            pass  # unreadable: recompute (and rewrite it)
    lengths = _count_prompt_tokens(data, tokenizer, base, chunk)
    if cache is not None:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp.npy"
            np.save(tmp, lengths)
            os.replace(tmp, cache)
        except OSError as e:  # a read-only data dir: the check still ran
            log.info("prompt lengths not cached (%s)", e)
    return lengths[:len(source)]


def _count_prompt_tokens(data, tokenizer, source, chunk: int) -> np.ndarray:
    fmt = make_template_fn(data.template, tokenizer, data.system_prompt)
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
        ids = tokenizer([render(r["problem"]) for r in recs], add_special_tokens=False)["input_ids"]
        out[start:start + len(idx)] = [len(x) for x in ids]
    return out


def _lengths_cache_path(data, tokenizer, source) -> str | None:
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
    marker = "\x00problem\x00"
    rendered = make_template_fn(data.template, tokenizer, data.system_prompt)(marker)
    tok = tokenizer
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
