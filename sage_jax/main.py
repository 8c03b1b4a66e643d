"""Entry point: `python -m sage_jax.main --config=configs/<name>.py[:arg] --workdir=DIR [--config.x.y=v]`.

`config.mode` selects sft, rl or eval. Errors a user can fix (a bad config field, a missing file, a
checkpoint that does not match: `sage_jax.errors.UserError`) print one line naming the field / file and exit with
status 2 (3: a run stopped because its loss or gradient turned non-finite).
"""

from __future__ import annotations

import json
import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from sage_jax.errors import ConfigValidationError, UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file (configs/*.py[:arg])",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics.jsonl, eval/", required=True)


def _report(summary: dict) -> None:
    """The held-out evaluation before and after training with paired CIs, then the summary as one JSON line."""
    ev = summary.get("eval")
    if ev is not None and "before" in summary and "after" in summary:
        from sage_jax.eval import report as eval_report  # the CLI's heavy imports wait until flags parse
        first, last = "step_0", f"step_{summary['end_step']}"
        info = next(iter(ev["benchmarks"].values()))
        print(f"\nheld-out evaluation ({info['num_problems']} problems x n = {info['n']}; {first} = before "
              f"training, {last} = after):\n")
        print(eval_report.gain_table(ev, first, last))
    if "plot" in summary:
        print(f"\nreward and pass@k curves: {summary['plot']}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("before", "after", "eval")}))


def _check_workdir(workdir: str) -> None:
    """The run directory exists (made here) and takes files; else one line instead of a traceback later."""
    if workdir.startswith("gs://"):
        return  # object storage: Orbax and tf.io write there; nothing to probe with os
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigValidationError(f"--workdir={workdir} is a file, not a directory")
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_probe.{os.getpid()}")  # one per process: hosts share DIR
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigValidationError(f"--workdir={workdir}: cannot write there ({type(e).__name__}: "
                                    f"{e.strerror or e})") from None


def main(argv):
    del argv
    logging.getLogger("absl").setLevel(logging.WARNING)
    from sage_jax import distributed  # the CLI's heavy imports (JAX, the package) wait until flags parse
    distributed.maybe_initialize()
    c = _CONFIG.value
    try:
        _check_workdir(_WORKDIR.value)
        from sage_jax.train import eval_mode, loop
        if c.mode == "eval":
            eval_mode.run(c, _WORKDIR.value)
        else:
            _report(loop.run(c, _WORKDIR.value))
    except UserError as e:  # every error a user can fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def _override_error(argv: list[str]) -> str | None:
    """Names the first `--config.a.b=v` whose path the config file does not have (with a close match)."""
    import difflib
    import importlib.util
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    mod_spec = importlib.util.spec_from_file_location("_sage_jax_cli_config", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    cfg = module.get_config(arg or None)
    for a in argv:
        if not a.startswith("--config.") or "=" not in a:
            continue
        keys = a[len("--config."):].split("=", 1)[0].split(".")
        node, seen = cfg, "config"
        for k in keys:
            if keys[:2] == ["eval", "models"] and len(keys) > 2:
                return (f"--config.{'.'.join(keys)}: models cannot be added on the command line; use "
                        "--config.eval.model_list=NAME=DIR,NAME=DIR (or eval.models in a config file)")
            if not hasattr(node, "keys") or k not in node:
                close = difflib.get_close_matches(k, list(node.keys()) if hasattr(node, "keys") else [], n=1)
                hint = f" (did you mean {seen}.{close[0]}?)" if close else ""
                return f"--config.{'.'.join(keys)}: {seen} has no field {k!r}{hint}"
            node, seen = node[k], f"{seen}.{k}"
    return None


def _parse_flags(argv: list[str]):
    """absl's flag parsing, with a bad `--config...` flag reported in one line (exit 2), not a traceback."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is not None and not os.path.isfile(spec.partition(":")[0]):
        print(f"error: --config={spec}: no such config file", file=sys.stderr)
        sys.exit(2)
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001  (absl and ml_collections raise many kinds)
        try:
            msg = _override_error(argv)
        except Exception:  # noqa: BLE001  (the config file itself is broken: report the original error)
            msg = None
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        first = lines[0] if lines else type(e).__name__
        if "Error whilst parsing config file" in first and len(lines) > 1:
            # ml_collections wraps the config file's own error in a traceback text: its last line is the reason
            first = f"--config={spec}: {lines[-1]}"
        print(f"error: {msg or first}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
