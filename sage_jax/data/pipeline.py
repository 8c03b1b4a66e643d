"""grain pipelines: deterministic, per-host sharded, checkpointable batches of prompts.

    it = make_prompt_iterator(source, batch_size=8, seed=0)   # shard = this JAX process
    batch = next(it)        # {"id": [..], "prompt": [..], "problem": [..], "answer": [..], ...}
    state = it.get_state()  # a small JSON-able dict; save it with the train state (Orbax)
    it2 = make_prompt_iterator(source, batch_size=8, seed=0); it2.set_state(state)
    next(it2) == next(it)   # exactly the batch that would have come next

Order of operations, and why:
  1. trim to a multiple of `shard_count` and take every `shard_count`-th record from
     `shard_index`: hosts see disjoint prompts and the same number of batches (no host waits
     for another at the end of an epoch);
  2. shuffle (a permutation keyed by seed and epoch: every epoch is a new order, the same on
     every run);
  3. repeat (`num_epochs=None`: forever), decode and template each record, batch.
`source` is anything with `__len__` and `__getitem__` returning a record: a TFDS
`ArrayRecordDataSource` (bytes fields) or a plain list of dicts.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import grain

from sage_jax.data.sources import decode_record
from sage_jax.data.templates import make_template_fn

BATCH_KEYS = ("id", "prompt", "problem", "answer", "solution")


def _default_shard() -> tuple[int, int]:
    import jax  # only when the caller did not say which shard it is

    return jax.process_index(), jax.process_count()


def _collate(records: Sequence[dict]) -> dict[str, list]:
    return {k: [r[k] for r in records] for k in BATCH_KEYS}


def make_prompt_dataset(
    source: Any,
    batch_size: int,
    seed: int,
    shard_index: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = None,
    template: str | Callable[[str], str] = "sage",
    tokenizer: Any = None,
    system_prompt: str | None = None,
    drop_remainder: bool = True,
) -> grain.MapDataset:
    """The batched `grain.MapDataset` behind `make_prompt_iterator` (see the module docstring)."""
    if shard_index is None or shard_count is None:
        shard_index, shard_count = _default_shard()
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = (len(source) // shard_count) * shard_count
    per_shard = n // shard_count
    if per_shard < (batch_size if drop_remainder else 1):
        raise ValueError(
            f"{len(source)} records give {per_shard} per shard for {shard_count} shards: "
            f"fewer than one batch of {batch_size}"
        )
    to_prompt = template if callable(template) else make_template_fn(template, tokenizer,
                                                                     system_prompt)

    def prepare(rec: Any) -> dict:
        r = decode_record(rec)
        r["prompt"] = to_prompt(r["problem"])
        r.setdefault("solution", "")
        return r

    ds = grain.MapDataset.source(source)[:n][shard_index::shard_count]
    ds = ds.shuffle(seed=seed).repeat(num_epochs).map(prepare)
    return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=_collate)


def make_prompt_iterator(
    source: Any,
    batch_size: int,
    seed: int,
    shard_index: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = None,
    template: str | Callable[[str], str] = "sage",
    tokenizer: Any = None,
    system_prompt: str | None = None,
    drop_remainder: bool = True,
    read_threads: int = 0,
) -> grain.DatasetIterator:
    """An iterator over prompt batches with exact `get_state()` / `set_state()`.

    `shard_index` / `shard_count` default to `jax.process_index()` / `jax.process_count()`.
    `read_threads=0` reads in the calling thread (records are small; no prefetch to drain).
    """
    ds = make_prompt_dataset(source, batch_size, seed, shard_index, shard_count, num_epochs,
                             template, tokenizer, system_prompt, drop_remainder)
    opts = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=read_threads and 16)
    return iter(ds.to_iter_dataset(opts))


def state_to_json(it: grain.DatasetIterator) -> str:
    """The iterator's position as a JSON string (for Orbax `JsonSave` or any text store)."""
    return json.dumps(it.get_state(), sort_keys=True)


def restore_from_json(it: grain.DatasetIterator, state: str | bytes | dict) -> None:
    """Move `it` to a position saved with `state_to_json` (or the `get_state()` dict)."""
    it.set_state(json.loads(state) if isinstance(state, (str, bytes)) else dict(state))
