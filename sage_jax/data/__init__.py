"""Data: TFDS builders for the math datasets and the procedural task, prompt templates, grain.

    from sage_jax.data import load_split, make_prompt_iterator
    ds = load_split("procedural_arithmetic", "train")           # or "math500", "test", ...
    it = make_prompt_iterator(ds, batch_size=8, seed=0, template="plain")

Importing the package is cheap: TFDS and grain load on first use of the names below.
"""

import importlib
from typing import Any

_EXPORTS = {
    "BUILDERS": "builders", "get_builder": "builders", "load_split": "builders",
    "arithmetic_config": "builders",
    "SPECS": "sources", "RECORD_FIELDS": "sources", "decode_record": "sources",
    "DataFormatError": "sources", "ManualFileMissingError": "sources",
    "ArithmeticSpec": "procedural",
    "format_prompt": "templates", "make_template_fn": "templates",
    "SAGE_SYSTEM_PROMPT": "templates", "TEMPLATES": "templates",
    "make_prompt_dataset": "pipeline", "make_prompt_iterator": "pipeline",
    "state_to_json": "pipeline", "restore_from_json": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sage_jax.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sage_jax.data.{_EXPORTS[name]}"), name)
