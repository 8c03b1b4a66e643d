"""Host-side verifiable rewards: math-verify (in a process pool, `sage_jax.rewards.pool`), format and
exact-match rewards, and the registry a config's `rl.reward` spec names.

`math_verify_reward(completions, answers)` is the verifier the RL step calls (through
`jax.pure_callback`); it returns a float32 numpy array of 1.0 / 0.0 and never raises or hangs.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from sage_jax.rewards.boxed import last_boxed, to_text, verifier_text
from sage_jax.rewards.pool import RewardStats, VerifierPool, as_batch, default_pool
from sage_jax.rewards.worker import DEFAULT_TIMEOUT_S, MAX_ANSWER_CHARS, MAX_COMPLETION_CHARS

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- math-verify
# Defined here, not in `pool`: an evaluation records its verifier by qualified name
# (`sage_jax.rewards.verifiers.math_verify_reward`) and refuses to resume under another one.


def math_verify_reward_with_stats(
    completions: Sequence[Any],
    answers: Sequence[Any],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: VerifierPool | None = None,
    mode: str = "boxed",
) -> tuple[np.ndarray, RewardStats]:
    """`math_verify_reward` plus the call's counts (timeouts, errors, ...); `mode` as VerifierPool.verify."""
    try:
        return (pool or default_pool()).verify(completions, answers, timeout_s=timeout_s, mode=mode)
    except Exception as e:  # noqa: BLE001  (e.g. mismatched lengths: still never raise)
        logger.error("math_verify_reward failed, scoring the batch 0: %s: %s", type(e).__name__, e)
        n = len(as_batch(completions))
        return np.zeros((n,), np.float32), RewardStats(n=n, errors=n, statuses=["error:call"] * n)


def math_verify_reward(
    completions: Sequence[Any],
    answers: Sequence[Any],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: VerifierPool | None = None,
) -> np.ndarray:
    """1.0 where the completion's final answer equals the gold answer (math-verify), else 0.0.

    The completion's answer is its last `\\boxed{}`, else math-verify's own extraction. float32
    array of shape `[len(completions)]`; never raises, never hangs (hard per-sample timeout).
    """
    return math_verify_reward_with_stats(completions, answers, timeout_s, pool)[0]


def math_verify_text_reward(
    completions: Sequence[Any],
    answers: Sequence[Any],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: VerifierPool | None = None,
) -> np.ndarray:
    """The official SAGE reward: `verify(parse(gold), parse(completion))` on the whole text, 0 on any
    exception or timeout (configs/sage_official.py)."""
    return math_verify_reward_with_stats(completions, answers, timeout_s, pool, mode="text")[0]




# ----------------------------------------------------------------------------- cheap rewards

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def format_reward(
    completions: Sequence[Any], answers: Sequence[Any] | None = None, wrapper: str = "boxed"
) -> np.ndarray:
    """1.0 where the answer sits in the expected wrapper, else 0.0.

    `boxed`: a complete non-empty `\\boxed{...}`. `think`: one `</think>` (and at most one
    `<think>` before it; the R1 prompt may already open the tag) followed by a boxed answer.
    """
    del answers
    out = np.zeros((len(completions),), np.float32)
    for i, c in enumerate(completions):
        text = verifier_text(to_text(c), MAX_COMPLETION_CHARS)
        if wrapper == "boxed":
            ok = bool(last_boxed(text))
        elif wrapper == "think":
            n_open, n_close = text.count(_THINK_OPEN), text.count(_THINK_CLOSE)
            ok = n_close == 1 and n_open <= 1
            if ok and n_open == 1:
                ok = text.index(_THINK_OPEN) < text.index(_THINK_CLOSE)
            ok = ok and bool(last_boxed(text.split(_THINK_CLOSE, 1)[1]))
        else:
            raise ValueError(f"unknown wrapper {wrapper!r}; expected 'boxed' or 'think'")
        out[i] = float(ok)
    return out


def _normalize(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(",", "")) if re.fullmatch(r"[-+]?[\d,]*\.?\d+(/\d+)?", s) else None
    except (ValueError, ZeroDivisionError):
        return None


def exact_match_reward(completions: Sequence[Any], answers: Sequence[Any]) -> np.ndarray:
    """1.0 where the last `\\boxed{}` equals the gold after whitespace normalisation.

    Numbers compare by value (`-05` == `-5`, `0.50` == `1/2`); for procedural tasks, in-process.
    """
    completions, answers = as_batch(completions), as_batch(answers)
    out = np.zeros((len(completions),), np.float32)
    for i, (c, a) in enumerate(zip(completions, answers)):
        pred = last_boxed(verifier_text(to_text(c), MAX_COMPLETION_CHARS))
        if pred is None:
            continue
        p, g = _normalize(pred), _normalize(to_text(a))
        if len(p) > MAX_ANSWER_CHARS or not g:
            continue
        pn, gn = _as_number(p), _as_number(g)
        out[i] = float(pn == gn if (pn is not None and gn is not None) else p == g)
    return out


# ----------------------------------------------------------------------------- registry

VERIFIER_MODES = {"math_verify": "boxed", "math_verify_text": "text"}  # rewards the verifier pool computes

RewardFn = Callable[..., np.ndarray]  # (completions, answers) -> float32 [N]

REWARD_FNS: dict[str, RewardFn] = {
    "math_verify": math_verify_reward,
    "math_verify_text": math_verify_text_reward,
    "format": format_reward,
    "think_format": lambda c, a=None: format_reward(c, a, wrapper="think"),
    "exact_match": exact_match_reward,
}


def register_reward(name: str, fn: RewardFn) -> None:
    """Add a reward function `fn(completions, answers) -> float32 [N]` to the registry."""
    REWARD_FNS[name] = fn


def parse_reward_spec(spec: str | Mapping[str, float] | Sequence[str]) -> dict[str, float]:
    """`"math_verify:1.0,format:0.1"`, `{"math_verify": 1.0}` or `["exact_match"]` -> weights."""
    if isinstance(spec, str):
        items: list[tuple[str, float]] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, w = part.partition(":")
            items.append((name.strip(), float(w) if w else 1.0))
        weights = dict(items)
    elif isinstance(spec, Mapping) or hasattr(spec, "items"):
        weights = {str(k): float(v) for k, v in spec.items()}
    else:
        weights = {str(k): 1.0 for k in spec}
    unknown = sorted(set(weights) - set(REWARD_FNS))
    if unknown or not weights:
        raise ValueError(f"unknown reward(s) {unknown} in {spec!r}; known: {sorted(REWARD_FNS)}")
    return weights


def compute_rewards(
    completions: Sequence[Any],
    answers: Sequence[Any],
    spec: str | Mapping[str, float] | Sequence[str] = "math_verify",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: VerifierPool | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], RewardStats]:
    """Weighted sum of the named rewards, each component, and the verifier's counts."""
    weights = parse_reward_spec(spec)
    total = np.zeros((len(completions),), np.float32)
    parts: dict[str, np.ndarray] = {}
    stats = RewardStats(n=len(completions))
    for name, w in weights.items():
        if name in VERIFIER_MODES:
            r, stats = math_verify_reward_with_stats(completions, answers, timeout_s, pool, VERIFIER_MODES[name])
        else:
            r = np.asarray(REWARD_FNS[name](completions, answers), np.float32)
        parts[name] = r
        total += np.float32(w) * r
    return total, parts, stats


# Why a sample's reward is not a verdict on the completion (HostReward's `failed` codes; 0 = verified):
FAIL_RAISED, FAIL_TIMEOUT, FAIL_GOLD, FAIL_VERIFIER = 1, 2, 3, 4
FAIL_NAMES = {FAIL_RAISED: "raised", FAIL_TIMEOUT: "timeout", FAIL_GOLD: "gold_unparsed", FAIL_VERIFIER: "verifier_error"}


def failure_code(status: str) -> int:
    """The failure code of a verifier status: a timeout, an unparsable gold or a verifier error is a failure
    of the verification, not a wrong answer (no answer and rejected towers are the completion's fault)."""
    if status == "timeout":
        return FAIL_TIMEOUT
    if status == "gold_unparsed":
        return FAIL_GOLD
    if status.startswith("error"):
        return FAIL_VERIFIER
    return 0


class SpecReward:
    """The reward of a config spec (`rl.reward`): `fn(completions, answers) -> float32 [N]`, and
    `fn.with_failures(...) -> (rewards, failure codes int32 [N])` for the training step's metrics."""

    def __init__(self, spec, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.weights, self.timeout_s = parse_reward_spec(spec), timeout_s
        self.__name__ = self.__qualname__ = "SpecReward(" + ",".join(f"{k}:{v:g}" for k, v in self.weights.items()) + ")"

    def with_failures(self, completions, answers) -> tuple[np.ndarray, np.ndarray]:
        total, _, stats = compute_rewards(completions, answers, self.weights, self.timeout_s)
        codes = np.zeros(len(total), np.int32)
        if set(VERIFIER_MODES) & set(self.weights) and len(stats.statuses) == len(total):
            codes[:] = [failure_code(s) for s in stats.statuses]
        return total, codes

    def __call__(self, completions, answers) -> np.ndarray:
        return self.with_failures(completions, answers)[0]


def make_reward_fn(
    spec: str | Mapping[str, float] | Sequence[str] = "math_verify",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SpecReward:
    """A `(completions, answers) -> float32 [N]` function from a config spec (validated now)."""
    return SpecReward(spec, timeout_s)
