"""Entry point: `python -m sage_jax.main --config=configs/<name>.py[:arg] --workdir=DIR [--config.x.y=v]`.

`config.mode` selects sft, rl or eval. Errors a user can fix (a bad config field, a missing file, a
checkpoint that does not match) print one line naming the field / file and exit with status 2.
"""

from __future__ import annotations

import json
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file (configs/*.py[:arg])",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics.jsonl, eval/", required=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    from sage_jax.config_lib import ConfigValidationError
    from sage_jax.data.sources import DataFormatError, ManualFileMissingError
    from sage_jax.models.config import ConfigError
    from sage_jax.models.hf import CheckpointError
    from sage_jax.models.safetensors_io import SafetensorsError
    return (ConfigValidationError, ConfigError, CheckpointError, SafetensorsError, DataFormatError,
            ManualFileMissingError)


def _report(summary: dict) -> None:
    for when in ("before", "after"):
        if when in summary:
            parts = ", ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in summary[when].items() if "pass@" in k)
            print(f"{when:6s} training: {parts}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("before", "after")}))


def main(argv):
    del argv
    logging.getLogger("absl").setLevel(logging.WARNING)
    from sage_jax import distributed
    distributed.maybe_initialize()
    c = _CONFIG.value
    try:
        if c.mode == "eval":
            from sage_jax import eval_mode
            eval_mode.run(c, _WORKDIR.value)
        else:
            from sage_jax import train
            _report(train.run(c, _WORKDIR.value))
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
