"""The evaluation problems a config names (`eval.benchmarks`), for in-training evaluation and `mode=eval` alike.

`eval.num_problems` caps the problems per benchmark; 0 means every problem of the split, in both.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from sage_jax.eval.evaluate import EvalSettings, Problem


def eval_template(c) -> str:
    """The evaluation prompt's template: eval.template, else the training one (data.template)."""
    return c.eval.get("template") or c.data.template


def benchmarks_from_config(c, workdir: str, tokenizer) -> dict[str, list[Problem]]:
    from sage_jax.data import builders
    from sage_jax.data.sources import decode_record
    from sage_jax.data.templates import format_prompt

    out = {}
    data_dir = c.data.data_dir or os.path.join(workdir, "tfds")
    for spec in [b.strip() for b in c.eval.benchmarks.split(",") if b.strip()]:
        name, _, split = spec.partition(":")
        cfg = c.data.builder_config if name == "procedural_arithmetic" else None
        src = builders.load_split(name, split or "test", data_dir=data_dir, manual_dir=c.data.manual_dir or None,
                                  config=cfg)
        n = len(src) if c.eval.num_problems <= 0 else min(c.eval.num_problems, len(src))
        template = eval_template(c)
        probs = []
        for i in range(n):
            r = decode_record(src[i])
            probs.append(Problem(r["id"], format_prompt(r["problem"], template, tokenizer, c.data.system_prompt),
                                 r["answer"]))
        out[spec] = probs
    return out


def strategy_fn_for(benchmarks) -> Callable[[str], str | None] | None:
    """The procedure labeller of the procedural task (`strategies.strategy_of`) when a benchmark is that task,
    so evaluations count distinct correct procedures; None for other benchmarks."""
    if any(b.partition(":")[0] == "procedural_arithmetic" for b in benchmarks):
        from sage_jax.data.strategies import strategy_of
        return strategy_of
    return None


def settings_from_config(c) -> EvalSettings:
    """The sampling settings of `eval.*`, the same for in-training evaluation and `mode=eval`. `eval.stop_strings`
    (its own list: the official evaluation generates until EOS where its training stops at `</SOLUTION>`) is
    stored with them, so results sampled under other stop strings are never mixed."""
    stops = list(string_list(c.eval.stop_strings, "eval.stop_strings"))
    return EvalSettings(n=c.eval.n, temperature=c.eval.temperature, top_p=c.eval.top_p,
                        max_tokens=c.eval.max_new_tokens, seed=c.seed,
                        problems_per_batch=max(1, c.eval.batch_size // c.eval.n),
                        sampler={"stop_strings": stops} if stops else {})


def string_list(value, field: str) -> tuple[str, ...]:
    """A config's stop-string field as a tuple of non-empty strings (a lone string is one)."""
    strings = () if not value else ((value,) if isinstance(value, str) else tuple(value))
    if any(not isinstance(x, str) or not x for x in strings):
        raise ValueError(f"{field}={strings!r}: each must be a non-empty string")
    return strings


def sampling_config(settings: EvalSettings, tokenizer, model_cfg, decode_segments: int = 4):
    """The `SamplingConfig` an evaluation samples one model with: the settings' temperature, top-p, length and
    stop strings (compiled for this model's tokenizer), the model's stop and pad ids (`hf.sampling_ids`)."""
    from sage_jax.models import hf
    from sage_jax.sampling import SamplingConfig
    from sage_jax.stop_strings import StopStrings
    extra = dict(settings.sampler)
    stops = tuple(extra.pop("stop_strings", ()))
    eos_ids, pad_id = hf.sampling_ids(tokenizer, model_cfg)
    stop = StopStrings.for_tokenizer(stops, tokenizer, model_cfg.vocab_size) if stops else None
    return SamplingConfig(max_new_tokens=settings.max_tokens, temperature=settings.temperature,
                          top_p=settings.top_p, eos_ids=eos_ids, pad_id=pad_id, stop=stop,
                          decode_segments=decode_segments, **extra)
