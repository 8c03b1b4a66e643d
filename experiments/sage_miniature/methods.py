"""What the miniature study runs: the methods (exact config overrides of configs/tiny.py), the budgets
of the full and quick modes, and the paper's published numbers.

Every trained method starts from `configs/tiny.py:get_config()` (the shipped tiny base, the procedural
`strategies` task: 3-6 operands, four solution procedures, two of them correct; 8 fresh prompts x 8
rollouts x <= 96 tokens per step drawn from the 50k-problem training split, no pool; lr 1e-4) and shares
the common fields `run.py` sets; only the fields in its `overrides` differ. Seed s of every method sees
the same prompts in the same order (the data order and the RL key derive from `seed`).
"""

from __future__ import annotations

import dataclasses

BETA = 0.05  # the paper's KL coefficient (k3 against the shaped anchor)
TINY_MAX_NEW_TOKENS = 96  # configs/tiny.py's completion budget: the longest worked solution, 89 characters + EOS
# DAPO's soft overlong penalty starts past the expected longest answer (16384 of its 20480 tokens); here the
# longest correct completion is known, 90 tokens, so the buffer is the 6 tokens past it. A fifth of the
# budget (19 tokens, from 77) would penalise correct long solutions, which DAPO's setting never does.
DAPO_BUFFER = TINY_MAX_NEW_TOKENS - 90


def _dapo_algorithm() -> dict:
    """The published DAPO's algorithmic fields (configs/dapo.py: clip-higher 0.28, dynamic sampling from 3x
    the prompts, token-level loss, the soft overlong penalty past the longest answer, no KL)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "dapo.py")
    spec = importlib.util.spec_from_file_location("dapo_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.algorithm(TINY_MAX_NEW_TOKENS, DAPO_BUFFER)


DAPO = _dapo_algorithm()
THRESHOLD = "calibrated"  # placeholder replaced by calibration.json's threshold (see run.py)
# The threshold study (issue 39): the branch threshold at other quantiles of the same calibration, chosen by the
# share of the base's tokens they shape (p99: ~1%, forks only; p95: ~5%; p80 = THRESHOLD: 20%, the forking
# share of Wang et al. 2025), and the reference code's 1.2 nats (~0.7% of the base's tokens here).
THRESHOLD_AT = {f"calibrated:p{q}": f"p{q}" for q in (95, 99)}
PAPER_THRESHOLD = 1.2


def resolve_threshold(value, calibration: dict):
    """A method override's value with the calibration placeholders replaced by numbers (others unchanged)."""
    if value == THRESHOLD:
        return float(calibration["threshold"])
    if isinstance(value, str) and value in THRESHOLD_AT:
        return round(float(calibration["quantiles"][THRESHOLD_AT[value]]), 4)
    return value

# Published averages (AIME, AMC23, MATH-500; Qwen2.5-Math-7B base) as quoted in docs/design.md
# section 1 from SAGE (arXiv 2605.18864); (pass@1, pass@256). None: not in that excerpt.
PAPER_SOURCE = "SAGE (arXiv 2605.18864), Qwen2.5-Math-7B, avg of AIME / AMC23 / MATH-500, as quoted in docs/design.md §1"


@dataclasses.dataclass(frozen=True)
class Method:
    key: str
    label: str
    overrides: dict  # dotted config fields set on top of COMMON; None for the untrained base
    paper: tuple[float, float] | None = None  # (pass@1, pass@256) published

    @property
    def trained(self) -> bool:
        return self.overrides is not None


def _m(key, label, paper=None, **fields):
    return Method(key, label, {k.replace("__", "."): v for k, v in fields.items()}, paper)


_KL = dict(rl__beta=BETA, rl__kl_mode="reverse")
_BRANCH = dict(sage__guide="branch", sage__branch__threshold=THRESHOLD)

METHODS: list[Method] = [
    Method("base", "base model (no training)", None, (0.227, 0.708)),
    _m("grpo", "GRPO + KL (guide none)", (0.266, 0.714), rl__loss_type="grpo", sage__guide="none", **_KL),
    _m("bnpo", "BNPO, no KL", (0.243, 0.699), rl__loss_type="bnpo", sage__guide="none", rl__beta=0.0),
    Method("dapo", "DAPO (published: clip-higher, dynamic sampling, token-level loss, overlong penalty), no KL",
           dict(DAPO), (0.264, 0.696)),
    _m("forward_kl", "GRPO + forward KL to the reference", None, rl__loss_type="grpo", sage__guide="none",
       rl__beta=BETA, rl__kl_mode="forward"),
    _m("sage_branch", "GRPO + SAGE branch guide", (0.284, 0.729), rl__loss_type="grpo", **_KL, **_BRANCH),
    _m("sage_token", "GRPO + SAGE token guide", None, rl__loss_type="grpo", sage__guide="token", **_KL),
    _m("sage_random", "GRPO + SAGE random guide", None, rl__loss_type="grpo", sage__guide="random", **_KL),
    # issue 39's evidence study: the objective-level form, and the branch threshold by the share of tokens shaped
    _m("sage_branch_reward", "GRPO + SAGE branch guide, objective-level form (sage.form=reward)", None,
       rl__loss_type="grpo", sage__form="reward", **_KL, **_BRANCH),
    _m("sage_branch_p95", "GRPO + SAGE branch guide, threshold = base p95 (~5% of tokens)", None,
       rl__loss_type="grpo", **_KL, sage__guide="branch", sage__branch__threshold="calibrated:p95"),
    _m("sage_branch_p99", "GRPO + SAGE branch guide, threshold = base p99 (~1% of tokens)", None,
       rl__loss_type="grpo", **_KL, sage__guide="branch", sage__branch__threshold="calibrated:p99"),
    _m("sage_branch_paper", "GRPO + SAGE branch guide, threshold 1.2 nats (the reference code's)", None,
       rl__loss_type="grpo", **_KL, sage__guide="branch", sage__branch__threshold=PAPER_THRESHOLD),
    _m("bnpo_branch", "BNPO + KL + branch guide", (0.271, 0.715), rl__loss_type="bnpo", **_KL, **_BRANCH),
    Method("dapo_branch", "DAPO + KL + branch guide", {**DAPO, "rl.beta": BETA, "rl.kl_mode": "reverse",
                                                       "sage.guide": "branch", "sage.branch.threshold": THRESHOLD},
           (0.267, 0.712)),
]
BY_KEY = {m.key: m for m in METHODS}


@dataclasses.dataclass(frozen=True)
class Budget:
    """Sizes of one mode of the study (identical for every method)."""
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int  # RL steps per run
    checkpoint_every: int
    log_every: int
    eval_problems: int  # first N problems of the held-out test split
    eval_n: int  # samples per problem
    eval_batch: int  # sampler rows per call (problems_per_batch = eval_batch // eval_n)
    val_problems: int  # calibration: the last V of the training split, train[TRAIN_SIZE - V : TRAIN_SIZE]
    val_n: int  # calibration samples per problem


EVIDENCE_ONLY = ("sage_branch_reward", "sage_branch_p95", "sage_branch_p99", "sage_branch_paper")
# Full mode: the 200 steps of configs/tiny.py, 128 held-out problems (README "Budget" for the estimate).
FULL = Budget(methods=tuple(m.key for m in METHODS if m.key not in EVIDENCE_ONLY), seeds=(0, 1, 2), steps=200, checkpoint_every=100,
              log_every=5, eval_problems=128, eval_n=256, eval_batch=512, val_problems=64, val_n=16)
# Core mode: the methods every counted claim comparison reads (stats.CLAIMS), 2 seeds, n = 128; the
# uncounted BNPO/DAPO + branch rows are left out. About 65 minutes on 2 cores.
CORE = Budget(methods=("base", "grpo", "bnpo", "dapo", "forward_kl", "sage_branch", "sage_token", "sage_random"),
              seeds=(0, 1), steps=200,
              checkpoint_every=100, log_every=5, eval_problems=128, eval_n=128, eval_batch=512, val_problems=64,
              val_n=16)
# Evidence mode (issue 39): the branch guide against GRPO and the token / random guides, its objective-level form
# and the threshold study, at the 7 seeds the core run's power table asks for (branch - GRPO pass@1, two-level),
# n = 256 so that pass@k reaches 256. Settings fixed before any of its runs (README "Evidence study"); about
# 5 hours on 2 cores, resumable, so it may run across sessions.
EVIDENCE_METHODS = ("base", "grpo", "sage_branch", "sage_token", "sage_random", "sage_branch_reward",
                    "sage_branch_p95", "sage_branch_p99", "sage_branch_paper")
EVIDENCE = Budget(methods=EVIDENCE_METHODS, seeds=tuple(range(7)), steps=200, checkpoint_every=100, log_every=5,
                  eval_problems=128, eval_n=256, eval_batch=512, val_problems=64, val_n=16)
# Quick mode: the whole pipeline, strategy metrics included, in a few minutes (tests/test_sage_miniature.py).
QUICK = Budget(methods=("base", "grpo", "sage_branch"), seeds=(0,), steps=4, checkpoint_every=2,
               log_every=1, eval_problems=8, eval_n=8, eval_batch=64, val_problems=8, val_n=4)

# Calibration rule, fixed before any pass@k is seen (README "Calibration"): the branch guide should shape
# the high-entropy "forking" minority of tokens, the top 20% by entropy (Wang et al. 2025); for the tiny
# model that is the 80th percentile of the base's per-token entropy on validation problems, the last V of
# the 50k training split, sampled with the rollout settings. There is no pool to stay outside of: RL draws
# 8 x 200 = 1600 of the 50k training problems per run, so a run may share a few prompts with the validation
# problems, which is harmless for an entropy quantile of the untrained base. The test split is disjoint
# from train by construction. Ratio 0.3 and q in [0.6, 1.4] stay at the reference values; the token and
# random guides keep their reference defaults.
CALIBRATION_QUANTILE = 0.8
TRAIN_SIZE = 50000  # training problems of the `strategies` builder config (builders.STRATEGIES_TASK)
TEST_SIZE = 500  # its held-out problems: the most an evaluation can use (the cap of the power estimate)
MAX_NEW_TOKENS = 96  # rollout.max_new_tokens = eval.max_new_tokens of configs/tiny.py
CALIBRATION_RULE = ("branch threshold = 80th percentile of the tiny base's per-token entropy (nats) on its "
                    "completions of validation problems train[50000-V:50000] (the last V of the 50k training "
                    "problems; RL draws 1600 of them per run, so a few may overlap a run's prompts, harmless "
                    "for an entropy quantile; disjoint from the test split), temperature 1.0, <= 96 tokens: "
                    "the top-20% high-entropy 'forking' tokens of Wang et al. 2025 are shaped; ratio 0.3, "
                    "q in [0.6, 1.4] unchanged")


def val_start(b: Budget) -> int:
    """First validation problem of the calibration: the last `b.val_problems` of the training split."""
    return TRAIN_SIZE - b.val_problems
