"""The evaluation problems an `EvalSpec` names (`eval.benchmarks`) and the sampler each model samples them with,
for in-training evaluation and `mode=eval` alike.

`eval.num_problems` caps the problems per benchmark; 0 means every problem of the split, in both.
"""

from __future__ import annotations

from collections.abc import Callable

from sage_jax.data import builders
from sage_jax.data.sources import decode_record
from sage_jax.data.strategies import strategy_of
from sage_jax.data.templates import format_prompt
from sage_jax.eval.evaluate import EvalSettings, Problem
from sage_jax.models import hf
from sage_jax.sampling import SamplingConfig
from sage_jax.stop_strings import StopStrings


def benchmark_problems(ev, data, workdir: str, tokenizer) -> dict[str, list[Problem]]:
    """The problems of `ev.benchmarks` (an `EvalSpec`), at most `ev.num_problems` each (0 = all), each prompt in
    `ev.template` (with `data.system_prompt`); read from `data`'s TFDS dir and manual dir (a `DataSpec`)."""
    out = {}
    for spec in ev.benchmarks:
        name, _, split = spec.partition(":")
        cfg = data.builder_config if name == "procedural_arithmetic" else None
        src = builders.load_split(name, split or "test", data_dir=data.tfds_dir(workdir), manual_dir=data.manual_dir,
                                  config=cfg)
        n = len(src) if ev.num_problems <= 0 else min(ev.num_problems, len(src))
        probs = []
        for i in range(n):
            r = decode_record(src[i])
            probs.append(Problem(r["id"], format_prompt(r["problem"], ev.template, tokenizer, data.system_prompt),
                                 r["answer"]))
        out[spec] = probs
    return out


def strategy_fn_for(benchmarks) -> Callable[[str], str | None] | None:
    """The procedure labeller of the procedural task (`strategies.strategy_of`) when a benchmark is that task,
    so evaluations count distinct correct procedures; None for other benchmarks."""
    if any(b.partition(":")[0] == "procedural_arithmetic" for b in benchmarks):
        return strategy_of
    return None


def string_list(value, field: str) -> tuple[str, ...]:
    """A config's stop-string field as a tuple of non-empty strings (a lone string is one)."""
    strings = () if not value else ((value,) if isinstance(value, str) else tuple(value))
    if any(not isinstance(x, str) or not x for x in strings):
        raise ValueError(f"{field}={strings!r}: each must be a non-empty string")
    return strings


def sampling_config(settings: EvalSettings, tokenizer, model_cfg, decode_segments: int = 4):
    """The `SamplingConfig` an evaluation samples one model with: the settings' temperature, top-p, length and
    stop strings (compiled for this model's tokenizer), the model's stop and pad ids (`hf.sampling_ids`)."""
    extra = dict(settings.sampler)
    stops = tuple(extra.pop("stop_strings", ()))
    eos_ids, pad_id = hf.sampling_ids(tokenizer, model_cfg)
    stop = StopStrings.for_tokenizer(stops, tokenizer, model_cfg.vocab_size) if stops else None
    return SamplingConfig(max_new_tokens=settings.max_tokens, temperature=settings.temperature,
                          top_p=settings.top_p, eos_ids=eos_ids, pad_id=pad_id, stop=stop,
                          decode_segments=decode_segments, **extra)
