"""Procedural, verifiable integer arithmetic: the offline task of the embedded default.

A problem is `Compute 3+4*2-5.`; its worked solution reduces one operator per step
(`3+4*2-5 = 3+8-5 = 11-5 = 6. \\boxed{6}`), `*` and `/` first, left to right, so a tiny
character-level model can learn it by SFT and then improve under RL with an exact-match reward.
Everything is printable ASCII, short, and deterministic from a seed.

Train / test are disjoint by construction: the SHA-256 of the expression decides its split, so
no seed or size can put one expression in both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from sage_jax.data.strategies import STRATEGIES
from sage_jax.data.strategies import solution as strategy_solution

OPERATORS = "+-*/"


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty knobs of the arithmetic task."""

    min_operands: int = 2  # operands per expression, lower bound (>= 2)
    max_operands: int = 3  # operands per expression, upper bound
    max_value: int = 9  # operands are drawn from [min_value, max_value]
    min_value: int = 0
    operators: str = "+-*"  # subset of "+-*/"; "/" is always exact division
    test_fraction: float = 0.1  # share of the expression space (by hash) that is test-only
    # Solution procedures of the training records and their weights, e.g. (("rule", 0.3), ("left", 0.4)):
    # each record's worked solution follows one procedure, drawn with these weights and opened by its tag
    # (`sage_jax.data.strategies`). Empty: the untagged precedence solution of every record.
    strategy_mix: tuple = ()

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 2 <= min_operands <= max_operands, got {self}")
        if not 0 <= self.min_value < self.max_value:
            raise ValueError(f"need 0 <= min_value < max_value, got {self.min_value}, {self.max_value}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS!r}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.strategy_mix:
            names = [n for n, _ in self.strategy_mix]
            if set(names) - set(STRATEGIES) or len(set(names)) != len(names):
                raise ValueError(f"strategy_mix names must be distinct strategies of {sorted(STRATEGIES)}, "
                                 f"got {names}")
            if any(w <= 0 for _, w in self.strategy_mix):
                raise ValueError(f"strategy_mix weights must be > 0, got {self.strategy_mix}")
            if "/" in self.operators:
                raise ValueError("strategy_mix needs operators from '+-*' (the procedures have no division)")


Tokens = list  # alternating [int, str, int, str, ..., int]


def render(tokens: Tokens) -> str:
    return "".join(str(t) for t in tokens)


def sample_expression(rng: random.Random, spec: ArithmeticSpec) -> Tokens:
    """Draw one expression; a `/` divisor always divides the running product of its term."""
    n = rng.randint(spec.min_operands, spec.max_operands)
    tokens: Tokens = [rng.randint(spec.min_value, spec.max_value)]
    term = tokens[0]  # value of the current */ chain, evaluated left to right
    for _ in range(n - 1):
        op = rng.choice(spec.operators)
        if op == "/":
            divisors = [d for d in range(2, spec.max_value + 1) if term % d == 0]
            b = rng.choice(divisors) if divisors else 1
            term //= b
        else:
            b = rng.randint(spec.min_value, spec.max_value)
            term = term * b if op == "*" else b
        tokens += [op, b]
    return tokens


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    q, r = divmod(a, b)
    assert r == 0, "sample_expression only makes exact divisions"
    return q


def reduce_steps(tokens: Tokens) -> list[Tokens]:
    """Every intermediate expression, one operator reduced per step (`*` `/` first)."""
    steps = [list(tokens)]
    cur = list(tokens)
    while len(cur) > 1:
        ops = cur[1::2]
        k = next((i for i, o in enumerate(ops) if o in "*/"), 0)
        j = 2 * k + 1
        cur = cur[: j - 1] + [_apply(cur[j - 1], cur[j], cur[j + 1])] + cur[j + 2 :]
        steps.append(cur)
    return steps


def evaluate(tokens: Tokens) -> int:
    return reduce_steps(tokens)[-1][0]


def split_of(expression: str, test_fraction: float) -> str:
    """'test' or 'train', decided by the expression's hash alone."""
    h = int.from_bytes(hashlib.sha256(expression.encode("ascii")).digest()[:8], "big")
    return "test" if h / 2**64 < test_fraction else "train"


def make_example(tokens: Tokens, strategy: str | None = None) -> dict:
    """The shared record schema (see `sage_jax.data.sources`) for one expression; with `strategy`, the
    worked solution follows that procedure (`sage_jax.data.strategies`, wrong ones included)."""
    steps = reduce_steps(tokens)
    expr, answer = render(tokens), str(steps[-1][0])
    if strategy is None:
        solution = f"{' = '.join(render(s) for s in steps)}. \\boxed{{{answer}}}"
    else:
        solution = strategy_solution(tokens, strategy)[0]
    return {
        "id": "arith-" + hashlib.sha256(expr.encode("ascii")).hexdigest()[:16],
        "problem": f"Compute {expr}.",
        "answer": answer,
        "solution": solution,
        "source": "procedural_arithmetic",
        "subject": "arithmetic",
        "level": (len(tokens) + 1) // 2,
    }


def generate(spec: ArithmeticSpec, split: str, num_examples: int, seed: int = 0) -> list[dict]:
    """`num_examples` distinct problems of `split` ('train' or 'test'), deterministic in `seed`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{seed}:{split}:{spec}")
    seen: set[str] = set()
    out: list[dict] = []
    # A long run of draws with nothing new means the space is (nearly) exhausted.
    misses, max_misses = 0, 20000
    while len(out) < num_examples:
        if misses > max_misses:
            raise ValueError(
                f"only {len(out)} distinct {split} problems found for {spec} ({max_misses} draws "
                f"in a row gave nothing new); raise max_value / max_operands or ask for fewer "
                f"than {num_examples}"
            )
        tokens = sample_expression(rng, spec)
        expr = render(tokens)
        if expr in seen or split_of(expr, spec.test_fraction) != split:
            misses += 1
            continue
        misses = 0
        seen.add(expr)
        strategy = None
        if spec.strategy_mix:
            names, weights = zip(*spec.strategy_mix)
            # test records show a correct procedure; only the training corpus mixes them
            strategy = rng.choices(names, weights)[0] if split == "train" else "rule"
        out.append(make_example(tokens, strategy))
    return out
