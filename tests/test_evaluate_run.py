"""End-to-end tests of `evaluate_models` with fake generators: known counts, resume, reports."""

import json
import re

import matplotlib.image
import numpy as np
import pytest

from sage_jax.eval import report as eval_report
from sage_jax.eval.evaluate import (EvalSettings, Problem, SettingsMismatchError, evaluate_models, load_results,
                                    results_path)
from sage_jax.rewards.boxed import extract_boxed_answer
from sage_jax.sampling import Completion


def numeric_reward(completions, answers):
    """Fake verifier: the last boxed answer equals the gold one as a number."""
    out = []
    for text, gold in zip(completions, answers):
        ans = extract_boxed_answer(text)
        try:
            out.append(float(ans is not None and float(ans) == float(gold)))
        except ValueError:
            out.append(0.0)
    return np.array(out, np.float32)


class ScriptedGenerator:
    """Returns fixed completions per prompt; counts calls and records (prompts, seed)."""

    def __init__(self, script, length_unit, entropy_unit, nan_entropy, log, fail_after=None):
        self.script, self.length_unit, self.entropy_unit = script, length_unit, entropy_unit
        self.nan_entropy, self.log, self.fail_after = nan_entropy, log, fail_after

    def generate(self, prompts, n, seed):
        if self.fail_after is not None and len(self.log["calls"]) >= self.fail_after:
            raise RuntimeError("simulated preemption")
        self.log["calls"].append((list(prompts), n, seed))
        out = []
        for p in prompts:
            texts = self.script[p]
            assert len(texts) == n
            out.append([Completion(t, self.length_unit * (j + 1),
                                   float("nan") if (p, j) in self.nan_entropy else self.entropy_unit * j)
                        for j, t in enumerate(texts)])
        return out


B = r"\boxed"
SCRIPTS = {
    "base": {
        "P1": [f"a {B}{{2}}", f"b {B}{{2}}", f"c {B}{{5}}", "no answer"],
        "P2": [f"x {B}{{1}}"] * 4,
        "P3": [f"{B}{{3}}", f"{B}{{3.0}}", f"{B}{{3}}", f"{B}{{4}}"],
        "Q1": [f"{B}{{1}}", f"{B}{{0}}"],
        "Q2": [f"{B}{{8}}", f"{B}{{8}}"],
    },
    "rl": {
        "P1": [f"{B}{{2}}", f"{B}{{2}}", f" {B}{{2}}  ", f"{B}{{2}}"],  # whitespace-only variants
        "P2": [f"{B}{{7}}", f"{B}{{1}}", f"{B}{{1}}", f"{B}{{1}}"],
        "P3": [f"{B}{{4}}", f"{B}{{3}}", "nothing", "nothing"],
        "Q1": [f"{B}{{1}}", f"{B}{{1}}"],
        "Q2": [f"{B}{{9}}", f"{B}{{8}}"],
    },
}
BENCHMARKS = {
    "b1": [Problem("p1", "P1", "2"), Problem("p2", "P2", "7"), Problem("p3", "P3", "3")],
    "b2": [Problem("q1", "Q1", "1"), Problem("q2", "Q2", "9")],
}
SETTINGS = EvalSettings(n=4, n_per_benchmark={"b2": 2}, problems_per_batch=2, bootstrap_resamples=5000)
# Sample j has num_tokens = unit * (j + 1) and mean entropy = unit * j (NaN where listed).
UNITS = {"base": (10, 0.5, set()), "rl": (5, 0.25, {("P1", 0)})}

# Every per-problem number, by hand (see the comments of the scripts above).
# n = 4, ks = 1, 2, 4: pass@k for c = 0..4 is 0 | 1/4, 1/2, 1 | 1/2, 5/6, 1 | 3/4, 1, 1 | 1, 1, 1.
EXPECTED = {
    "base": {
        "b1": {
            # c=2, answers [2, 2, 5, None]: maj@2 loses only on {5, None}.
            "p1": {"pass@1": 1 / 2, "pass@2": 5 / 6, "pass@4": 1, "mean@n": 1 / 2,
                   "maj@1": 1 / 2, "maj@2": 5 / 6, "maj@4": 1, "distinct_correct_answers": 1,
                   "distinct_correct_completions": 2},
            "p2": {"pass@1": 0, "pass@2": 0, "pass@4": 0, "mean@n": 0, "maj@1": 0, "maj@2": 0,
                   "maj@4": 0, "distinct_correct_answers": 0, "distinct_correct_completions": 0},
            # c=3, answers [3, 3.0, 3, 4]: "3" wins all ties, every pair votes a correct answer.
            "p3": {"pass@1": 3 / 4, "pass@2": 1, "pass@4": 1, "mean@n": 3 / 4,
                   "maj@1": 3 / 4, "maj@2": 1, "maj@4": 1, "distinct_correct_answers": 2,
                   "distinct_correct_completions": 2},
        },
        "b2": {
            "q1": {"pass@1": 1 / 2, "pass@2": 1, "mean@n": 1 / 2, "maj@1": 1 / 2, "maj@2": 1,
                   "distinct_correct_answers": 1, "distinct_correct_completions": 1},
            "q2": {"pass@1": 0, "pass@2": 0, "mean@n": 0, "maj@1": 0, "maj@2": 0,
                   "distinct_correct_answers": 0, "distinct_correct_completions": 0},
        },
    },
    "rl": {
        "b1": {
            "p1": {"pass@1": 1, "pass@2": 1, "pass@4": 1, "mean@n": 1, "maj@1": 1, "maj@2": 1,
                   "maj@4": 1, "distinct_correct_answers": 1, "distinct_correct_completions": 1},
            # c=1, answers [7, 1, 1, 1]: "1" wins every tie.
            "p2": {"pass@1": 1 / 4, "pass@2": 1 / 2, "pass@4": 1, "mean@n": 1 / 4,
                   "maj@1": 1 / 4, "maj@2": 0, "maj@4": 0, "distinct_correct_answers": 1,
                   "distinct_correct_completions": 1},
            # c=1, answers [4, 3, None, None]: "4" (first) wins the tie; pairs {3,None} x2 win.
            "p3": {"pass@1": 1 / 4, "pass@2": 1 / 2, "pass@4": 1, "mean@n": 1 / 4,
                   "maj@1": 1 / 4, "maj@2": 1 / 3, "maj@4": 0, "distinct_correct_answers": 1,
                   "distinct_correct_completions": 1},
        },
        "b2": {
            "q1": {"pass@1": 1, "pass@2": 1, "mean@n": 1, "maj@1": 1, "maj@2": 1,
                   "distinct_correct_answers": 1, "distinct_correct_completions": 1},
            "q2": {"pass@1": 1 / 2, "pass@2": 1, "mean@n": 1 / 2, "maj@1": 1 / 2, "maj@2": 1,
                   "distinct_correct_answers": 1, "distinct_correct_completions": 1},
        },
    },
}
NEW_SUPPORT = {"base": {"p1": 0, "p2": 0, "p3": 0, "q1": 0, "q2": 0},
               "rl": {"p1": 0, "p2": 1, "p3": 0, "q1": 0, "q2": 1}}
NUM_CORRECT = {"base": {"p1": 2, "p2": 0, "p3": 3, "q1": 1, "q2": 0},
               "rl": {"p1": 4, "p2": 1, "p3": 1, "q1": 2, "q2": 1}}


def _expected_with_diagnostics():
    out = {}
    for model, per_bench in EXPECTED.items():
        lu, eu, _ = UNITS[model]
        out[model] = {}
        for bench, probs in per_bench.items():
            n = 4 if bench == "b1" else 2
            out[model][bench] = {}
            for pid, vals in probs.items():
                v = dict(vals, new_support=NEW_SUPPORT[model][pid])
                v["mean_length"] = lu * (n + 1) / 2  # lengths unit * (1..n)
                ents = [eu * j for j in range(n)]
                if model == "rl" and pid == "p1":
                    ents = ents[1:]  # its first completion has NaN entropy and is left out
                v["mean_entropy"] = sum(ents) / len(ents)
                out[model][bench][pid] = v
    return out


def make_models(log, fail_after=None, scripts=SCRIPTS):
    def factory(name):
        def build(settings):
            log["built"].append(name)
            assert settings.temperature == SETTINGS.temperature  # factories get the run's settings
            return ScriptedGenerator(scripts[name], *UNITS[name], log, fail_after)
        return build
    return {name: factory(name) for name in ("base", "rl")}


def new_log():
    return {"calls": [], "built": []}


def run(tmp_path, log=None, settings=SETTINGS, **kw):
    log = log if log is not None else new_log()
    return evaluate_models(make_models(log, kw.pop("fail_after", None)), kw.pop("benchmarks", BENCHMARKS),
                           numeric_reward, settings, tmp_path, progress=False, **kw), log


def test_known_counts_every_number(tmp_path):
    results, log = run(tmp_path)
    expected = _expected_with_diagnostics()
    summary = results["summary"]
    assert summary["base_model"] == "base"
    assert summary["benchmarks"] == {"b1": {"n": 4, "ks": [1, 2, 4], "num_problems": 3},
                                     "b2": {"n": 2, "ks": [1, 2], "num_problems": 2}}
    assert summary["average"]["ks"] == [1, 2]
    for model in ("base", "rl"):
        # Raw per-problem counts stored in results.json.
        for bench, probs in BENCHMARKS.items():
            recs = results["models"][model]["benchmarks"][bench]["problems"]
            assert list(recs) == [p.id for p in probs]
            for p in probs:
                assert recs[p.id]["num_correct"] == NUM_CORRECT[model][p.id]
                assert sum(recs[p.id]["correct"]) == NUM_CORRECT[model][p.id]
                assert recs[p.id]["answers"] == [extract_boxed_answer(t) for t in SCRIPTS[model][p.prompt]]
        per_model = summary["models"][model]
        bench_means = {}
        for bench, probs in expected[model].items():
            per_problem = summary["per_problem"][model][bench]
            assert set(per_problem) == set(probs)
            for pid, vals in probs.items():
                assert set(per_problem[pid]) == set(vals), pid
                for metric, want in vals.items():
                    assert per_problem[pid][metric] == pytest.approx(want, abs=1e-12), (model, pid, metric)
            # Every benchmark number is the mean over ALL its problems (not the last one).
            metrics = next(iter(probs.values())).keys()
            assert set(per_model[bench]) == set(metrics)
            bench_means[bench] = {}
            for metric in metrics:
                values = [probs[pid][metric] for pid in probs]
                stat = per_model[bench][metric]
                assert stat["mean"] == pytest.approx(np.mean(values), abs=1e-12), (model, bench, metric)
                # With P <= 3 problems the smallest bootstrap mean (every draw = the worst problem)
                # has probability >= 1/27 > 2.5%, so the 95% interval is exactly [min, max]
                # (5000 resamples put ~185 draws on that atom, far above the 125 the 2.5% needs).
                assert stat["lo"] == pytest.approx(min(values), abs=1e-12), (model, bench, metric)
                assert stat["hi"] == pytest.approx(max(values), abs=1e-12), (model, bench, metric)
                bench_means[bench][metric] = stat["mean"]
        # Macro average over benchmarks, only over metrics both have (pass@4 exists in b1 only).
        common = set(bench_means["b1"]) & set(bench_means["b2"])
        assert set(per_model["average"]) == common and "pass@4" not in common
        for metric in common:
            stat = per_model["average"][metric]
            assert stat["mean"] == pytest.approx((bench_means["b1"][metric] + bench_means["b2"][metric]) / 2)
            assert stat["lo"] <= stat["mean"] + 1e-12 and stat["mean"] <= stat["hi"] + 1e-12
    # A few spelled out, to rule out any aggregation shortcut.
    assert summary["models"]["base"]["b1"]["pass@1"]["mean"] == pytest.approx((1 / 2 + 0 + 3 / 4) / 3)
    assert summary["models"]["rl"]["b1"]["maj@2"]["mean"] == pytest.approx((1 + 0 + 1 / 3) / 3)
    assert summary["models"]["rl"]["average"]["new_support"]["mean"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert summary["models"]["rl"]["average"]["pass@2"]["mean"] == pytest.approx(((1 + 1 / 2 + 1 / 2) / 3 + 1) / 2)


def test_outputs_table_plots_and_rerun_does_no_sampling(tmp_path):
    results, log = run(tmp_path)
    eval_dir = tmp_path / "eval"
    for name in ("results.json", "results.md", "pass_at_k.png", "pass1_vs_passk.png"):
        assert (eval_dir / name).exists(), name
    for png in ("pass_at_k.png", "pass1_vs_passk.png"):
        assert (eval_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(eval_dir / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    # 3 + 2 problems in batches of 2 -> 3 generate calls per model; identical seeds across models.
    calls = log["calls"]
    assert len(calls) == 6 and log["built"] == ["base", "rl"]
    assert [c[2] for c in calls[:3]] == [c[2] for c in calls[3:]]
    assert [c[0] for c in calls[:3]] == [["P1", "P2"], ["P3"], ["Q1", "Q2"]]
    assert [c[1] for c in calls[:3]] == [4, 4, 2]
    stored = json.loads(results_path(tmp_path).read_text())
    assert stored["schema_version"] == 1 and stored["settings"]["temperature"] == 0.6

    before = results_path(tmp_path).read_text()
    log2 = new_log()
    again, _ = run(tmp_path, log2)
    assert log2 == {"calls": [], "built": []}  # nothing sampled, no model even loaded
    assert results_path(tmp_path).read_text() == before
    assert again["summary"] == results["summary"]

    # The table shows the numbers of results.json (to its rounding).
    table = (eval_dir / "results.md").read_text()
    assert "## b1" in table and "## average" in table
    assert check_table_against_summary(table, stored["summary"]) > 50


def check_table_against_summary(table, summary):
    """Every cell of every table equals mean [lo, hi] of results.json to the table's rounding."""
    section, header, checked = None, None, 0
    for line in table.splitlines():
        if line.startswith("## "):
            section = line[3:].split(" ")[0]
            continue
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "model":
            header = cells
            continue
        for col, cell in zip(header[1:], cells[1:], strict=True):
            bench, metric = col.split(" ") if section == "Overview" else (section, col)
            stat = summary["models"][cells[0]][bench][metric]
            nums = [float(x) for x in re.findall(r"-?\d+\.\d+", cell)]
            assert len(nums) == 3, cell
            tol = 0.5 * 10 ** -eval_report.decimals(metric) + 1e-9
            for got, want in zip(nums, (stat["mean"], stat["lo"], stat["hi"])):
                assert abs(got - want) <= tol, (cells[0], bench, metric, cell)
            checked += 1
    return checked


def test_interrupted_run_resumes_and_matches_uninterrupted(tmp_path):
    ref, _ = run(tmp_path / "ref")
    log = new_log()
    with pytest.raises(RuntimeError, match="preemption"):
        run(tmp_path / "cut", log, fail_after=2)  # base finishes b1 (2 calls), dies on b2
    partial = load_results(tmp_path / "cut")
    assert partial["summary"] is None
    assert set(partial["models"]["base"]["benchmarks"]["b1"]["problems"]) == {"p1", "p2", "p3"}
    assert partial["models"]["base"]["benchmarks"]["b2"]["problems"] == {}
    log2 = new_log()
    done, _ = run(tmp_path / "cut", log2)
    assert [c[0] for c in log2["calls"]] == [["Q1", "Q2"], ["P1", "P2"], ["P3"], ["Q1", "Q2"]]
    assert done["models"] == ref["models"]
    assert done["summary"] == ref["summary"]


def test_changed_settings_refuse_to_mix(tmp_path):
    run(tmp_path)
    for change, name in [(dict(temperature=1.0), "temperature"), (dict(top_p=0.5), "top_p"),
                         (dict(max_tokens=7), "max_tokens"), (dict(seed=1), "seed"),
                         (dict(sampler={"top_k": 5}), "sampler"), (dict(n=8), "'n'")]:
        kw = {**SETTINGS.to_json(), **change}
        with pytest.raises(SettingsMismatchError, match=name):
            run(tmp_path, settings=EvalSettings(**kw))
    # Statistics-only settings may change: the summary is recomputed without sampling.
    log = new_log()
    kw = {**SETTINGS.to_json(), "bootstrap_resamples": 100, "ci_level": 0.9, "base_model": "rl"}
    results, _ = run(tmp_path, log, settings=EvalSettings(**kw))
    assert log["calls"] == [] and results["summary"]["base_model"] == "rl"
    # rl solves every problem base solves, so nothing is new relative to rl.
    assert results["summary"]["models"]["base"]["b1"]["new_support"]["mean"] == 0
    # A changed prompt or answer of a finished problem is refused too.
    changed = {**BENCHMARKS, "b2": [Problem("q1", "Q1", "1"), Problem("q2", "Q2", "10")]}
    with pytest.raises(SettingsMismatchError, match="q2"):
        run(tmp_path, benchmarks=changed)


def test_sources_and_bad_generator_output(tmp_path):
    run(tmp_path / "a", sources={"base": "/ckpt/base", "rl": "/ckpt/rl"})
    with pytest.raises(SettingsMismatchError, match="rl"):
        run(tmp_path / "a", sources={"rl": "/ckpt/other"})

    class Short:
        def generate(self, prompts, n, seed):
            return [[Completion("x", 1, 0.0)] * (n - 1) for _ in prompts]

    with pytest.raises(ValueError, match="expected 4"):
        evaluate_models({"m": lambda s: Short()}, BENCHMARKS, numeric_reward, SETTINGS, tmp_path / "b",
                        progress=False)
    with pytest.raises(ValueError, match="repeats problem id"):
        evaluate_models({"m": lambda s: Short()}, {"x": [Problem("a", "A", "1")] * 2}, numeric_reward,
                        SETTINGS, tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="base_model"):
        evaluate_models({"m": lambda s: Short()}, BENCHMARKS, numeric_reward,
                        EvalSettings(base_model="nope"), tmp_path / "d", progress=False)


def test_new_benchmark_added_later_samples_only_it(tmp_path):
    run(tmp_path, benchmarks={"b1": BENCHMARKS["b1"]})
    log = new_log()
    results, _ = run(tmp_path, log)
    assert [c[0] for c in log["calls"]] == [["Q1", "Q2"], ["Q1", "Q2"]]
    assert "average" in results["summary"]["models"]["rl"]


def test_changed_verifier_refuses_and_non_writer_writes_nothing(tmp_path):
    run(tmp_path / "a")

    def other_reward(completions, answers):
        return numeric_reward(completions, answers)

    with pytest.raises(SettingsMismatchError, match="reward_fn"):
        evaluate_models(make_models(new_log()), BENCHMARKS, other_reward, SETTINGS, tmp_path / "a",
                        progress=False)
    log = new_log()
    results, _ = run(tmp_path / "b", log, is_writer=False)
    assert len(log["calls"]) == 6 and results["summary"]["models"]["rl"]["b1"]["pass@4"]["mean"] == 1
    assert not (tmp_path / "b").exists()


def test_results_written_before_the_package_split_resume(tmp_path):
    """A results.json that names the project's verifier and answer reader under their modules before the
    split (`sage_jax.rewards`, `sage_jax.boxed`) resumes without sampling again; another verifier is still
    refused."""
    from sage_jax.rewards import verifiers

    log = new_log()
    evaluate_models(make_models(log), BENCHMARKS, verifiers.exact_match_reward, SETTINGS, tmp_path, progress=False)
    path = results_path(tmp_path)
    stored = json.loads(path.read_text())
    assert stored["verifier"] == {"reward_fn": "sage_jax.rewards.verifiers.exact_match_reward",
                                  "answer_fn": "sage_jax.rewards.boxed.extract_boxed_answer"}
    stored["verifier"] = {"reward_fn": "sage_jax.rewards.exact_match_reward",
                          "answer_fn": "sage_jax.boxed.extract_boxed_answer"}
    path.write_text(json.dumps(stored))
    log = new_log()
    evaluate_models(make_models(log), BENCHMARKS, verifiers.exact_match_reward, SETTINGS, tmp_path, progress=False)
    assert log["calls"] == []
    assert json.loads(path.read_text())["verifier"]["answer_fn"] == "sage_jax.rewards.boxed.extract_boxed_answer"
    stored["verifier"]["reward_fn"] = "sage_jax.rewards.math_verify_reward"
    path.write_text(json.dumps(stored))
    with pytest.raises(SettingsMismatchError, match="reward_fn"):
        evaluate_models(make_models(new_log()), BENCHMARKS, verifiers.exact_match_reward, SETTINGS, tmp_path,
                        progress=False)


@pytest.mark.parametrize("damage", ["truncated", "empty", "a list", "a sample too many", "a wrong count"])
def test_a_damaged_results_file_is_set_aside_and_the_evaluation_starts_over(tmp_path, damage, caplog):
    """A results.json cut short, `[]`, or with a problem whose samples disagree with n gave a JSONDecodeError /
    AttributeError / ValueError traceback: now one warning naming the file, the file moved to eval.corrupt/, and
    the evaluation redone from scratch."""
    evaluate_models(make_models(new_log()), BENCHMARKS, numeric_reward, SETTINGS, tmp_path, progress=False)
    path = results_path(tmp_path)
    text = path.read_text()
    stored = json.loads(text)
    model, bench = next(iter(stored["models"])), next(iter(BENCHMARKS))
    rec = next(iter(stored["models"][model]["benchmarks"][bench]["problems"].values()))
    if damage == "a sample too many":
        rec["correct"].append(1)
    elif damage == "a wrong count":
        rec["num_correct"] += 1
    raw = {"truncated": text[: len(text) // 2], "empty": "", "a list": "[]"}
    path.write_text(raw[damage] if damage in raw else json.dumps(stored))
    damaged = path.read_text()
    log = new_log()
    with caplog.at_level("WARNING"):
        evaluate_models(make_models(log), BENCHMARKS, numeric_reward, SETTINGS, tmp_path, progress=False)
    assert log["calls"]  # sampled again
    assert (tmp_path / "eval.corrupt" / "results.json").read_text() == damaged
    assert any(str(path) in r.getMessage() and "eval.corrupt" in r.getMessage() for r in caplog.records)
    assert load_results(tmp_path) is not None


def test_with_the_project_verifier(tmp_path):
    rewards = pytest.importorskip("sage_jax.rewards.verifiers")
    script = {"P1": [r"so \boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{2}", "no idea"]}
    log = new_log()
    results = evaluate_models(
        {"m": lambda s: ScriptedGenerator(script, 1, 0.0, set(), log)},
        {"b": [Problem("p1", "P1", "1/2")]}, rewards.math_verify_reward,
        EvalSettings(n=4), tmp_path, progress=False)
    rec = results["models"]["m"]["benchmarks"]["b"]["problems"]["p1"]
    assert rec["correct"] == [1, 1, 0, 0]
    # Two spellings of the same value are two distinct correct answers (strings are compared).
    assert results["summary"]["per_problem"]["m"]["b"]["p1"]["distinct_correct_answers"] == 2
    assert results["verifier"]["reward_fn"] == "sage_jax.rewards.verifiers.math_verify_reward"
