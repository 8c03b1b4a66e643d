"""DIR/eval/results.json: where an evaluation's raw samples are kept, written atomically after every batch, read
back (a damaged file set aside to DIR/eval.corrupt/, never a traceback), and the names of the functions that
verified them."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sage_jax.errors import UserError

SCHEMA_VERSION = 1
RESULTS_FILE = "results.json"
log = logging.getLogger(__name__)


class SettingsMismatchError(UserError, ValueError):
    """A rerun asked for settings (or prompts, answers, sources) that differ from the stored ones."""


def _to_json(obj: Any, level: int = 0) -> str:
    """JSON with one line per dict entry, but scalar-only dicts and all lists inline (compact)."""
    if isinstance(obj, dict) and obj and any(isinstance(v, dict) for v in obj.values()):
        pad = " " * (level + 1)
        items = [f"{pad}{json.dumps(str(k))}: {_to_json(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def results_path(workdir: str | os.PathLike) -> Path:
    return Path(workdir) / "eval" / RESULTS_FILE


def load_results(workdir: str | os.PathLike) -> dict | None:
    """The stored results of `workdir`, or None when there are none yet. A damaged file (cut short, not a results
    object, samples that disagree with their `n`) is set aside to `DIR/eval.corrupt/` with a warning naming it,
    and None is returned: the evaluation starts over instead of ending in a traceback."""
    path = results_path(workdir)
    if not path.exists():
        return None
    try:
        with open(path) as f:
            results = json.load(f)
        damage = _damage(results)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        damage = f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    if damage is not None:
        aside = _set_aside(path)
        log.warning("%s is damaged (%s): moved to %s; the evaluation starts over", path, damage, aside)
        return None
    if results.get("schema_version") != SCHEMA_VERSION:
        raise SettingsMismatchError(
            f"{path} has schema_version {results.get('schema_version')}, this code reads "
            f"{SCHEMA_VERSION}; evaluate into a new directory"
        )
    migrated = {k: current_name(v) for k, v in results["verifier"].items()}
    if migrated != results["verifier"]:  # written before the package split: upgraded once, in place
        results["verifier"] = migrated
        save_results(results, workdir)
    return results


def _damage(results) -> str | None:
    """What is wrong with a loaded results object, or None when its structure is whole."""
    if not isinstance(results, dict):
        return f"a JSON {type(results).__name__}, not a results object"
    for key in ("settings", "verifier", "models"):
        if not isinstance(results.get(key), dict):
            return f"no '{key}' object"
    for model, entry in results["models"].items():
        benches = entry.get("benchmarks") if isinstance(entry, dict) else None
        if not isinstance(benches, dict):
            return f"model '{model}' has no benchmarks"
        for bench, b in benches.items():
            if not (isinstance(b, dict) and isinstance(b.get("n"), int) and isinstance(b.get("problems"), dict)):
                return f"{model}/{bench} has no n or problems"
            for pid, rec in b["problems"].items():
                lists = ("correct", "rewards", "num_tokens", "answers")
                if not isinstance(rec, dict) or any(len(rec.get(k) or ()) != b["n"] for k in lists):
                    return f"{model}/{bench} problem '{pid}' does not hold n = {b['n']} samples"
                if rec.get("num_correct") != sum(rec["correct"]):
                    return f"{model}/{bench} problem '{pid}' counts {rec.get('num_correct')} correct of {rec['correct']}"
    return None


def _set_aside(path: Path) -> Path:
    """Moves a damaged results file to `DIR/eval.corrupt/` (a numbered name when one is there already)."""
    dest_dir = path.parent.parent / "eval.corrupt"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest, k = dest_dir / path.name, 1
    while dest.exists():
        dest, k = dest_dir / f"{path.name}.{k}", k + 1
    os.replace(path, dest)
    return dest


def save_results(results: dict, workdir: str | os.PathLike) -> Path:
    """Write results.json atomically (a crash mid-write leaves the previous file intact)."""
    path = results_path(workdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        f.write(_to_json(results) + "\n")
    os.replace(tmp, path)
    return path


def callable_name(fn: Callable) -> str:
    """`module.qualname` of a function (of the wrapped one for a functools.partial)."""
    fn = getattr(fn, "func", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


# Modules that moved when the package was split by concern. A results.json written before names the same
# functions under their old modules: `load_results` rewrites them once to today's names (the file is upgraded
# in place), so this table can go with the next SCHEMA_VERSION.
_MOVED = {"sage_jax.rewards.": "sage_jax.rewards.verifiers.", "sage_jax.boxed.": "sage_jax.rewards.boxed.",
          "sage_jax.eval_metrics.": "sage_jax.eval.metrics."}
_REWARDS_MODULES = ("verifiers", "pool", "worker", "host", "boxed", "answer_cost")


def current_name(name: str | None) -> str | None:
    """A stored `callable_name` under today's module names."""
    for old, new in _MOVED.items():
        if name and name.startswith(old):
            if old == "sage_jax.rewards." and name[len(old):].split(".", 1)[0] in _REWARDS_MODULES:
                return name  # already a module of the rewards package
            return new + name[len(old):]
    return name
