"""pass@k evaluation of one or several models on verifiable benchmarks, resumable.

`evaluate_models` samples `n` completions per problem from each model (through the `Generator`
seam, which the concrete JAX sampler implements), verifies them with a reward function, stores
raw per-sample results in `DIR/eval/results.json` after every batch, and from those computes
pass@k, mean@n, maj@k, the SAGE diagnostics (distinct correct answers / completions, token
entropy, new support over the base model) with bootstrap CIs, a Markdown table and plots.

A rerun with the same `DIR` skips every finished (model, benchmark, problem) and loads no model
whose results are complete; a rerun whose sampling settings differ refuses to mix results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
from tqdm.auto import tqdm

from sage_jax.eval import metrics as em
from sage_jax.eval.storage import (SCHEMA_VERSION, SettingsMismatchError, callable_name, load_results,
                                   results_path, save_results)
from sage_jax.eval.summary import summarize
from sage_jax.rewards.boxed import extract_boxed_answer, normalize_whitespace
from sage_jax.sampling import Completion

log = logging.getLogger(__name__)

# Settings that decide what the stored samples are: a rerun must match them exactly.
# `problems_per_batch` is among them because it decides the seed of each batch.
SAMPLING_KEYS = (
    "temperature", "top_p", "max_tokens", "seed", "problems_per_batch", "correct_threshold",
    "sampler",
)


class Problem(NamedTuple):
    """One benchmark problem: `prompt` is the final text given to the model (template applied)."""

    id: str
    prompt: str
    answer: str


class Generator(Protocol):
    """Samples completions; built by a `ModelFactory` from the run's `EvalSettings`.

    It samples with `settings.temperature`, `top_p`, `max_tokens` and `sampler`, and derives the
    stream of prompt `i` from `(seed, i)` (e.g. `jax.random.fold_in`). An optional `close()` is
    called when the model is done, before the next model loads.
    """

    def generate(self, prompts: list[str], n: int, seed: int) -> list[list[Completion]]:
        """`n` completions per prompt (outer list aligned with `prompts`), deterministic in `seed`."""
        ...


# Builds a model's generator (loads weights, compiles the sampler) only when it has work to do.
# It receives the settings so that every model samples with the same temperature, top-p, etc.
ModelFactory = Callable[["EvalSettings"], Generator]
RewardFn = Callable[[list[str], list[str]], np.ndarray]
AnswerFn = Callable[[str], "str | None"]
# Labels a completion with the solution procedure it follows (None: none recognised), e.g.
# `sage_jax.data.strategies.strategy_of`; evaluations with one count distinct correct procedures.
StrategyFn = Callable[[str], "str | None"]


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Sampling and statistics settings; the `SAMPLING_KEYS` and `n` are fixed per results dir."""

    n: int = 16  # samples per problem
    n_per_benchmark: Mapping[str, int] = dataclasses.field(default_factory=dict)  # overrides n
    temperature: float = 0.6  # sampling temperature
    top_p: float = 0.95  # nucleus mass
    max_tokens: int = 1024  # completion tokens at most
    seed: int = 0  # base seed; each batch's seed derives from it, the benchmark and problem ids
    problems_per_batch: int = 8  # prompts per generate call (results saved after each)
    correct_threshold: float = 0.5  # a sample is correct when its reward >= this
    sampler: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # e.g. top_k, min_p
    base_model: str | None = None  # reference of "new support"; None = the first model
    bootstrap_resamples: int = 1000  # resamples of problems for the CIs
    ci_level: float = 0.95  # confidence level of the intervals
    stat_seed: int = 0  # seeds the bootstrap and the maj@k subsets
    maj_resamples: int = 256  # random subsets per (problem, k) for maj@k when not exact

    def n_for(self, benchmark: str) -> int:
        """Samples per problem of `benchmark`."""
        return int(self.n_per_benchmark.get(benchmark, self.n))

    def to_json(self) -> dict[str, Any]:
        """The settings as stored (JSON round-tripped, so tuples compare equal to stored lists)."""
        d = dataclasses.asdict(self)
        d["n_per_benchmark"] = dict(self.n_per_benchmark)
        d["sampler"] = dict(self.sampler)
        return json.loads(json.dumps(d))


# --------------------------------------------------------------------------- storage


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _check_compatible(
    results: dict, settings: EvalSettings, benchmarks: Mapping[str, Sequence[Problem]],
    sources: Mapping[str, str], verifier: Mapping[str, str],
) -> None:
    """Raise SettingsMismatchError naming whatever differs between stored and requested runs."""
    stored = results["settings"]
    current = settings.to_json()
    for key in SAMPLING_KEYS:
        if stored.get(key) != current[key]:
            raise SettingsMismatchError(
                f"setting '{key}' differs: results.json has {stored.get(key)!r}, this run asks "
                f"{current[key]!r}; results would mix, so evaluate into another directory"
            )
    for key, name in verifier.items():
        if results["verifier"].get(key) != name:
            raise SettingsMismatchError(
                f"'{key}' differs: results.json was verified by {results['verifier'].get(key)!r}, "
                f"this run uses {name!r}"
            )
    for model, entry in results["models"].items():
        if model in sources and entry.get("source") not in (None, sources[model]):
            raise SettingsMismatchError(
                f"model '{model}' was evaluated from {entry['source']!r}, this run names "
                f"{sources[model]!r}"
            )
        for bench, bentry in entry["benchmarks"].items():
            if bench not in benchmarks:
                continue
            if bentry["n"] != settings.n_for(bench):
                raise SettingsMismatchError(
                    f"setting 'n' differs for {model}/{bench}: results.json has {bentry['n']}, "
                    f"this run asks {settings.n_for(bench)}"
                )
            by_id = {p.id: p for p in benchmarks[bench]}
            for pid, rec in bentry["problems"].items():
                p = by_id.get(pid)
                if p is None:
                    continue
                if rec["prompt_sha1"] != _sha1(p.prompt) or rec["answer"] != p.answer:
                    raise SettingsMismatchError(
                        f"problem '{pid}' of {bench} changed its prompt or answer since "
                        f"{model} was evaluated on it"
                    )


def _validate_inputs(
    models: Mapping, benchmarks: Mapping[str, Sequence[Problem]], settings: EvalSettings
) -> None:
    if not models:
        raise ValueError("evaluate_models: no models given")
    if not benchmarks:
        raise ValueError("evaluate_models: no benchmarks given")
    for bench, problems in benchmarks.items():
        if not problems:
            raise ValueError(f"benchmark '{bench}' has no problems")
        ids = [p.id for p in problems]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"benchmark '{bench}' repeats problem id {dup!r}")
        if settings.n_for(bench) < 1:
            raise ValueError(f"n must be >= 1 for benchmark '{bench}'")
    if settings.problems_per_batch < 1:
        raise ValueError("problems_per_batch must be >= 1")
    if settings.base_model is not None and settings.base_model not in models:
        raise ValueError(f"base_model {settings.base_model!r} is not among the models {list(models)}")


# --------------------------------------------------------------------------- sampling


def _batches(problems: Sequence[Problem], size: int) -> list[list[Problem]]:
    """Fixed chunks of the benchmark, the same for every model (so every model sees the same seeds)."""
    return [list(problems[i : i + size]) for i in range(0, len(problems), size)]


def _pending(entry: dict | None, problems: Sequence[Problem]) -> list[Problem]:
    done = entry["problems"] if entry else {}
    return [p for p in problems if p.id not in done]


def _problem_record(
    problem: Problem, seed: int, completions: Sequence[Completion], rewards_G: np.ndarray,
    threshold: float, answer_fn: AnswerFn, strategy_fn: StrategyFn | None = None,
) -> dict:
    """Raw per-sample results of one problem (what results.json keeps; metrics derive from it)."""
    correct_G = rewards_G >= threshold
    texts = [normalize_whitespace(c.text) for c in completions]
    answers = [answer_fn(c.text) for c in completions]
    extra = {"strategies": [strategy_fn(c.text) for c in completions]} if strategy_fn is not None else {}
    return {
        "answer": problem.answer,
        "prompt_sha1": _sha1(problem.prompt),
        "seed": seed,
        "num_correct": int(correct_G.sum()),
        "correct": [int(x) for x in correct_G],
        "rewards": [None if (r := em.finite_or_none(x)) is None else round(r, 6) for x in rewards_G],
        "num_tokens": [int(c.num_tokens) for c in completions],
        "mean_entropy": [
            None if (e := em.finite_or_none(c.mean_entropy)) is None else round(e, 6)
            for c in completions
        ],
        "answers": answers,
        # Texts are not stored (too large at n = 1024), so their diversity is counted here.
        "distinct_correct_completions": len({t for t, ok in zip(texts, correct_G) if ok}),
        **extra,
    }


def _sample_benchmark(
    generator: Generator, model: str, bench: str, problems: Sequence[Problem], entry: dict,
    reward_fn: RewardFn, answer_fn: AnswerFn, settings: EvalSettings,
    save: Callable[[], None], progress: bool, strategy_fn: StrategyFn | None = None,
) -> None:
    """Sample, verify and store every pending problem of one benchmark, saving after each batch."""
    n = entry["n"]
    todo_total = len(_pending(entry, problems))
    bar = tqdm(total=todo_total, desc=f"eval {model}/{bench}", unit="problem", disable=not progress)
    with bar:
        for batch in _batches(problems, settings.problems_per_batch):
            todo = _pending(entry, batch)
            if not todo:
                continue
            seed = em.stable_seed(settings.seed, bench, [p.id for p in batch])
            outputs = generator.generate([p.prompt for p in todo], n, seed)
            if len(outputs) != len(todo) or any(len(o) != n for o in outputs):
                raise ValueError(
                    f"generator of '{model}' returned {[len(o) for o in outputs]} completions "
                    f"for {len(todo)} prompts, expected {n} each"
                )
            texts = [c.text for out in outputs for c in out]
            golds = [p.answer for p, out in zip(todo, outputs) for _ in out]
            rewards = np.asarray(reward_fn(texts, golds), np.float32).reshape(-1)
            if rewards.shape != (len(texts),):
                raise ValueError(
                    f"reward_fn returned shape {rewards.shape} for {len(texts)} completions")
            for j, (p, out) in enumerate(zip(todo, outputs)):
                rewards_G = rewards[j * n : (j + 1) * n]
                entry["problems"][p.id] = _problem_record(
                    p, seed, out, rewards_G, settings.correct_threshold, answer_fn, strategy_fn
                )
            save()
            bar.update(len(todo))


# --------------------------------------------------------------------------- entry point


def evaluate_models(
    models: Mapping[str, ModelFactory],
    benchmarks: Mapping[str, Sequence[Problem]],
    reward_fn: RewardFn,
    settings: EvalSettings,
    workdir: str | os.PathLike,
    answer_fn: AnswerFn = extract_boxed_answer,
    sources: Mapping[str, str] | None = None,
    progress: bool = True,
    write_report: bool = True,
    is_writer: bool = True,
    strategy_fn: StrategyFn | None = None,
) -> dict:
    """Evaluate every model on every benchmark into `workdir/eval/`; returns the results dict.

    `models` maps a name to a factory called (once, lazily) only when that model has unfinished
    problems; `sources` optionally records where each model came from (checkpoint path, HF dir)
    and refuses a rerun that names another source for the same model. Writes `results.json`
    (raw samples after each batch, then the `summary`), `results.md`, `pass_at_k.png` and
    `pass1_vs_passk.png`. Exceptions of the generator propagate after the finished batches are
    saved, so an interrupted run resumes where it stopped. In a multi-process job pass
    `is_writer=(jax.process_index() == 0)`: every process samples, only the writer writes files.
    With `strategy_fn`, every sample's procedure is stored and `distinct_correct_strategies` (distinct
    procedures among a problem's correct samples) joins the metrics.
    """
    _validate_inputs(models, benchmarks, settings)
    sources = dict(sources or {})
    verifier = {"reward_fn": callable_name(reward_fn), "answer_fn": callable_name(answer_fn)}
    if strategy_fn is not None:
        verifier["strategy_fn"] = callable_name(strategy_fn)
    results = load_results(workdir)
    if results is None:
        results = {"schema_version": SCHEMA_VERSION, "settings": settings.to_json(),
                   "verifier": verifier, "models": {}, "summary": None}
    else:
        _check_compatible(results, settings, benchmarks, sources, verifier)
        results["settings"] = settings.to_json()  # only non-sampling settings can have changed

    def save() -> None:
        if is_writer:
            save_results(results, workdir)

    for model, factory in models.items():
        entry = results["models"].setdefault(model, {"source": sources.get(model), "benchmarks": {}})
        if entry.get("source") is None and model in sources:
            entry["source"] = sources[model]
        for bench in benchmarks:
            entry["benchmarks"].setdefault(bench, {"n": settings.n_for(bench), "problems": {}})
        if not any(_pending(entry["benchmarks"][b], benchmarks[b]) for b in benchmarks):
            continue  # finished: the model is never loaded
        results["summary"] = None  # stale once new samples arrive
        generator = factory(settings)
        try:
            for bench, problems in benchmarks.items():
                _sample_benchmark(generator, model, bench, problems, entry["benchmarks"][bench],
                                  reward_fn, answer_fn, settings, save, progress, strategy_fn)
        finally:
            close = getattr(generator, "close", None)
            if callable(close):
                close()
            del generator  # free device memory before the next model loads

    results["summary"] = summarize(results, list(models), benchmarks, settings)
    save()
    if write_report and is_writer:
        from sage_jax.eval import report as eval_report  # matplotlib only when reporting

        eval_dir = results_path(workdir).parent
        eval_report.write_reports(results["summary"], eval_dir, results["settings"])
    return results
