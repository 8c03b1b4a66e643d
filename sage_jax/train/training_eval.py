"""Evaluation during training: the policy at a step, through the one evaluation path `mode=eval` takes.

The policy at step N is the model `step_<N>` of DIR/eval/results.json. Every evaluated step stays in that file: a
rerun (resume, or a restart of a finished run) samples nothing already there, and the summary compares every
step with the first one, paired over problems.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from sage_jax import config_lib
from sage_jax.eval.benchmarks import benchmark_problems, sampling_config, strategy_fn_for
from sage_jax.eval.evaluate import evaluate_models, load_results, save_results
from sage_jax.policy.state import TrainState, policy_model, policy_state
from sage_jax.sampling import TextSampler
from sage_jax.train.setup import Setup

log = logging.getLogger(__name__)


def check_prompt_positions(benchmarks, tokenizer, model_cfg, max_new_tokens: int, where: str) -> None:
    """The longest evaluation prompt plus `eval.max_new_tokens` fits the model's positions."""
    longest = max((len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]), b)
                  for b, probs in benchmarks.items() for p in probs)
    try:
        model_cfg.check_positions(longest[0] + max_new_tokens, f"the longest evaluation prompt ({longest[1]}: "
                                  f"{longest[0]} tokens) + eval.max_new_tokens={max_new_tokens}")
    except ValueError as e:
        raise config_lib.ConfigValidationError(f"{where}: {e}") from None


def read_benchmarks(s: Setup) -> dict:
    """The evaluation's problems (`EvalSpec`), their longest prompt checked against the model's positions: read
    before the model loads, so that an evaluation that cannot fit stops the run before anything is written."""
    benchmarks = benchmark_problems(s.spec.eval, s.spec.data, s.workdir, s.tokenizer)
    check_prompt_positions(benchmarks, s.tokenizer, s.model_cfg, s.spec.eval.settings.max_tokens,
                           f"model.path={s.spec.model.path}")
    return benchmarks


class TrainingEval:
    """`evaluator(step, state)` evaluates (or finishes evaluating) the policy at `step` on the run's `EvalSpec`."""

    def __init__(self, s: Setup, benchmarks: dict, graphdef):
        self.s, self.graphdef, self.ev = s, graphdef, s.spec.eval
        self.benchmarks = benchmarks  # read_benchmarks(s), before the model loads
        self.strategy_fn = strategy_fn_for(self.benchmarks)
        self._sampler: TextSampler | None = None

    def _generator(self, state: TrainState) -> TextSampler:
        if self._sampler is None:
            cfg = sampling_config(self.ev.settings, self.s.tokenizer, self.s.model_cfg, self.ev.decode_segments)
            self._sampler = TextSampler(policy_model(self.graphdef, state), self.s.tokenizer, cfg,
                                        batch_size=self.ev.batch_size, mesh=self.s.mesh)
        self._sampler.state = policy_state(state)  # read afresh: the step donates the state it is given
        return self._sampler

    def evaluated_steps(self) -> list[int]:
        results = load_results(self.s.workdir) or {"models": {}}
        return sorted(int(m[len("step_"):]) for m in results["models"] if m.startswith("step_"))

    def forget_after(self, step: int) -> None:
        """Drops the stored evaluations of steps after `step` (policies of a history that restarts)."""
        results = load_results(self.s.workdir)
        if results is None or jax.process_index() != 0:
            return
        drop = [m for m in results["models"] if m.startswith("step_") and int(m[len("step_"):]) > step]
        if drop:
            log.warning("dropping the stored evaluations of %s (no checkpoint of that history)", ", ".join(drop))
            for m in drop:
                del results["models"][m]
            results["summary"] = None
            save_results(results, self.s.workdir)

    def __call__(self, step: int, state: TrainState) -> dict[str, Any]:
        """Evaluates (or finishes evaluating) step `step`; returns the summary of every evaluated step."""
        def stored(_settings):  # a step evaluated earlier is complete, so this is never called
            raise RuntimeError("an earlier step's evaluation is incomplete; evaluate into a fresh workdir")

        steps = sorted(set(self.evaluated_steps()) | {step})
        models = {f"step_{t}": (lambda _settings: self._generator(state)) if t == step else stored for t in steps}
        results = evaluate_models(models, self.benchmarks, self.s.reward_fn, self.ev.settings, self.s.workdir,
                                  sources={f"step_{step}": f"training step {step}"},
                                  strategy_fn=self.strategy_fn, is_writer=jax.process_index() == 0,
                                  progress=self.s.spec.logging.progress and jax.process_index() == 0)
        return results["summary"]


def eval_metrics(summary: dict, step: int) -> dict[str, float]:
    """The metrics.jsonl row of one evaluated step: `eval/<metric>` (the mean over benchmarks when there
    are several, each benchmark also as `eval/<benchmark>/<metric>`)."""
    per_bench = summary["models"][f"step_{step}"]
    benches = list(summary["benchmarks"])
    out = {}
    if len(benches) > 1 and "average" in per_bench:
        out.update({f"eval/{k}": v["mean"] for k, v in per_bench["average"].items()})
    for b in benches:
        prefix = "eval/" if len(benches) == 1 else f"eval/{b}/"
        out.update({f"{prefix}{k}": v["mean"] for k, v in per_bench[b].items()})
    return {k: v for k, v in out.items() if v is not None}
