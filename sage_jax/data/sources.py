"""The public math datasets: where their files live, how to read them, how to map their fields.

Every dataset is mapped to one record schema (`RECORD_FIELDS`) so that the trainer and the
evaluator treat them uniformly:

    id (str), problem (str), answer (str: the gold final answer), solution (str, may be ''),
    source (str: dataset name), subject (str, may be ''), level (int, 0 if unknown)

Local files go in `<manual_dir>/<dataset name>/` (TFDS' default manual dir is
`~/tensorflow_datasets/downloads/manual/`), in the public release's own format and file name
(see `SPECS` and `sage_jax/data/README.md`). Without them the file is fetched from the Hugging
Face hub when online (unless `HF_HUB_OFFLINE=1` or `SAGE_JAX_OFFLINE=1`); otherwise
`ManualFileMissingError` says which file to put where. A malformed row raises
`DataFormatError` naming the file and the row (1-based).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from sage_jax.data.templates import REASONING_END, SOLUTION_END, SOLUTION_START
from sage_jax.errors import UserError
from sage_jax.rewards.boxed import last_boxed  # the same brace matcher as the verifier

log = logging.getLogger(__name__)

RECORD_FIELDS = ("id", "problem", "answer", "solution", "source", "subject", "level")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class DataFormatError(UserError, ValueError):
    """A row of a dataset file does not have the expected fields."""


class ManualFileMissingError(UserError, FileNotFoundError):
    """A dataset file is neither in the manual directory nor reachable on the hub."""


class DataConfigError(UserError, ValueError):
    """A dataset, split or builder config that does not exist."""


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One public release: its hub location, file names and field names."""

    name: str  # TFDS builder name and manual sub-directory
    hub_repo: str  # Hugging Face dataset repo id
    hub_files: tuple[str, ...]  # paths inside the repo; the local copy keeps the base name
    split: str  # the TFDS split the file becomes ('train' or 'test')
    fields: str  # human-readable field list for error messages and docs
    to_record: Callable[[dict, int], dict]  # (lower-cased row, 1-based row number) -> record
    description: str = ""
    url_base: str = ""  # files not on the HF hub: fetched from f"{url_base}/{file}" instead

    def urls(self) -> list[str]:
        if self.url_base:
            return [f"{self.url_base}/{f}" for f in self.hub_files]
        return [f"https://huggingface.co/datasets/{self.hub_repo}/blob/main/{f}" for f in self.hub_files]


# ----------------------------------------------------------------------------- field helpers


def _get(row: dict, *names: str, default: Any = None) -> Any:
    """First present, non-null field among `names` (the row's keys are lower-cased)."""
    for n in names:
        v = row.get(n.lower())
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            return v
    return default


def answer_text(v: Any) -> str:
    """A gold answer as text: `27.0` -> `'27'`, lists (several golds) joined by ', '."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (list, tuple)):
        return ", ".join(answer_text(x) for x in v)
    return str(v).strip()


def _require(value: Any, field: str, row: dict) -> Any:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise KeyError(f"missing or empty field {field!r} (row has {sorted(row)})")
    return value


def _scalar(value: Any, field: str, golds: bool = False) -> Any:
    """`value` when it is text or a number (with `golds`, also a list of them: several gold answers); a list,
    a dict or anything else is refused, naming the field, instead of being stringified into the record."""
    ok = (str, int, float, np.integer, np.floating)
    if isinstance(value, ok) or (golds and isinstance(value, (list, tuple)) and value
                                 and all(isinstance(x, ok) for x in value)):
        return value
    raise TypeError(f"field {field!r} is a {type(value).__name__} ({str(value)[:40]!r}), expected "
                    + ("text, a number or a list of them" if golds else "text or a number"))


# ----------------------------------------------------------------------------- per dataset

# DAPO-Math-17k wraps each problem in an instruction; `problem` keeps only the problem itself
# (the prompt template is applied later, uniformly for all datasets).
_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$")


def _dapo(row: dict, n: int) -> dict:
    prompt = _require(_get(row, "prompt"), "prompt", row)
    if isinstance(prompt, str):
        text = prompt
    else:
        msgs = [m for m in list(prompt) if isinstance(m, dict)]
        users = [m for m in msgs if m.get("role") == "user"] or msgs
        text = _require(users[-1].get("content") if users else None, "prompt[].content", row)
    text = _scalar(text, "prompt[].content")
    problem = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", str(text), count=1)).strip()
    rm = _require(_get(row, "reward_model"), "reward_model", row)
    answer = _scalar(_require(rm.get("ground_truth") if isinstance(rm, dict) else None,
                              "reward_model.ground_truth", row), "reward_model.ground_truth", golds=True)
    extra = _get(row, "extra_info", default={}) or {}
    idx = extra.get("index") if isinstance(extra, dict) else None
    return {"id": str(idx if idx is not None else n), "problem": problem,
            "answer": answer_text(answer), "solution": "", "subject": "", "level": 0}


def _dapo_processed(row: dict, n: int) -> dict:
    """open-r1/DAPO-Math-17k-Processed: `prompt` is the problem text, `solution` the gold answer."""
    problem = _scalar(_require(_get(row, "prompt"), "prompt", row), "prompt")
    answer = _scalar(_require(_get(row, "solution"), "solution", row), "solution", golds=True)
    idx = _get(row, "data_source_index", "index", default=None)
    return {"id": str(idx if idx is not None else n), "problem": str(problem).strip(),
            "answer": answer_text(answer), "solution": "", "subject": "", "level": 0}


def _is_number(text: str) -> bool:
    """What the official SFT filter keeps: `pd.to_numeric(..., errors="coerce").notnull()`."""
    text = str(text).strip()
    try:
        # float() also takes "1_000" and non-ASCII digits, which pandas does not
        return text.isascii() and "_" not in text and not math.isnan(float(text))
    except ValueError:
        return False


def _omr_mini(row: dict, n: int) -> dict | None:
    """unsloth/OpenMathReasoning-mini (split cot) as the official SFT stage uses it: rows whose
    `expected_answer` is a number; `solution` is the assistant turn after the generation prompt
    `<start_working_out>`: the worked solution (its `<think>` tags removed), `<end_working_out>`, then the
    answer between `<SOLUTION></SOLUTION>`. Other rows: None (skipped, and counted by `iter_records`)."""
    answer = str(_scalar(_require(_get(row, "expected_answer"), "expected_answer", row), "expected_answer"))
    if not _is_number(answer):
        return None
    problem = str(_scalar(_require(_get(row, "problem"), "problem", row), "problem"))
    thoughts = str(_scalar(_require(_get(row, "generated_solution"), "generated_solution", row),
                           "generated_solution"))
    thoughts = thoughts.replace("<think>", "").replace("</think>", "").strip()
    return {"id": str(n), "problem": problem, "answer": answer,
            "solution": thoughts + REASONING_END + SOLUTION_START + answer + SOLUTION_END,
            "subject": str(_get(row, "problem_type", default="") or ""), "level": 0}


def _generic(row: dict, n: int) -> dict:
    """MATH-500 / AIME / AMC / Minerva: the common field-name variants, case-insensitively."""
    problem = _scalar(_require(_get(row, "problem", "question", "prompt"), "problem", row), "problem")
    solution = str(_scalar(_get(row, "solution", default="") or "", "solution"))
    answer = _get(row, "answer", "final_answer", "gold", "ground_truth", "target")
    if answer is not None:
        answer = _scalar(answer, "answer", golds=True)
    if (answer is None or answer_text(answer) == "") and solution:
        answer = last_boxed(solution)  # Minerva-style rows keep the answer in the solution
    answer = _require(answer_text(answer) if answer is not None else None, "answer", row)
    level = _get(row, "level", default=0)
    if isinstance(level, str):
        digits = re.findall(r"\d+", level)
        level = int(digits[0]) if digits else 0
    return {
        "id": str(_get(row, "unique_id", "id", "idx", "problem_id", default=n)),
        "problem": str(problem).strip(),
        "answer": answer,
        "solution": solution,
        "subject": str(_get(row, "subject", "type", default="") or ""),
        "level": int(level or 0),
    }


SPECS: dict[str, SourceSpec] = {
    s.name: s
    for s in [
        SourceSpec(
            "dapo_math_17k", "BytedTsinghua-SIA/DAPO-Math-17k", ("data/dapo-math-17k.parquet",),
            "train", "prompt (list of {role, content}), reward_model.ground_truth, "
            "extra_info.index", _dapo, "DAPO-Math-17k (training prompts, integer answers)."),
        SourceSpec(
            "dapo_math_17k_en", "open-r1/DAPO-Math-17k-Processed", ("en/train-00000-of-00001.parquet",),
            "train", "prompt (the problem text), solution (the gold answer)", _dapo_processed,
            "DAPO-Math-17k-Processed, config en (about 14.1k English problems): the official SAGE code's "
            "training set."),
        SourceSpec(
            "openmathreasoning_mini", "unsloth/OpenMathReasoning-mini", ("data/cot-00000-of-00001.parquet",),
            "cot", "problem, generated_solution, expected_answer (rows with a numeric one are kept)",
            _omr_mini, "OpenMathReasoning-mini, split cot: the official SFT stage's data (Qwen2.5-Math-7B)."),
        SourceSpec(
            "math500", "HuggingFaceH4/MATH-500", ("test.jsonl",), "test",
            "problem, solution, answer, subject, level, unique_id", _generic,
            "MATH-500: the 500-problem MATH test subset of 'Let's Verify Step by Step'."),
        SourceSpec(
            "aime2024", "Maxwell-Jia/AIME_2024", ("aime_2024_problems.parquet",), "test",
            "ID, Problem, Solution, Answer (any case; also id/problem/solution/answer)",
            _generic, "AIME 2024 I and II (30 problems)."),
        SourceSpec(
            "aime2025", "math-ai/aime25", ("test.jsonl",), "test",
            "problem (or question), answer, id", _generic, "AIME 2025 I and II (30 problems)."),
        SourceSpec(
            "aime_2024_2025", "GAIR-NLP/AIME-Preview",
            ("eval/data/aime/test2024.jsonl", "eval/data/aime/test2025-I.jsonl",
             "eval/data/aime/test2025-II.jsonl"), "test",
            "id, problem, answer", _generic,
            "AIME 2024 and 2025 pooled (60 problems), as the official SAGE evaluation reads them.",
            url_base="https://raw.githubusercontent.com/GAIR-NLP/AIME-Preview/main"),
        SourceSpec(
            "amc23", "math-ai/amc23", ("test-00000-of-00001.parquet",), "test",
            "question (or problem), answer (a float such as 27.0), id", _generic, "AMC 2023 (40 problems)."),
        SourceSpec(
            "minerva_math", "math-ai/minervamath", ("test.jsonl",), "test",
            "question (or problem), answer (or gold / final_answer; else the solution's last "
            "\\boxed{}), solution", _generic, "Minerva Math (272 STEM problems)."),
    ]
}


# ----------------------------------------------------------------------------- reading files


def read_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based row number, row dict) from a parquet, jsonl or json-array file."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        n = 0
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataFormatError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:120]})") from None
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield n, row
        return
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".json":
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}: not valid JSON ({e})") from e
            if isinstance(rows, dict):  # {"data": [...]} style
                rows = next((v for v in rows.values() if isinstance(v, list)), [rows])
            for n, row in enumerate(rows, 1):
                yield n, row
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}: row {n}: not valid JSON ({e.msg})") from e


def records_from_file(spec: SourceSpec, path: Path) -> Iterator[dict]:
    """Records of the shared schema from one file; a bad row names the file and the row."""
    for n, row in read_rows(path):
        if not isinstance(row, dict):
            raise DataFormatError(f"{path}: row {n}: expected an object, got {type(row).__name__}")
        lowered = {str(k).lower(): v for k, v in row.items()}
        try:
            rec = spec.to_record(lowered, n)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise DataFormatError(
                f"{path}: row {n}: {msg}; expected fields for {spec.name}: {spec.fields}"
            ) from e
        if rec is not None:
            rec["source"] = spec.name
        yield rec


def iter_records(spec: SourceSpec, files: list[Path]) -> Iterator[tuple[str, dict]]:
    """(unique key, record) over `files`; a repeated (problem, answer) is kept once.

    DAPO-Math-17k's parquet repeats each of its ~17k prompts many times; the repeats would
    only reweight the training distribution.
    """
    seen_content: set[tuple[str, str]] = set()
    seen_ids: set[str] = set()
    for path in files:
        rows = skipped = 0
        for rec in records_from_file(spec, path):
            rows += 1
            if rec is None:  # a row the release's own filter drops (e.g. OMR-mini's non-numeric answers)
                skipped += 1
                continue
            content = (rec["problem"], rec["answer"])
            if content in seen_content:
                continue
            seen_content.add(content)
            if rec["id"] in seen_ids:  # same id, different problem: keep both, ids stay unique
                rec["id"] = f"{rec['id']}#{len(seen_ids)}"
            seen_ids.add(rec["id"])
            yield rec["id"], rec
        if rows == 0:
            raise DataFormatError(f"{path}: no rows (an empty {spec.name} file)")
        if skipped:
            log.info("%s: %d of %d rows skipped by %s's filter (%s)", path, skipped, rows, spec.name, spec.fields)
        if skipped == rows:
            raise DataFormatError(f"{path}: all {rows} rows fail {spec.name}'s filter ({spec.fields})")


def decode_record(rec: Mapping[str, Any]) -> dict:
    """A record read back from TFDS (bytes, numpy scalars) as plain `str` / `int` values."""
    out = {}
    for k, v in rec.items():
        if isinstance(v, (bytes, np.bytes_)):
            v = bytes(v).decode("utf-8")
        elif isinstance(v, np.ndarray) and v.shape == ():
            v = v.item()
            v = v.decode("utf-8") if isinstance(v, bytes) else v
        elif isinstance(v, np.generic):
            v = v.item()
        out[k] = v
    return out
