"""Prompt templates, chosen by config (`config.data.template`).

- `chat`: the tokenizer's own chat template, the problem as the only user message.
- `sage`: the chat template with the reference system prompt (`SAGE_SYSTEM_PROMPT`).
- `r1`: an R1-Zero-style plain-text conversation that opens a `<think>` block for the model.
- `plain`: `Q: {problem} A: ` (printable ASCII only, for the tiny character-level model).
- `chat:<text with {problem}>`: the chat template, the user message being that text (e.g. an instruction
  after the problem, as DeepSeek-R1's card advises, with the model's own turn tokens and BOS).
- `official_base`: the official SAGE code's chat template for base models (its CHAT_TEMPLATE, set on the
  tokenizer before SFT and kept for RL): the official system prompt, EOS, the problem, then
  `<start_working_out>` as the generation prompt. `official_base:<text with {problem}>` wraps the problem
  first (the official evaluation's user turn, `OFFICIAL_EVAL_USER`).
- any other string containing `{problem}`: used as a plain format string (no chat template).

Without a tokenizer (or one without a chat template), `chat` / `sage` fall back to plain text
(`{system}\\n\\n{problem}\\n`), so the same config runs with character-level models.
"""

from __future__ import annotations

from typing import Any, Callable

# The instruction of the Qwen2.5-Math evaluation, used as the system prompt of the SAGE / GRPO
# reference runs on Qwen2.5-Math (the verifier reads the last \boxed{}).
SAGE_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

# The official SAGE code's system prompt (tally0818/SAGE src/train/common.py, src/data/loaders.py), verbatim:
# working out between the reasoning tags, then the answer between <SOLUTION></SOLUTION>.
OFFICIAL_SYSTEM_PROMPT = (
    "You are given a problem.\n"
    "Think about the problem and provide your working out.\n"
    "Place it between <start_working_out> and <end_working_out>.\n"
    "Then, provide your solution between <SOLUTION></SOLUTION>"
)

R1_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <think> "
    "</think> tags, and the final answer follows it within \\boxed{}, i.e., <think> reasoning "
    "process here </think> final answer here with \\boxed{answer}.\n"
    "User: {problem}\nAssistant: <think>"
)

# The official SAGE code's evaluation user turn (src/data/loaders.py), after its system prompt.
OFFICIAL_EVAL_USER = "Problem: {problem}\n\nSolve this step by step and provide your final numerical answer."

PLAIN_TEMPLATE = "Q: {problem} A: "

TEMPLATES = ("chat", "sage", "r1", "plain", "official_base")

# The official reasoning and answer tags (src/train/common.py).
REASONING_START, REASONING_END = "<start_working_out>", "<end_working_out>"
SOLUTION_START, SOLUTION_END = "<SOLUTION>", "</SOLUTION>"


def _official_base(problem: str, tokenizer: Any, system_prompt: str | None) -> str:
    """The official CHAT_TEMPLATE with add_generation_prompt: system + EOS, the user turn raw, then the
    reasoning tag. (Its SFT text continues with the assistant turn and EOS: see sources' OMR-mini records.)"""
    eos = getattr(tokenizer, "eos_token", None) or ""
    return (system_prompt or OFFICIAL_SYSTEM_PROMPT) + eos + problem + REASONING_START


def _chat(problem: str, tokenizer: Any, system_prompt: str | None) -> str:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": problem})
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return (f"{system_prompt}\n\n" if system_prompt else "") + f"{problem}\n"


def format_prompt(
    problem: str, template: str = "sage", tokenizer: Any = None,
    system_prompt: str | None = None,
) -> str:
    """The prompt text for one problem under `template` (see the module docstring)."""
    if template == "chat":
        return _chat(problem, tokenizer, system_prompt)
    if template.startswith("chat:"):
        return _chat(template[len("chat:"):].replace("{problem}", problem), tokenizer, system_prompt)
    if template == "sage":
        return _chat(problem, tokenizer, system_prompt or SAGE_SYSTEM_PROMPT)
    if template == "official_base":
        return _official_base(problem, tokenizer, system_prompt)
    if template.startswith("official_base:"):
        return _official_base(template[len("official_base:"):].replace("{problem}", problem), tokenizer,
                              system_prompt)
    if template == "r1":
        return R1_TEMPLATE.replace("{problem}", problem)
    if template == "plain":
        return PLAIN_TEMPLATE.replace("{problem}", problem)
    if "{problem}" in template:
        # `replace`, not `format`: problems and templates are full of LaTeX braces.
        return template.replace("{problem}", problem)
    raise ValueError(f"unknown template {template!r}; use one of {TEMPLATES} or a '{{problem}}' string")


def make_template_fn(
    template: str = "sage", tokenizer: Any = None, system_prompt: str | None = None
) -> Callable[[str], str]:
    """`problem -> prompt` for one template (validated now, not at the first record)."""
    format_prompt("x", template, tokenizer, system_prompt)
    return lambda problem: format_prompt(problem, template, tokenizer, system_prompt)
