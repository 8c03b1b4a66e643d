"""One job of the miniature study, run in its own process: `python worker.py STAGE SPEC.json`.

Stages (the driver `run.py` writes SPEC.json and starts one process per job, so each job's memory is
freed when it ends and a crash stays in its own log):

- `calibrate`: samples the tiny base on validation problems (the last ones of the training split) and
  writes the per-token entropy distribution and the branch threshold chosen by the stated rule.
- `train`: one RL run, `sage_jax.train.loop.run(configs/tiny.py + overrides, workdir)` (resumes from its
  checkpoints when rerun).
- `eval`: n samples per held-out problem from one policy via `sage_jax.eval.evaluate.evaluate_models`
  (resumable per batch) with `strategy_fn=strategies.strategy_of`, so every sample's procedure is stored;
  raw per-sample results in `workdir/eval/results.json`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # this checkout's sage_jax, not whichever one the venv has installed
TINY_CONFIG = os.path.join(REPO, "configs", "tiny.py")
BENCH = "procedural_arithmetic:test"
BUILDER_CONFIG = "strategies"  # configs/tiny.py's data.builder_config (builders.STRATEGIES_TASK)


def tiny_config():
    """`configs/tiny.py:get_config()` (configs/ is not a package, so load it by path)."""
    spec = importlib.util.spec_from_file_location("sage_miniature_tiny_config", TINY_CONFIG)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def apply_overrides(c, overrides: dict):
    """Set dotted fields (`"sage.branch.threshold": 0.5`) on a ConfigDict; unknown fields are an error."""
    for key, value in overrides.items():
        *path, leaf = key.split(".")
        parent = c
        for part in path:
            parent = parent[part]
        if leaf not in parent:
            raise KeyError(f"config has no field {key!r}")
        parent[leaf] = value
    return c


def load_problems(data_dir: str, split: str, start: int, count: int, template: str, tokenizer,
                  end_of_split: bool = False):
    """(id, prompt, answer) of records [start, start + count) of `split` of the procedural `strategies` task;
    with `end_of_split`, the range must end where the split ends."""
    from sage_jax.data import builders
    from sage_jax.data.sources import decode_record
    from sage_jax.data.templates import format_prompt
    src = builders.load_split("procedural_arithmetic", split, data_dir=data_dir, config=BUILDER_CONFIG)
    if start + count > len(src):
        raise ValueError(f"{split} has {len(src)} problems, asked for [{start}, {start + count})")
    if end_of_split and start + count != len(src):
        raise ValueError(f"{split} has {len(src)} problems; [{start}, {start + count}) is not its end "
                         "(methods.TRAIN_SIZE or TEST_SIZE is out of date)")
    out = []
    for i in range(start, start + count):
        r = decode_record(src[i])
        out.append((r["id"], format_prompt(r["problem"], template, tokenizer, None), r["answer"]))
    return out


def model_config(path):
    from sage_jax.models import hf
    from sage_jax.models.config import ModelConfig
    return ModelConfig.from_hf_dir(hf.resolve_path(path))[0]


# ------------------------------------------------------------------------------------------ calibrate
def calibrate(spec: dict) -> dict:
    """Per-token entropy of the base's completions on the validation problems; threshold = quantile."""
    import jax
    from flax import nnx

    from sage_jax.models import hf
    from sage_jax.sampling import SamplingConfig, left_pad, make_generate_fn

    c = tiny_config()  # the study's constants must match what every run trains and is evaluated with
    if (c.data.builder_config, c.rollout.max_new_tokens, c.rollout.temperature) != (
            BUILDER_CONFIG, spec["max_new_tokens"], spec["temperature"]):
        raise ValueError(f"configs/tiny.py has data.builder_config={c.data.builder_config!r}, rollout.max_new_tokens="
                         f"{c.rollout.max_new_tokens}, rollout.temperature={c.rollout.temperature}; the study "
                         f"calibrates with {BUILDER_CONFIG!r}, {spec['max_new_tokens']}, {spec['temperature']} "
                         "(update worker.BUILDER_CONFIG / methods.MAX_NEW_TOKENS)")
    tok = hf.load_tokenizer(spec["model_path"])
    probs = load_problems(spec["data_dir"], "train", spec["val_start"], spec["val_count"], spec["template"], tok,
                          end_of_split=True)
    # prepares both splits once, and checks the test split's size (methods.TEST_SIZE, the power estimate's cap)
    load_problems(spec["data_dir"], "test", spec["test_size"] - 1, 1, spec["template"], tok, end_of_split=True)
    model, _ = hf.load(spec["model_path"])
    eos, pad = hf.sampling_ids(tok, model_config(spec["model_path"]))  # as training and evaluation take them
    cfg = SamplingConfig(max_new_tokens=spec["max_new_tokens"], temperature=spec["temperature"], eos_ids=eos,
                         pad_id=pad)
    graphdef, state = nnx.split(model)
    fn = jax.jit(make_generate_fn(graphdef, cfg))
    rows = [tok(p, add_special_tokens=False)["input_ids"] for _, p, _ in probs for _ in range(spec["n"])]
    ents, bs = [], spec["batch_size"]
    key = jax.random.key(spec["seed"])
    for b, start in enumerate(range(0, len(rows), bs)):
        chunk = rows[start:start + bs]
        toks, mask = left_pad(chunk + [chunk[-1]] * (bs - len(chunk)), pad)
        res = jax.device_get(fn(state, toks, mask, jax.random.fold_in(key, b)))
        m = res.mask_BxT[:len(chunk)].astype(bool)
        ents.append(np.asarray(res.entropy_BxT[:len(chunk)])[m])
    h = np.concatenate(ents).astype(np.float64)
    q = spec["quantile"]
    edges = np.linspace(0.0, max(float(h.max()), 1.3) * 1.0001, 61)
    counts, _ = np.histogram(h, bins=edges)
    qs = [0.1, 0.25, 0.5, 0.75, 0.8, 0.9, 0.95, 0.99]
    threshold = float(np.quantile(h, q))
    return {
        "rule": spec["rule"],
        "quantile": q,
        "threshold": round(threshold, 4),
        "paper_threshold": 1.2,
        "num_problems": len(probs), "n": spec["n"], "num_tokens": int(h.size),
        "val_problems": f"train[{spec['val_start']}:{spec['val_start'] + spec['val_count']}]",
        "mean": float(h.mean()),
        "quantiles": {f"p{round(100 * x)}": float(np.quantile(h, x)) for x in qs},
        "share_above_threshold": float(np.mean(h > threshold)),
        "share_above_paper_threshold": float(np.mean(h > 1.2)),
        "hist": {"edges": [round(float(e), 5) for e in edges], "counts": counts.tolist()},
        "spec": spec,
    }


# ------------------------------------------------------------------------------------------ train
def train(spec: dict) -> dict:
    from sage_jax.train import loop as train_lib
    c = apply_overrides(tiny_config(), spec["overrides"])
    t0 = time.time()
    summary = train_lib.run(c, spec["workdir"])
    if summary.get("preempted") or summary.get("end_step", 0) < c.max_steps or not os.path.isdir(
            os.path.join(spec["workdir"], "export_hf")):
        print(f"train: stopped at step {summary.get('end_step')} of {c.max_steps} (checkpoint saved); "
              "rerun to resume", file=sys.stderr)
        sys.exit(3)  # no result file: the driver reruns (resumes) this job next time
    return {"summary": summary, "wall_s": time.time() - t0}


# ------------------------------------------------------------------------------------------ eval
def evaluate(spec: dict) -> dict:
    from sage_jax.data.strategies import strategy_of
    from sage_jax.eval.benchmarks import sampling_config
    from sage_jax.eval.evaluate import EvalSettings, Problem, evaluate_models
    from sage_jax.models import hf
    from sage_jax.rewards.verifiers import make_reward_fn
    from sage_jax.sampling import TextSampler

    path = spec["model_path"]
    tok = hf.load_tokenizer(path)
    probs = [Problem(*p) for p in load_problems(spec["data_dir"], "test", 0, spec["num_problems"],
                                                 spec["template"], tok)]
    s = spec["settings"]
    settings = EvalSettings(n=s["n"], temperature=s["temperature"], top_p=s["top_p"], max_tokens=s["max_tokens"],
                            seed=s["seed"], problems_per_batch=s["problems_per_batch"])

    def factory(st: EvalSettings):  # the sampler training's evaluation and mode=eval build (eval.benchmarks)
        model, _ = hf.load(path)
        return TextSampler(model, tok, sampling_config(st, tok, model_config(path)), batch_size=s["batch_size"])

    t0 = time.time()
    evaluate_models({spec["name"]: factory}, {BENCH: probs}, make_reward_fn(spec["reward"]), settings,
                    spec["workdir"], sources={spec["name"]: path}, progress=spec.get("progress", False),
                    write_report=False, strategy_fn=strategy_of)
    return {"wall_s": time.time() - t0, "problem_ids": [p.id for p in probs]}


STAGES = {"calibrate": calibrate, "train": train, "eval": evaluate}


def main(argv):
    stage, spec_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.time()
    out = STAGES[stage](spec)
    out.setdefault("wall_s", time.time() - t0)
    tmp = spec["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, default=str)
    os.replace(tmp, spec["result"])  # the job's "finished" marker


if __name__ == "__main__":
    main(sys.argv)
