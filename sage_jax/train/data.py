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
    from sage_jax.data.templates import make_template_fn
    fmt = make_template_fn(c.data.template, s.tokenizer, c.data.system_prompt)
    # Render the template once around a marker, when it inserts the problem verbatim (checked on the
    # first rows below): jinja per row costs more than the tokenizer.
    marker = "\x00problem\x00"
    parts = fmt(marker).split(marker)
    render = (lambda p: parts[0] + p + parts[1]) if len(parts) == 2 else fmt
    limit = c.data.max_prompt_tokens
    bad, first = 0, None
    for start in range(0, len(source), chunk):
        idx = list(range(start, min(start + chunk, len(source))))
        raw = source.__getitems__(idx) if hasattr(source, "__getitems__") else [source[i] for i in idx]
        recs = [decode_record(r) for r in raw]
        if start == 0 and any(render(r["problem"]) != fmt(r["problem"]) for r in recs[:16]):
            render = fmt
        lengths = [len(x) for x in s.tokenizer([render(r["problem"]) for r in recs],
                                                 add_special_tokens=False)["input_ids"]]
        for j, n in enumerate(lengths):
            if n > limit:
                bad += 1
                first = first or (start + j, recs[j], n)
    if first is not None:
        row, rec, n = first
        raise config_lib.ConfigValidationError(
            f"data.max_prompt_tokens={limit}: {bad} prompt(s) of {c.data.name}:{split} are longer, the first at row "
            f"{row} (id {rec['id']}, {n} tokens: {rec['problem'][:60]!r}); raise the limit or filter the data "
            "(prompts are never truncated)")


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
