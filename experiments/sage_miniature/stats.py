"""Statistics of the miniature study: seed aggregates, a bootstrap over problems x seeds, and the paper's
claims decided by the confidence intervals of seed-mean differences.

Dimension key: `S` seeds of one method, `P` held-out problems, `B` bootstrap resamples.

A method's value of a metric is the mean over problems of the mean over its seeds. Its uncertainty is a
two-level bootstrap: each resample draws the problems with replacement (the same draw for every method
in a comparison, so differences are paired over problems) and, independently for each method, its
seeds with replacement. With 3 seeds the seed level is coarse but honest: a difference carried by one
lucky seed does not exclude 0.
"""

from __future__ import annotations

import numpy as np

from sage_jax.eval_metrics import stable_seed

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


def combination_ci(terms: list[tuple[float, np.ndarray, str]], tag: str, resamples: int = RESAMPLES,
                   level: float = LEVEL) -> dict:
    """Estimate and bootstrap CI of `sum coef * value(method)`, value = mean_P mean_S V_SxP.

    `terms`: (coef, V_SxP, method key); terms of one method share its seed draws.
    """
    P = terms[0][1].shape[1]
    rng = _rng(tag)
    w_BxP = rng.multinomial(P, np.full(P, 1.0 / P), size=resamples).astype(np.float64)
    seed_w = {}
    for _, v, key in terms:
        if key not in seed_w:
            S = v.shape[0]
            seed_w[key] = rng.multinomial(S, np.full(S, 1.0 / S), size=resamples).astype(np.float64) / S
    est, reps = 0.0, np.zeros(resamples)
    for coef, v, key in terms:
        est += coef * float(np.mean(v))
        per_problem_BxP = seed_w[key] @ v  # seed-resampled mean per problem
        reps += coef * np.sum(w_BxP * per_problem_BxP, axis=1) / P
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(reps, [tail, 100 - tail])
    return {"estimate": est, "lo": float(lo), "hi": float(hi)}


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


def decide_claims(per_problem: dict, kmax: int) -> list[dict]:
    """Verdicts of CLAIMS. `per_problem[method][metric]` is V_SxP (seeds x problems).

    A comparison supports the claim when its CI excludes 0 on the predicted side and contradicts it when
    its CI excludes 0 on the other side. Verdict: "reproduced" when every counted comparison supports it,
    "not reproduced" when any contradicts it, else "inconclusive" (some CI includes 0); "not evaluated"
    when a method it needs was not run (quick mode).
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
                ci = combination_ci([(float(c), np.asarray(per_problem[m][k]), m) for c, m, k in terms],
                                    f"{claim['id']}:{name}")
                row.update(ci, outcome=_outcome(ci, comp["sign"]))
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
