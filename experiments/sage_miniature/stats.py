"""Statistics of the miniature study: seed aggregates, a bootstrap over problems x seeds, the paper's claims
decided by the confidence intervals of seed-mean differences, and a power estimate for undecided ones.

Dimension key: `S` seeds of one method, `P` held-out problems, `B` bootstrap resamples.

A method's value of a metric is the mean over problems of the mean over its seeds. Its uncertainty is a
two-level bootstrap: each resample draws the problems with replacement (the same draw for every method
in a comparison, so differences are paired over problems) and, independently for each method, its
seeds with replacement. With 3 seeds the seed level is coarse but honest: a difference carried by one
lucky seed does not exclude 0.

Power estimate (`required_counts`): for a comparison whose CI includes 0, how many held-out problems (at
the current seeds) or seeds (at the current problems) would make the CI exclude 0 if the observed
difference were the true one, with the CI half-width scaling as 1/sqrt(count). That scaling treats all of
the CI's width as coming from the one count that changes; where most of the bootstrap variance is across
seeds, more problems barely narrow the CI (and vice versa), so the two counts are not interchangeable.
`seed_variance_share` (from one-level bootstraps) says which case applies, and the two-level projection
(`two_level_counts`) keeps the other level's share of the variance fixed.
"""

from __future__ import annotations

import math

import numpy as np

from sage_jax.eval.metrics import stable_seed

RESAMPLES = 2000
LEVEL = 0.95


def seed_stats(values: list[float]) -> dict:
    """mean and std over seeds (sample std, ddof = 1; 0.0 with a single seed)."""
    v = np.asarray(values, np.float64)
    std = float(np.std(v, ddof=1)) if v.size > 1 else 0.0
    return {"seeds": [float(x) for x in v], "mean": float(np.mean(v)), "std": std}


def format_pm(stat: dict, decimals: int = 3) -> str:
    """`mean ± std` as the tables print it."""
    return f"{stat['mean']:.{decimals}f} ± {stat['std']:.{decimals}f}"


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(stable_seed(0, "sage_miniature", *parts))


def _replicates(terms: list[tuple[float, np.ndarray, str]], tag: str, resamples: int,
                resample: str) -> tuple[float, np.ndarray]:
    """Estimate and bootstrap replicates [B] of `sum coef * value(method)`. `resample`: "both" (problems
    and seeds), "problems" (seeds kept, each weighted 1/S) or "seeds" (problems kept)."""
    P = terms[0][1].shape[1]
    rng = _rng(tag) if resample == "both" else _rng(tag, resample)
    if resample == "seeds":
        w_BxP = np.ones((resamples, P))
    else:
        w_BxP = rng.multinomial(P, np.full(P, 1.0 / P), size=resamples).astype(np.float64)
    seed_w = {}
    for _, v, key in terms:
        if key not in seed_w:
            S = v.shape[0]
            if resample == "problems":
                seed_w[key] = np.full((resamples, S), 1.0 / S)
            else:
                seed_w[key] = rng.multinomial(S, np.full(S, 1.0 / S), size=resamples).astype(np.float64) / S
    est, reps = 0.0, np.zeros(resamples)
    for coef, v, key in terms:
        est += coef * float(np.mean(v))
        per_problem_BxP = seed_w[key] @ v  # seed-resampled mean per problem
        reps += coef * np.sum(w_BxP * per_problem_BxP, axis=1) / P
    return est, reps


def combination_ci(terms: list[tuple[float, np.ndarray, str]], tag: str, resamples: int = RESAMPLES,
                   level: float = LEVEL) -> dict:
    """Estimate and bootstrap CI of `sum coef * value(method)`, value = mean_P mean_S V_SxP.

    `terms`: (coef, V_SxP, method key); terms of one method share its seed draws.
    """
    est, reps = _replicates(terms, tag, resamples, "both")
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(reps, [tail, 100 - tail])
    return {"estimate": est, "lo": float(lo), "hi": float(hi)}


def seed_variance_share(terms: list[tuple[float, np.ndarray, str]], tag: str, resamples: int = RESAMPLES) -> float:
    """Share of the bootstrap variance of the combination that comes from seeds: var_seeds / (var_seeds +
    var_problems), each from a one-level bootstrap (0.0 with one seed per method, where seed variance is
    not observable)."""
    _, rp = _replicates(terms, tag, resamples, "problems")
    _, rs = _replicates(terms, tag, resamples, "seeds")
    vp, vs = float(np.var(rp)), float(np.var(rs))
    return vs / (vp + vs) if vp + vs > 0 else 0.0


# ------------------------------------------------------------------------------------------ power
def _above(x: float) -> int:
    """The smallest count > x (the CI must exclude 0, not touch it); x within 1e-9 of an integer counts as it."""
    return max(1, math.floor(x + 1e-9) + 1)


def half_width_toward_zero(estimate: float, lo: float, hi: float) -> float:
    """Distance from the estimate to the CI bound on zero's side (the CI excludes 0 when it is < |estimate|)."""
    return estimate - lo if estimate >= 0 else hi - estimate


def required_counts(estimate: float, lo: float, hi: float, problems: int, seeds: int) -> dict:
    """Counts at which the CI would exclude 0 if `estimate` were the true difference, each count changed alone
    and the half-width h scaling as 1/sqrt(count): the smallest count > count_now * (h / |estimate|)^2, where
    the projected half-width falls below |estimate| (None when the estimate is 0: no count suffices)."""
    h = half_width_toward_zero(estimate, lo, hi)
    if estimate == 0:
        return {"half_width": h, "problems_needed": None, "seeds_needed": None}
    ratio = (h / abs(estimate)) ** 2
    return {"half_width": h, "problems_needed": _above(problems * ratio), "seeds_needed": _above(seeds * ratio)}


def two_level_counts(estimate: float, lo: float, hi: float, problems: int, seeds: int, seed_share: float) -> dict:
    """As `required_counts`, but only the changed level's part of the variance shrinks: h^2 = h^2 (1 - f)
    P0 / P + h^2 f S0 / S with f = `seed_share`. None where the other level's part alone keeps the CI
    over 0 (h^2 f >= estimate^2 for problems; h^2 (1 - f) >= estimate^2 for seeds)."""
    h2, d2 = half_width_toward_zero(estimate, lo, hi) ** 2, estimate ** 2
    hp2, hs2 = h2 * (1.0 - seed_share), h2 * seed_share
    return {"problems_needed": _above(problems * hp2 / (d2 - hs2)) if d2 > hs2 else None,
            "seeds_needed": _above(seeds * hs2 / (d2 - hp2)) if d2 > hp2 and hs2 > 0 else None}


def power_estimate(terms: list[tuple[float, np.ndarray, str]], ci: dict, tag: str, available: int) -> dict:
    """The power estimate of one comparison whose CI includes 0 (see the module docstring)."""
    problems = int(terms[0][1].shape[1])
    seeds = max(int(v.shape[0]) for _, v, _ in terms)
    simple = required_counts(ci["estimate"], ci["lo"], ci["hi"], problems, seeds)
    f = seed_variance_share(terms, tag)
    two = two_level_counts(ci["estimate"], ci["lo"], ci["hi"], problems, seeds, f)
    need = simple["problems_needed"]
    return {"problems_now": problems, "seeds_now": seeds, "problems_available": available, **simple,
            "problems_within_available": need is not None and need <= available,
            "seed_variance_share": f,
            "two_level": {**two, "problems_within_available": two["problems_needed"] is not None
                          and two["problems_needed"] <= available}}


def method_curve(v_SxPxK: np.ndarray, tag: str) -> dict:
    """Seed-mean pass@k per k with its problems x seeds bootstrap band."""
    out = {"mean": [], "lo": [], "hi": []}
    for j in range(v_SxPxK.shape[2]):
        ci = combination_ci([(1.0, v_SxPxK[:, :, j], "m")], f"{tag}:{j}")
        out["mean"].append(ci["estimate"])
        out["lo"].append(ci["lo"])
        out["hi"].append(ci["hi"])
    return out


# ------------------------------------------------------------------------------------------ claims
# Each comparison is a linear combination of (method, metric) values with a predicted sign; "kmax" is
# replaced by pass@<largest k>. `counted=False` rows are shown for context but do not decide the verdict.
CLAIMS = [
    {"id": "grpo_sharpens",
     "claim": "GRPO (with KL) raises pass@1 while large-k pass@k stalls or falls",
     "comparisons": [
         {"name": "GRPO - base, pass@1", "terms": [(1, "grpo", "pass@1"), (-1, "base", "pass@1")], "sign": 1},
         {"name": "(GRPO - base) at pass@kmax minus at pass@1",
          "terms": [(1, "grpo", "kmax"), (-1, "base", "kmax"), (-1, "grpo", "pass@1"), (1, "base", "pass@1")],
          "sign": -1},
         {"name": "GRPO - base, pass@kmax", "terms": [(1, "grpo", "kmax"), (-1, "base", "kmax")], "sign": -1,
          "counted": False}]},
    {"id": "no_kl_loses_coverage",
     "claim": "Without the KL term (BNPO, DAPO) coverage is lost: pass@kmax falls below the base model's",
     "comparisons": [
         {"name": "BNPO (no KL) - base, pass@kmax", "terms": [(1, "bnpo", "kmax"), (-1, "base", "kmax")],
          "sign": -1},
         {"name": "DAPO (no KL) - base, pass@kmax", "terms": [(1, "dapo", "kmax"), (-1, "base", "kmax")],
          "sign": -1},
         {"name": "BNPO (no KL) - GRPO (KL), pass@kmax", "terms": [(1, "bnpo", "kmax"), (-1, "grpo", "kmax")],
          "sign": -1, "counted": False},
         {"name": "DAPO (no KL) - GRPO (KL), pass@kmax", "terms": [(1, "dapo", "kmax"), (-1, "grpo", "kmax")],
          "sign": -1, "counted": False},
         # the published DAPO (dynamic sampling, clip-higher) trades exploration for pass@1
         {"name": "DAPO (no KL) - GRPO (KL), pass@1", "terms": [(1, "dapo", "pass@1"), (-1, "grpo", "pass@1")],
          "sign": 1, "counted": False},
         {"name": "DAPO (no KL) - GRPO (KL), distinct_correct_strategies",
          "terms": [(1, "dapo", "distinct_correct_strategies"), (-1, "grpo", "distinct_correct_strategies")],
          "sign": -1, "counted": False}]},
    {"id": "forward_kl_misplaces",
     "claim": "Forward KL misplaces mass: it spreads probability without buying the accuracy or coverage "
              "the shaped reverse anchor (branch guide) buys",
     "comparisons": [
         {"name": "forward KL - SAGE branch, pass@1",
          "terms": [(1, "forward_kl", "pass@1"), (-1, "sage_branch", "pass@1")], "sign": -1},
         {"name": "forward KL - SAGE branch, pass@kmax",
          "terms": [(1, "forward_kl", "kmax"), (-1, "sage_branch", "kmax")], "sign": -1},
         {"name": "forward KL - GRPO, mean completion entropy",
          "terms": [(1, "forward_kl", "mean_entropy"), (-1, "grpo", "mean_entropy")], "sign": 1,
          "counted": False}]},
    {"id": "branch_improves_both",
     "claim": "The branch guide improves both pass@1 and pass@kmax over GRPO",
     "comparisons": [
         {"name": "SAGE branch - GRPO, pass@1", "terms": [(1, "sage_branch", "pass@1"), (-1, "grpo", "pass@1")],
          "sign": 1},
         {"name": "SAGE branch - GRPO, pass@kmax", "terms": [(1, "sage_branch", "kmax"), (-1, "grpo", "kmax")],
          "sign": 1},
         {"name": "BNPO + KL + branch - BNPO (no KL), pass@1",
          "terms": [(1, "bnpo_branch", "pass@1"), (-1, "bnpo", "pass@1")], "sign": 1, "counted": False},
         {"name": "BNPO + KL + branch - BNPO (no KL), pass@kmax",
          "terms": [(1, "bnpo_branch", "kmax"), (-1, "bnpo", "kmax")], "sign": 1, "counted": False},
         {"name": "DAPO + KL + branch - DAPO (no KL), pass@1",
          "terms": [(1, "dapo_branch", "pass@1"), (-1, "dapo", "pass@1")], "sign": 1, "counted": False},
         {"name": "DAPO + KL + branch - DAPO (no KL), pass@kmax",
          "terms": [(1, "dapo_branch", "kmax"), (-1, "dapo", "kmax")], "sign": 1, "counted": False}]},
    {"id": "branch_keeps_exploration",
     "claim": "GRPO narrows the rare correct procedure (share/terms and distinct_correct_strategies fall below "
              "the base) while the SAGE branch guide keeps more of it than GRPO",
     "comparisons": [
         {"name": "GRPO - base, share/terms", "terms": [(1, "grpo", "share/terms"), (-1, "base", "share/terms")],
          "sign": -1},
         {"name": "GRPO - base, distinct_correct_strategies",
          "terms": [(1, "grpo", "distinct_correct_strategies"), (-1, "base", "distinct_correct_strategies")],
          "sign": -1},
         {"name": "SAGE branch - GRPO, share/terms",
          "terms": [(1, "sage_branch", "share/terms"), (-1, "grpo", "share/terms")], "sign": 1},
         {"name": "SAGE branch - GRPO, distinct_correct_strategies",
          "terms": [(1, "sage_branch", "distinct_correct_strategies"), (-1, "grpo", "distinct_correct_strategies")],
          "sign": 1},
         {"name": "GRPO - base, share/rule (the dominant correct procedure)",
          "terms": [(1, "grpo", "share/rule"), (-1, "base", "share/rule")], "sign": 1, "counted": False}]},
    {"id": "branch_beats_token_random",
     "claim": "The branch guide beats the token and random guides",
     "comparisons": [
         {"name": f"SAGE branch - SAGE {g}, {m}",
          "terms": [(1, "sage_branch", k), (-1, f"sage_{g}", k)], "sign": 1}
         for g in ("token", "random") for m, k in (("pass@1", "pass@1"), ("pass@kmax", "kmax"))]},
]


def _outcome(ci: dict, sign: int) -> str:
    if sign > 0:
        return "supports" if ci["lo"] > 0 else ("contradicts" if ci["hi"] < 0 else "neither")
    return "supports" if ci["hi"] < 0 else ("contradicts" if ci["lo"] > 0 else "neither")


def claim_metrics() -> set[str]:
    """Every metric a claim reads ("kmax" stands for pass@<largest k>)."""
    return {k for c in CLAIMS for comp in c["comparisons"] for _, _, k in comp["terms"]}


def decide_claims(per_problem: dict, kmax: int, available: int) -> list[dict]:
    """Verdicts of CLAIMS. `per_problem[method][metric]` is V_SxP (seeds x problems); `available`: held-out
    problems there are (the cap of the power estimate).

    A comparison supports the claim when its CI excludes 0 on the predicted side and contradicts it when
    its CI excludes 0 on the other side. Verdict: "reproduced" when every counted comparison supports it,
    "not reproduced" when any contradicts it, else "inconclusive" (some CI includes 0); "not evaluated"
    when a method it needs was not run (quick mode). Every comparison whose CI includes 0 ("neither") gets
    a `power` entry (`power_estimate`).
    """
    out = []
    for claim in CLAIMS:
        rows = []
        for comp in claim["comparisons"]:
            terms = [(c, m, f"pass@{kmax}" if k == "kmax" else k) for c, m, k in comp["terms"]]
            name = comp["name"].replace("kmax", str(kmax))
            row = {"name": name, "sign": comp["sign"], "counted": comp.get("counted", True),
                   "terms": [list(t) for t in terms]}
            if any(m not in per_problem for _, m, _ in terms):
                row["outcome"] = "not evaluated"
            else:
                arrays = [(float(c), np.asarray(per_problem[m][k]), m) for c, m, k in terms]
                ci = combination_ci(arrays, f"{claim['id']}:{name}")
                row.update(ci, outcome=_outcome(ci, comp["sign"]))
                if row["outcome"] == "neither":
                    row["power"] = power_estimate(arrays, ci, f"{claim['id']}:{name}:power", available)
            rows.append(row)
        counted = [r["outcome"] for r in rows if r["counted"]]
        if "not evaluated" in counted:
            verdict = "not evaluated"
        elif all(o == "supports" for o in counted):
            verdict = "reproduced"
        elif "contradicts" in counted:
            verdict = "not reproduced"
        else:
            verdict = "inconclusive"
        out.append({"id": claim["id"], "claim": claim["claim"].replace("kmax", str(kmax)), "verdict": verdict,
                    "supported": f"{counted.count('supports')}/{len(counted)}", "comparisons": rows})
    return out


# ------------------------------------------------------------------------------------------ evidence study
# README "Evidence study" (fixed before its runs): every guided method against GRPO on these metrics, the branch
# guide against the token and random guides, the reward form against the loss form. No predicted sign: each
# CI is read as it falls ("> 0", "< 0" or "includes 0", the latter with its power estimate).
EVIDENCE_METRICS = ("pass@1", "kmax", "share/terms", "distinct_correct_strategies")
THRESHOLD_SETTINGS = ("sage_branch_p99", "sage_branch_paper", "sage_branch_p95", "sage_branch")  # fewest shaped first


def evidence_comparisons(methods: list[str]) -> list[dict]:
    """The pre-registered comparisons among `methods` (pairs whose methods were not run are left out)."""
    pairs = [(m, "grpo") for m in methods if m.startswith("sage_")]
    pairs += [("sage_branch", "sage_token"), ("sage_branch", "sage_random"), ("sage_branch_reward", "sage_branch")]
    return [{"a": a, "b": b, "metric": k} for a, b in pairs if a in methods and b in methods
            for k in EVIDENCE_METRICS]


def decide_evidence(per_problem: dict, kmax: int, available: int) -> list[dict]:
    """Each pre-registered comparison a - b: its estimate, two-level 95% CI and where the CI falls."""
    out = []
    for c in evidence_comparisons(list(per_problem)):
        k = f"pass@{kmax}" if c["metric"] == "kmax" else c["metric"]
        terms = [(1.0, np.asarray(per_problem[c["a"]][k]), c["a"]), (-1.0, np.asarray(per_problem[c["b"]][k]), c["b"])]
        name = f"{c['a']} - {c['b']}, {k}"
        ci = combination_ci(terms, f"evidence:{name}")
        side = "> 0" if ci["lo"] > 0 else "< 0" if ci["hi"] < 0 else "includes 0"
        row = {"name": name, "a": c["a"], "b": c["b"], "metric": k, **ci, "outcome": side}
        if side == "includes 0":
            row["power"] = power_estimate(terms, ci, f"evidence:{name}:power", available)
        out.append(row)
    return out
