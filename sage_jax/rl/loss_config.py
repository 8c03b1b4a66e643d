"""The loss's static configuration (`LossConfig`, a frozen dataclass: a static jit argument) and its choices.
`sage_jax.rl.losses` computes what these fields select; the formulas are in its docstring."""

from __future__ import annotations

import dataclasses
import math

ESTIMATORS = ("k1", "k2", "k3")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
TOKEN_SUM_TYPES = ("dapo", "cispo")  # normalised by the generation batch's tokens
KL_MODES = ("reverse", "forward")
IS_LEVELS = ("token", "sequence")
MISMATCH_LEVELS = ("token", "sequence", "geometric")
SAGE_FORMS = ("loss", "reward")
# Named sampler corrections: the defaults of TRL 0.23 (token_truncate, cap 2) and TRL >= 1.6 (sequence_mask:
# the sequence weight exp(sum_t (old_t - sampler_t)) kept where <= 3, else 0), as LossConfig fields.
SAMPLER_CORRECTIONS = {
    "trl_0.23": dict(tis_cap=2.0, mismatch_level="token"),
    "trl_1.16": dict(mis_bounds=(0.0, 3.0), mismatch_level="sequence"),
}


def _finite(field: str, value) -> None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{field}={value} must be a finite number")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static loss configuration (frozen, hashable: usable as a static jit argument). Errors name the run
    config's fields (`rl.*`, `sage.form`), which `config_lib.loss_config` fills in."""

    loss_type: str = "grpo"  # aggregation: grpo | bnpo | dr_grpo | dapo | cispo
    beta: float = 0.05  # KL coefficient (dimensionless, per token); 0 disables the KL term
    estimator: str = "k3"  # reverse-KL estimator against the shaped anchor: k1 | k2 | k3
    kl_mode: str = "reverse"  # reverse (shaped anchor, estimator) | forward (exact, to pi_ref)
    eps_low: float = 0.2  # PPO clip below: ratio >= 1 - eps_low (dimensionless)
    eps_high: float = 0.2  # PPO clip above: ratio <= 1 + eps_high (DAPO clip-higher: 0.28); cispo: the cap on
    #                        its importance weight (TRL's epsilon_high; MiniMax-M1 / TRL recommend 5.0)
    delta: float | None = None  # cap on the unclipped ratio (two-sided clip); >= 1 + eps_high
    importance_sampling_level: str = "token"  # token | sequence (GSPO geometric mean)
    max_completion_length: int | None = None  # T_max of dr_grpo, tokens; None -> the T axis
    # Truncated importance sampling against the sampler (TRL's token_truncate): the policy-gradient term of each
    # token is weighted by min(w, tis_cap), w the sampler weight below. None = off.
    tis_cap: float | None = None
    # Masked importance sampling (TRL's token_mask / sequence_mask, IcePop): weight w inside [lo, hi], 0 outside
    # (with tis_cap: min(w, tis_cap) inside). None = off.
    mis_bounds: tuple[float, float] | None = None
    # Rejection only (verl's rollout_rs): weight 1 inside [lo, hi], 0 outside (with tis_cap: min(w, cap)). None = off.
    rs_bounds: tuple[float, float] | None = None
    # The sampler weight w of TIS, MIS and RS: per token exp(old_t - sampler_t) | per sequence exp(sum_t ...)
    # (the product of the token weights) | geometric exp(mean_t ...).
    mismatch_level: str = "token"
    # Off-policy sequence masking (DeepSeek-V3.2 eq. 9, TRL's off_policy_mask_threshold): a sequence with
    # A < 0 whose mean_t (sampler_t - lp_t) exceeds this leaves the policy-gradient term. None = off.
    opsm_threshold: float | None = None
    # High-entropy forking tokens (Wang et al. 2025, "Beyond the 80/20 rule"): only the top fraction of the
    # update's completion tokens by policy entropy get the policy gradient (the KL term keeps all). 1 = off.
    entropy_top_frac: float = 1.0
    # Entropy bonus (TRL's entropy_coef): minus this times the mean token entropy (differentiated). 0 = off.
    entropy_coef: float = 0.0
    # Where SAGE's guide enters (reverse KL only): "loss", the code-level form (k3 against ref + log q), or
    # "reward", the objective-level form KL(pi || q pi_ref) = KL(pi || pi_ref) - E[sum_t log q_t]: the KL
    # against pi_ref alone plus a sequence reward bonus beta sum_t log q_t added to the advantage (no baseline).
    sage_form: str = "loss"

    def __post_init__(self) -> None:
        def choice(field: str, choices: tuple, name: str | None = None) -> None:
            v = getattr(self, field)
            if v not in choices:
                raise ValueError(f"{name or 'rl.' + field}={v!r} is not one of {choices}")

        choice("loss_type", LOSS_TYPES)
        choice("estimator", ESTIMATORS)
        choice("kl_mode", KL_MODES)
        choice("importance_sampling_level", IS_LEVELS)
        choice("mismatch_level", MISMATCH_LEVELS)
        choice("sage_form", SAGE_FORMS, "sage.form")
        for f in ("beta", "eps_low", "eps_high", "delta", "tis_cap", "opsm_threshold", "entropy_top_frac",
                  "entropy_coef"):
            _finite(f"rl.{f}", getattr(self, f))
        # written as `not (ok)` so that NaN fails them too
        if not self.beta >= 0:
            raise ValueError(f"rl.beta must be >= 0, got {self.beta}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"rl.eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0:
            raise ValueError(f"rl.eps_high must be >= 0, got {self.eps_high}")
        if self.delta is not None and not self.delta >= 1 + self.eps_high:
            raise ValueError(f"rl.delta={self.delta} must be >= 1 + rl.eps_high={1 + self.eps_high} (a cap inside "
                             "the clip range would defeat the PPO clip)")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"rl.tis_cap must be > 0 (or None = off), got {self.tis_cap}")
        for f in ("mis_bounds", "rs_bounds"):
            b = getattr(self, f)
            if b is not None and not (len(b) == 2 and all(math.isfinite(x) for x in b) and 0 <= b[0] < 1 < b[1]):
                raise ValueError(f"rl.{f}={b} must be (lo, hi) with 0 <= lo < 1 < hi")
        if self.mis_bounds is not None and self.rs_bounds is not None:
            raise ValueError("rl.mis_bounds and rl.rs_bounds are two answers to one question (weight the kept "
                             "tokens, or only reject the others): set one")
        if self.opsm_threshold is not None and not self.opsm_threshold >= 0:
            raise ValueError(f"rl.opsm_threshold must be >= 0 (or None = off), got {self.opsm_threshold}")
        if not 0 < self.entropy_top_frac <= 1:
            raise ValueError(f"rl.entropy_top_frac={self.entropy_top_frac} must be in (0, 1]")
        if not self.entropy_coef >= 0:
            raise ValueError(f"rl.entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"rollout.max_new_tokens (dr_grpo's T_max) must be >= 1, got "
                             f"{self.max_completion_length}")

    @property
    def corrects_sampler(self) -> bool:
        return self.tis_cap is not None or self.mis_bounds is not None or self.rs_bounds is not None
