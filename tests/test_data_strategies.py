"""The embedded testbed's task: procedures that are (in)correct as claimed, disjoint splits, determinism."""

import re

import pytest

from sage_jax.data import builders, procedural as P, strategies as S
from sage_jax.rewards.verifiers import exact_match_reward

SFT = P.ArithmeticSpec(**{k: v for k, v in builders.STRATEGIES_SFT_TASK.items() if k not in ("num_train", "num_test")})
RL = P.ArithmeticSpec(**{k: v for k, v in builders.STRATEGIES_TASK.items() if k not in ("num_train", "num_test")})


def _tokens(expr: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.findall(r"\d+|[-+*]", expr)]


def _py(expr: str) -> int:
    return eval(expr, {"__builtins__": {}})  # Python's precedence: the true value


def _fold(nums, ops):
    """Operators applied strictly in list order, each on the running value (an independent reference)."""
    v = nums[0]
    for op, b in zip(ops, nums[1:]):
        v = v + b if op == "+" else v - b if op == "-" else v * b
    return v


def _left(tokens):
    return _fold(tokens[0::2], tokens[1::2])


def _right(tokens):
    nums, ops = tokens[0::2], tokens[1::2]
    v = nums[-1]
    for op, a in zip(reversed(ops), reversed(nums[:-1])):
        v = a + v if op == "+" else a - v if op == "-" else a * v
    return v


def _steps_evaluate(working: str, value: int, rule: bool):
    """Every `=`-separated step of a working evaluates (with Python's precedence) to `value` for a correct
    procedure; the chain also drops exactly one operator per step."""
    chain = working.split("; ")[-1].split(" = ")
    if rule:
        assert all(_py(s) == value for s in chain), working
    n_ops = [len(re.findall(r"(?<=\d)[-+*]", s)) for s in chain]
    assert n_ops == list(range(n_ops[0], n_ops[0] - len(chain), -1)), working


@pytest.mark.parametrize("spec", [SFT, RL])
def test_each_procedure_computes_what_it_claims(spec):
    for ex in P.generate(spec, "train", 600, seed=3):
        expr = ex["problem"][len("Compute "):-1]
        toks = _tokens(expr)
        truth = _py(expr)
        assert int(ex["answer"]) == truth
        expected = {"rule": truth, "terms": truth, "left": _left(toks), "right": _right(toks)}
        for name, want in expected.items():
            text, value = S.solution(toks, name)
            assert value == want, (name, expr, text)
            assert text.startswith(f"{name}: ") and text.endswith(f"\\boxed{{{want}}}")
            assert S.strategy_of(text) == name
            assert S.STRATEGIES[name].correct == (name in ("rule", "terms"))
            working = text[len(name) + 2:].rsplit(". \\boxed{", 1)[0]
            if name in ("rule", "left", "right"):
                assert working.split(" = ")[0] == expr
            _steps_evaluate(working, want, rule=name == "rule")
        # the verifier scores a procedure's solution exactly when its value is the true one
        sols = [S.solution(toks, n)[0] for n in expected]
        got = exact_match_reward(sols, [ex["answer"]] * 4)
        assert list(got) == [float(v == truth) for v in expected.values()]


def test_wrong_procedures_are_wrong_where_order_matters():
    exs = P.generate(RL, "test", 300, seed=0)
    toks = [_tokens(e["problem"][len("Compute "):-1]) for e in exs]
    wrong_left = sum(_left(t) != S.true_value(t) for t in toks)
    wrong_right = sum(_right(t) != S.true_value(t) for t in toks)
    assert wrong_left > 100 and wrong_right > 150  # systematic, not rare, on 3-6 operands
    assert all(S.order_matters(t) == (_left(t) != S.true_value(t) or _right(t) != S.true_value(t)) for t in toks)


def test_terms_procedure_lists_each_product():
    text, value = S.solution(_tokens("3+4*2-5*3*2+1"), "terms")
    assert text == "terms: 4*2 = 8, 5*3*2 = 15*2 = 30; 3+8-30+1 = 11-30+1 = -19+1 = -18. \\boxed{-18}"
    assert S.solution(_tokens("2*3*4"), "terms")[0] == "terms: 2*3*4 = 6*4 = 24. \\boxed{24}"
    assert S.solution(_tokens("2+3-4"), "terms")[0] == "terms: 2+3-4 = 5-4 = 1. \\boxed{1}"


def test_mix_deterministic_and_weighted():
    a = P.generate(SFT, "train", 4000, seed=0)
    assert a == P.generate(SFT, "train", 4000, seed=0)
    assert a != P.generate(SFT, "train", 4000, seed=1)
    shares = {n: sum(S.strategy_of(e["solution"]) == n for e in a) / len(a) for n, _ in builders.STRATEGY_MIX}
    for n, w in builders.STRATEGY_MIX:
        assert abs(shares[n] - w) < 0.03, (n, shares)
    # the test split shows a correct procedure only
    assert {S.strategy_of(e["solution"]) for e in P.generate(SFT, "test", 200, seed=0)} == {"rule"}
    assert {e["level"] for e in a} == {3, 4, 5}
    assert {e["level"] for e in P.generate(RL, "test", 400, seed=0)} == {3, 4, 5, 6}


def test_train_and_test_disjoint_across_the_sft_and_rl_configs():
    test = {e["problem"] for e in P.generate(RL, "test", 500, seed=0)}
    for spec in (SFT, RL):
        train = {e["problem"] for e in P.generate(spec, "train", 20000, seed=0)}
        assert not train & test


def test_strategy_of_reads_only_an_opening_tag():
    assert S.strategy_of("  rule: 1+2 = 3. \\boxed{3}") == "rule"
    assert S.strategy_of("rules: 1+2") is None
    assert S.strategy_of("1+2 = 3. left: \\boxed{3}") is None
    assert S.strategy_of("") is None


def test_bad_mixes_are_refused():
    with pytest.raises(ValueError, match="distinct strategies"):
        P.ArithmeticSpec(strategy_mix=(("rule", 1.0), ("guess", 1.0)))
    with pytest.raises(ValueError, match="> 0"):
        P.ArithmeticSpec(strategy_mix=(("rule", 0.0),))
    with pytest.raises(ValueError, match="division"):
        P.ArithmeticSpec(operators="+*/", strategy_mix=(("rule", 1.0),))
