"""configs/sage_official.py against the official SAGE recipe, field by field.

The fixture below is read from github.com/tally0818/SAGE at commit c9b3b69a8f3d0200a19e67e61aaf57c2b9fe3ee0
(configs/train_config.yaml; src/train/common.py build_grpo_config, apply_lora_if_needed, system_prompt;
src/train/rewards.py) and, where the official code sets nothing, TRL 0.23's GRPOConfig / TrainingArguments
defaults. Each value is compared with what the preset resolves to through this project's own config
builders (config_lib.rl_config / optim_config / lora_config), not with the preset's literals.
"""

import functools
import importlib.util
import os

import numpy as np
import pytest

from sage_jax import config_lib
from xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "tally0818/SAGE@c9b3b69a8f3d0200a19e67e61aaf57c2b9fe3ee0 + TRL 0.23 defaults"

OFFICIAL_SYSTEM_PROMPT = """You are given a problem.
Think about the problem and provide your working out.
Place it between <start_working_out> and <end_working_out>.
Then, provide your solution between <SOLUTION></SOLUTION>"""

OFFICIAL = {  # name: value, as the official run sees it
    "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "gradient_checkpointing": True,
    "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,  # alpha: the code's default, 2 x rank
    "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "train_dataset": "open-r1/DAPO-Math-17k-Processed:en",
    "temperature": 1.0, "min_p": 0.01, "top_p": 1.0, "top_k": -1,
    "generation_batch_size": 16, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "num_generations": 8, "num_iterations": 1,
    "max_prompt_length": 2048, "max_completion_length": 6144,
    "stop": ["</SOLUTION>"], "include_stop_str_in_output": True,
    "trainer_seed": 3407, "max_steps": 1000, "save_steps": 100,
    "learning_rate": 5e-6, "lr_scheduler": "constant", "warmup_ratio": 0.1,
    "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0,
    "optimizer": "adamw_8bit",
    "loss_type": "grpo", "beta": 0.05, "epsilon": 0.2, "epsilon_high": 0.2, "delta": None,
    "scale_rewards": "group", "importance_sampling_level": "token",
    "vllm_importance_sampling_correction": True, "vllm_importance_sampling_cap": 2.0,
    "vllm_importance_sampling_level": "token",
    "shuffle_before_split": True,  # shuffle_sequence_dict, then split_tensor_dict (grpo_trainer.py:996)
    "guide": "branch", "branch_ratio": 0.3, "branch_threshold": 1.2, "q_min": 0.6, "q_max": 1.4,
    "branch_source": "new",
    # configs/train_config.yaml sage.token / sage.random (CosineAnnealingScheduler's ub -> lb, N cycles, decay)
    "token_alpha": (0.3, 0.1), "token_sigma": (0.25, 0.1), "token_cycles": 8, "token_decay": 0.9,
    "token_source": "new", "token_norm": "minmax",
    "random_eps": (0.1, 0.0), "random_sigma": (0.15, 0.05), "random_cycles": 8, "random_decay": 0.9,
    "system_prompt": OFFICIAL_SYSTEM_PROMPT, "reward": "verify(parse(gold), parse(completion)), 0 on exception",
}

# Where this project differs, and why. A key here is not compared.
DEVIATIONS = {
    "optimizer": "8-bit AdamW (bitsandbytes) has no optax counterpart: fp32 moments, same AdamW update",
    "warmup_ratio": "not a deviation in effect: HF's 'constant' scheduler ignores warmup_ratio (no warm-up)",
    "top_k": "-1 (vLLM: off) is this project's 0 (off)",
    "trainer_seed": "the seed is the same number, but JAX's RNG streams are not torch's / vLLM's: the runs "
                    "are the same recipe, not the same samples",
}


def _preset(arg=None):
    spec = importlib.util.spec_from_file_location("sage_official", os.path.join(ROOT, "configs", "sage_official.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


@functools.lru_cache(maxsize=None)
def _stop_string_kept() -> bool:
    """Whether a completion cut by a stop string keeps it, as the sampler does it (vLLM's
    include_stop_str_in_output): the tiny base sampled with and without the stop string " = "."""
    import dataclasses

    from sage_jax.defaults import TINY_BASE
    from sage_jax.models import hf
    from sage_jax.sampling import SamplingConfig, TextSampler
    from sage_jax.stop_strings import StopStrings
    model, mcfg = hf.load(TINY_BASE)
    tok = hf.load_tokenizer(TINY_BASE)
    eos, pad = hf.sampling_ids(tok, mcfg)
    cfg = SamplingConfig(max_new_tokens=40, eos_ids=eos, pad_id=pad, decode_segments=1)
    prompt = tok.apply_chat_template([{"role": "user", "content": "3*4+5*2"}], add_generation_prompt=True,
                                     tokenize=False)
    free = TextSampler(model, tok, cfg, batch_size=8).generate([prompt], n=8, seed=0)[0]
    stop = StopStrings.for_tokenizer([" = "], tok, mcfg.vocab_size)
    cut = TextSampler(model, tok, dataclasses.replace(cfg, stop=stop), batch_size=8).generate([prompt], 8, 0)[0]
    hits = [(f.text, c.text) for f, c in zip(free, cut) if " = " in f.text]
    assert hits, "no sample holds the stop string"
    return all(c == f[:f.index(" = ") + 3] for f, c in hits)


def _resolved(c) -> dict:
    """The preset as this project runs it, in the official names."""
    from sage_jax.rewards.verifiers import REWARD_FNS, math_verify_text_reward
    from sage_jax.sampling import SamplingConfig
    stop = object()  # stands for the compiled stop strings (they need the 7B tokenizer)
    rl = config_lib.rl_config(c).with_tokenizer((1,), 0, stop)
    assert isinstance(rl.sampling, SamplingConfig) and rl.sampling.stop is stop
    opt = config_lib.optim_config(c)
    lora = config_lib.lora_config(c)
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
             "down": "down_proj"}
    per_generation = rl.num_iterations * rl.num_minibatches
    rows = c.data.batch_size * rl.group_size
    guide_of = lambda name: config_lib.guide_config(_with_guide(c, name))
    tok_g, rnd_g = guide_of("token"), guide_of("random")
    return {
        "model": c.model.path, "gradient_checkpointing": c.model.remat == "full",
        "lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "lora_targets": tuple(names[t] for t in lora.targets),
        "train_dataset": {"dapo_math_17k_en": "open-r1/DAPO-Math-17k-Processed:en"}.get(c.data.name, c.data.name),
        "temperature": rl.sampling.temperature, "min_p": rl.sampling.min_p, "top_p": rl.sampling.top_p,
        "top_k": rl.sampling.top_k, "generation_batch_size": rows,
        "per_device_train_batch_size": rows // rl.num_minibatches,
        "gradient_accumulation_steps": rl.grad_accum_steps,
        "num_generations": rl.group_size, "num_iterations": rl.num_iterations,
        "max_prompt_length": c.data.max_prompt_tokens, "max_completion_length": rl.sampling.max_new_tokens,
        "stop": list(c.rollout.stop_strings), "include_stop_str_in_output": _stop_string_kept(),
        "trainer_seed": c.seed, "max_steps": c.max_steps * per_generation,
        "save_steps": c.checkpoint_every * per_generation,
        "learning_rate": opt.learning_rate, "lr_scheduler": opt.schedule, "warmup_ratio": opt.warmup_steps,
        "weight_decay": opt.weight_decay, "adam_beta1": opt.b1, "adam_beta2": opt.b2, "adam_epsilon": opt.eps,
        "max_grad_norm": opt.grad_clip_norm, "optimizer": "adamw",
        "loss_type": rl.loss.loss_type, "beta": rl.loss.beta, "epsilon": rl.loss.eps_low,
        "epsilon_high": rl.loss.eps_high, "delta": rl.loss.delta, "scale_rewards": rl.scale_rewards,
        "importance_sampling_level": rl.loss.importance_sampling_level,
        "vllm_importance_sampling_correction": rl.loss.tis_cap is not None,
        "vllm_importance_sampling_cap": rl.loss.tis_cap,
        "vllm_importance_sampling_level": rl.loss.mismatch_level,
        "shuffle_before_split": rl.update_shuffle == "rows",
        "guide": rl.guide.name, "branch_ratio": getattr(rl.guide.cfg, "ratio", None),
        "branch_threshold": getattr(rl.guide.cfg, "threshold", None),
        "q_min": rl.guide.cfg.q_min, "q_max": rl.guide.cfg.q_max, "branch_source": rl.guide.cfg.source,
        "token_alpha": (tok_g.alpha_ub, tok_g.alpha_lb), "token_sigma": (tok_g.sigma_ub, tok_g.sigma_lb),
        "token_cycles": tok_g.num_cycles, "token_decay": tok_g.decay, "token_source": tok_g.source,
        "token_norm": tok_g.norm, "random_eps": (rnd_g.eps_ub, rnd_g.eps_lb),
        "random_sigma": (rnd_g.sigma_ub, rnd_g.sigma_lb), "random_cycles": rnd_g.num_cycles,
        "random_decay": rnd_g.decay,
        "system_prompt": c.data.system_prompt,
        "reward": ("verify(parse(gold), parse(completion)), 0 on exception"
                   if REWARD_FNS[c.rl.reward] is math_verify_text_reward else c.rl.reward),
        "_lora_param_dtype": str(config_lib.lora_param_dtype(c)),
    }


def _with_guide(c, name):
    c = c.copy_and_resolve_references()
    c.sage.guide = name
    return c


def test_every_official_value_is_resolved_or_a_listed_deviation():
    got = _resolved(_preset())
    assert set(DEVIATIONS) <= set(OFFICIAL), "a deviation names a field the fixture does not have"
    wrong = {k: (v, got[k]) for k, v in OFFICIAL.items() if k not in DEVIATIONS and got[k] != v}
    assert not wrong, f"differs from {SOURCE} (official, resolved): {wrong}"
    assert got["warmup_ratio"] == 0 and got["top_k"] == 0  # what the deviations say
    assert "float32" in got["_lora_param_dtype"]  # PEFT's fp32 adapters on the bf16 base


@pytest.mark.parametrize("arg,guide,beta", [("grpo", "none", 0.05), ("nokl", "none", 0.0), ("token", "token", 0.05),
                                            ("random", "random", 0.05)])
def test_variants_change_only_the_guide_and_beta(arg, guide, beta):
    base, v = _resolved(_preset()), _resolved(_preset(arg))
    assert v["guide"] == guide and v["beta"] == beta
    changed = {k for k in base if base[k] != v[k]} - {"guide", "beta", "branch_ratio", "branch_threshold",
                                                       "q_min", "q_max", "branch_source"}
    # the token / random schedules are compared in every variant (they equal the official ones everywhere)
    assert not changed, changed


def test_template_is_the_official_system_prompt():
    from sage_jax.data.templates import OFFICIAL_SYSTEM_PROMPT as ours
    assert ours == OFFICIAL_SYSTEM_PROMPT


def _write_data(manual):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": f"{a}+{b}", "solution": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    (manual / "dapo_math_17k_en" / "en").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), manual / "dapo_math_17k_en" / "en" / "train-00000-of-00001.parquet")
    (manual / "math500").mkdir()
    (manual / "math500" / "test.jsonl").write_text("".join(
        json.dumps({"problem": f"{a}*{a}", "answer": str(a * a), "solution": "", "unique_id": f"p{a}",
                    "subject": "x", "level": 1}) + "\n" for a in range(2, 6)))


# The official evaluation (configs/eval_config.yaml generation:, src/data/loaders.py), same commit.
OFFICIAL_EVAL = {
    "k": 64, "temperature": 0.3, "top_p": 0.95, "max_new_tokens": 6144, "eval_limit": None,
    "stop": [],  # src/eval/eval_model.py generate_completions: HF generate with eos_token_id only
    "user": "Problem: {problem}\n\nSolve this step by step and provide your final numerical answer.",
    "datasets": ("HuggingFaceH4/MATH-500", "GAIR-NLP/AIME-Preview (2024, 2025-I, 2025-II)", "zwhe99/amc23",
                 "math-ai/minervamath"),
}
EVAL_DEVIATIONS = {"datasets": "AMC 2023 is read from math-ai/amc23's parquet (the same 40 problems as the "
                               "official zwhe99/amc23, not compared offline)"}


def test_evaluation_is_the_official_one():
    from sage_jax.data.sources import SPECS
    c = _preset()
    assert c.eval.template.startswith("chat:")
    benches = [b.partition(":")[0] for b in c.eval.benchmarks.split(",")]
    got = {"k": c.eval.n, "temperature": c.eval.temperature, "top_p": c.eval.top_p,
           "max_new_tokens": c.eval.max_new_tokens, "eval_limit": c.eval.num_problems or None,
           "stop": list(config_lib.eval_settings(c).sampler.get("stop_strings", [])),
           "user": c.eval.template.removeprefix("chat:"),  # the user turn of the model's own chat template
           "datasets": tuple(SPECS[b].hub_repo for b in benches)}
    wrong = {k: (v, got[k]) for k, v in OFFICIAL_EVAL.items() if k not in EVAL_DEVIATIONS and got[k] != v}
    assert not wrong, f"differs from {SOURCE} (official, resolved): {wrong}"
    assert got["datasets"] == ("HuggingFaceH4/MATH-500", "GAIR-NLP/AIME-Preview", "math-ai/amc23",
                               "math-ai/minervamath")


# The official SFT stage for base models (configs/train_config.yaml `sft:`, `model.max_seq_len: 8192`;
# src/train/common.py run_sft_if_needed, format_sft_example, CHAT_TEMPLATE), same commit.
OFFICIAL_SFT = {
    "dataset": "unsloth/OpenMathReasoning-mini:cot", "answer_filter": "pd.to_numeric(expected_answer) not null",
    "max_tokens": 8192 // 2, "loss_on": "all",  # SFTTrainer on dataset_text_field="text": every token
    "num_epochs": 2, "learning_rate": 2e-4, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
    "warmup_steps": 5, "lr_scheduler_type": "linear", "weight_decay": 0.01, "optim": "adamw_8bit", "seed": 42,
    "lora_rank": 8, "lora_alpha": 16,
}
SFT_DEVIATIONS = {"optim": DEVIATIONS["optimizer"]}


def test_sft_stage_is_the_official_one():
    c = _preset("qwen_math_sft")
    opt, lora = config_lib.optim_config(c), config_lib.lora_config(c)
    got = {
        "dataset": {"openmathreasoning_mini": "unsloth/OpenMathReasoning-mini"}.get(c.data.name, c.data.name)
        + ":" + c.data.train_split,
        "answer_filter": "pd.to_numeric(expected_answer) not null" if c.data.name == "openmathreasoning_mini" else "",
        "max_tokens": c.data.max_sft_tokens if c.data.sft_drop_longer else None, "loss_on": c.data.sft_loss_on,
        "num_epochs": c.data.num_epochs, "learning_rate": opt.learning_rate,
        "per_device_train_batch_size": c.data.batch_size, "gradient_accumulation_steps": 1,
        "warmup_steps": opt.warmup_steps, "lr_scheduler_type": opt.schedule, "weight_decay": opt.weight_decay,
        "optim": "adamw", "seed": c.seed, "lora_rank": lora.rank, "lora_alpha": lora.alpha,
    }
    wrong = {k: (v, got[k]) for k, v in OFFICIAL_SFT.items() if k not in SFT_DEVIATIONS and got[k] != v}
    assert not wrong, f"differs from {SOURCE} (official, resolved): {wrong}"
    assert c.mode == "sft" and c.model.path == "Qwen/Qwen2.5-Math-7B" and c.data.template == "official_base"
    rl = _preset("qwen_math,nokl")
    assert (rl.mode, rl.data.template, rl.rl.beta, rl.sage.guide) == ("rl", "official_base", 0.0, "none")
    with pytest.raises(ValueError, match="unknown variant 'qwen'"):
        _preset("qwen")


def test_official_base_template_is_the_official_chat_template():
    """Our `official_base` prompt equals the official CHAT_TEMPLATE rendered by jinja with
    add_generation_prompt, and prompt + OMR-mini solution + EOS equals its rendered SFT text."""
    jinja2 = pytest.importorskip("jinja2")
    from sage_jax.data import sources
    from sage_jax.data.templates import format_prompt

    chat_template = (  # src/train/common.py CHAT_TEMPLATE with its two placeholders substituted
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + eos_token }}"
        "{% set loop_messages = messages[1:] %}{% else %}{{ 'SYS' + eos_token }}{% set loop_messages = messages %}"
        "{% endif %}{% for message in loop_messages %}{% if message['role'] == 'user' %}{{ message['content'] }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_working_out>' }}{% endif %}")
    tok = type("Tok", (), {"eos_token": "<|endoftext|>"})()
    problem = "Find $x$ if $2x = 6$."
    row = {"problem": problem, "generated_solution": "<think>\nHalve it.\n</think>\nSo x = 3.",
           "expected_answer": "3"}
    official_assistant = "<start_working_out>" + "Halve it.\n</think>\nSo x = 3.".replace("</think>", "").strip() \
        + "<end_working_out><SOLUTION>3</SOLUTION>"
    msgs = [{"role": "system", "content": OFFICIAL_SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    render = lambda m, gen: jinja2.Template(chat_template).render(messages=m, eos_token=tok.eos_token,
                                                                     add_generation_prompt=gen)
    ours = format_prompt(problem, "official_base", tok)
    assert ours == render(msgs, True)
    rec = sources._omr_mini(row, 1)
    assert ours + rec["solution"] + tok.eos_token == render(msgs + [{"role": "assistant",
                                                                      "content": official_assistant}], False)
    assert sources._omr_mini({**row, "expected_answer": "\\frac{1}{2}"}, 2) is None


def test_numeric_answer_filter_is_pandas_to_numeric():
    """Expected values from pandas 2.x: pd.to_numeric(pd.Series([x]), errors="coerce").notnull()."""
    from sage_jax.data.sources import _is_number
    pandas_says = {"3": True, "3.5": True, "-2": True, "1e5": True, " 7 ": True, "inf": True, "+5": True, ".5": True,
                   "nan": False, "1/2": False, "\\frac{1}{2}": False, "1_000": False, "0x10": False, "": False,
                   "1,000": False, "\u0661": False}
    assert {x: _is_number(x) for x in pandas_says} == pandas_says


def _write_omr(manual):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"problem": f"What is {a}+{a}?", "generated_solution": f"<think>{a} and {a} make {2 * a}.</think>",
             "expected_answer": str(2 * a), "problem_type": "x"} for a in range(1, 4)]
    rows += [{"problem": "Simplify.", "generated_solution": "half", "expected_answer": "\\frac{1}{2}",
              "problem_type": "x"},  # not numeric: left out by the official filter
             {"problem": "Long one?", "generated_solution": "w" * 400, "expected_answer": "1",
              "problem_type": "x"}]  # over max_sft_tokens: dropped and counted
    (manual / "openmathreasoning_mini" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows),
                   manual / "openmathreasoning_mini" / "data" / "cot-00000-of-00001.parquet")


def test_sft_then_rl_chain_continues_the_adapter(tmp_path):
    """scripts/sage_official_qwen_math.sh on the shipped tiny model: the SFT stage (numeric filter, long rows
    dropped and counted, 2 epochs, loss on every token) then RL at lr 0 from its adapter: RL's exported
    adapter is the SFT's, bit for bit, and the KL to the reference (the raw base) is not 0.

    The RL stage is also the preset's exact code path, 2 steps at lr 0: LoRA on a bf16 base, min_p, 2 updates
    per generation batch, the stop string, the official reward, TIS, remat and in-training evaluation on locally
    prepared benchmark files. At lr 0 every update's ratio is exactly 1."""
    import json
    import subprocess
    import sys

    from sage_jax.defaults import TINY_BASE
    from sage_jax.data.templates import OFFICIAL_SYSTEM_PROMPT as sys_prompt
    from sage_jax.models import hf, safetensors_io as st
    _write_data(tmp_path / "manual")
    _write_omr(tmp_path / "manual")
    env = subprocess_env(HF_HUB_OFFLINE="1", PYTHON=sys.executable,
               SFT_FLAGS="--config.data.max_sft_tokens=400 --config.log_every=1",
               RL_FLAGS="--config.max_steps=2 --config.optim.learning_rate=0.0 --config.data.max_prompt_tokens=320 "
                        "--config.rollout.max_new_tokens=24 --config.eval_every=1 --config.eval.max_new_tokens=24 "
                        "--config.eval.n=2 --config.eval.batch_size=8 --config.eval.benchmarks=math500:test")
    common = [f"--config.model.path={TINY_BASE}", f"--config.data.manual_dir={tmp_path / 'manual'}",
              f"--config.data.data_dir={tmp_path / 'tfds'}", "--config.checkpoint_every=0",
              "--config.logging.progress=False", "--config.logging.tensorboard=False", "--config.rl.logp_chunk=64"]
    p = subprocess.run(["bash", "scripts/sage_official_qwen_math.sh", str(tmp_path / "w"), *common], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "1 of 4 SFT rows are longer than data.max_sft_tokens=400" in p.stderr, p.stderr[-3000:]
    sft_rows = [json.loads(x) for x in (tmp_path / "w" / "sft" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in sft_rows if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 7))  # 2 epochs x 3 rows, batch 1
    tok = hf.load_tokenizer(TINY_BASE)
    eos = tok.eos_token
    full = {len(tok(sys_prompt + eos + f"What is {a}+{a}?<start_working_out>{a} and {a} make {2 * a}."
                    f"<end_working_out><SOLUTION>{2 * a}</SOLUTION>", add_special_tokens=False)["input_ids"]) + 1
            for a in range(1, 4)}
    assert {r["train/tokens"] for r in train} <= {n - 1 for n in full}  # every token after the first is a target
    rl_rows = [json.loads(x) for x in (tmp_path / "w" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/kl"] > 0 for r in rl_rows if "train/kl" in r] == [True, True]
    for r in [r for r in rl_rows if "train/ratio_mean" in r]:  # the preset's path at lr 0
        assert r["train/ratio_mean"] == 1.0 and r["train/clip_low"] == 0.0 and r["train/clip_high"] == 0.0
        assert abs(r["train/is_weight_mean"] - 1.0) < 0.05  # bf16 sampler vs bf16 trainer: numerics only
    evals = [r for r in rl_rows if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [1, 2], [r.get("step") for r in evals]
    assert "eval/pass@1" in evals[0] and "eval/pass@2" in evals[1], sorted(evals[0])
    res = json.loads((tmp_path / "w" / "rl" / "eval" / "results.json").read_text())
    assert sorted(res["models"]) == ["step_1", "step_2"]
    assert all(len(next(iter(m["benchmarks"].values()))["problems"]) == 4 for m in res["models"].values())
    cfg = json.loads((tmp_path / "w" / "rl" / "run_config.json").read_text())
    assert cfg["rollout"]["stop_strings"] == ["</SOLUTION>"] and cfg["model"]["lora"]["rank"] == 8
    a = st.SafetensorsFile(str(tmp_path / "w" / "sft" / "export_peft" / hf.ADAPTER_FILE))
    b = st.SafetensorsFile(str(tmp_path / "w" / "rl" / "export_peft" / hf.ADAPTER_FILE))
    assert sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) % 14 == 0  # A, B x 7 targets per layer
    assert any(np.abs(a[k]).max() > 0 for k in a.keys() if "lora_B" in k)  # SFT moved the adapter
    for k in a.keys():
        np.testing.assert_array_equal(a[k], b[k])
