"""configs/sage_official.py against the official SAGE recipe, field by field.

The fixture below is read from github.com/tally0818/SAGE at commit c9b3b69a8f3d0200a19e67e61aaf57c2b9fe3ee0
(configs/train_config.yaml; src/train/common.py build_grpo_config, apply_lora_if_needed, system_prompt;
src/train/rewards.py) and, where the official code sets nothing, TRL 0.23's GRPOConfig / TrainingArguments
defaults. Each value is compared with what the preset resolves to through this project's own config
builders (config_lib.rl_config / optim_config / lora_config), not with the preset's literals.
"""

import importlib.util
import os

import pytest

from sage_jax import config_lib

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
    "guide": "branch", "branch_ratio": 0.3, "branch_threshold": 1.2, "q_min": 0.6, "q_max": 1.4,
    "branch_source": "new",
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


def _resolved(c) -> dict:
    """The preset as this project runs it, in the official names."""
    from sage_jax.rewards import REWARD_FNS, math_verify_text_reward
    from sage_jax.sampling import SamplingConfig
    stop = object()  # stands for the compiled stop strings (they need the 7B tokenizer)
    rl = config_lib.rl_config(c, eos_ids=(1,), pad_id=0, stop=stop)
    assert isinstance(rl.sampling, SamplingConfig) and rl.sampling.stop is stop
    opt = config_lib.optim_config(c)
    lora = config_lib.lora_config(c)
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
             "down": "down_proj"}
    per_generation = rl.num_iterations * rl.num_minibatches
    rows = c.data.batch_size * rl.group_size
    return {
        "model": c.model.path, "gradient_checkpointing": c.model.remat == "full",
        "lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "lora_targets": tuple(names[t] for t in lora.targets),
        "train_dataset": {"dapo_math_17k_en": "open-r1/DAPO-Math-17k-Processed:en"}.get(c.data.name, c.data.name),
        "temperature": rl.sampling.temperature, "min_p": rl.sampling.min_p, "top_p": rl.sampling.top_p,
        "top_k": rl.sampling.top_k, "generation_batch_size": rows,
        "per_device_train_batch_size": rows // rl.num_minibatches,
        "gradient_accumulation_steps": 1,  # rl.grad_accum_steps only splits memory; the update is one step
        "num_generations": rl.group_size, "num_iterations": rl.num_iterations,
        "max_prompt_length": c.data.max_prompt_tokens, "max_completion_length": rl.sampling.max_new_tokens,
        "stop": list(c.rollout.stop_strings), "include_stop_str_in_output": True,  # sage_jax.stop_strings keeps it
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
        "guide": rl.guide, "branch_ratio": getattr(rl.guide_cfg, "ratio", None),
        "branch_threshold": getattr(rl.guide_cfg, "threshold", None),
        "q_min": rl.guide_cfg.q_min, "q_max": rl.guide_cfg.q_max, "branch_source": rl.guide_cfg.source,
        "system_prompt": c.data.system_prompt,
        "reward": ("verify(parse(gold), parse(completion)), 0 on exception"
                   if REWARD_FNS[c.rl.reward] is math_verify_text_reward else c.rl.reward),
        "_lora_param_dtype": str(config_lib.lora_param_dtype(c)),
    }


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


def test_the_preset_code_path_end_to_end(tmp_path):
    """The preset's exact code path on the shipped tiny model, a few steps at lr 0: LoRA on a bf16 base,
    min_p, 2 updates per generation batch, the stop string, the official reward, TIS, remat and in-training
    evaluation on locally prepared benchmark files. At lr 0 every update's ratio is exactly 1."""
    import json
    import subprocess
    import sys

    from sage_jax.config_lib import TINY_BASE
    _write_data(tmp_path / "manual")
    wd = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)
    flags = [f"--config.model.path={TINY_BASE}", f"--config.data.manual_dir={tmp_path / 'manual'}",
             f"--config.data.data_dir={tmp_path / 'tfds'}", "--config.max_steps=2", "--config.eval_every=1",
             "--config.optim.learning_rate=0.0", "--config.data.max_prompt_tokens=320",
             "--config.rollout.max_new_tokens=24", "--config.eval.max_new_tokens=24", "--config.eval.n=2",
             "--config.eval.batch_size=8", "--config.eval.benchmarks=math500:test", "--config.rl.logp_chunk=64",
             "--config.checkpoint_every=0", "--config.logging.progress=False", "--config.logging.tensorboard=False"]
    p = subprocess.run([sys.executable, "-m", "sage_jax.main", "--config=configs/sage_official.py",
                        f"--workdir={wd}", *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(ln) for ln in (wd / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    train = [r for r in rows if "train/ratio_mean" in r]
    assert len(train) == 2
    for r in train:
        assert r["train/ratio_mean"] == 1.0 and r["train/clip_low"] == 0.0 and r["train/clip_high"] == 0.0
        assert abs(r["train/tis_weight_mean"] - 1.0) < 0.05  # bf16 sampler vs bf16 trainer: numerics only
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [1, 2], [r.get("step") for r in evals]
    assert "eval/pass@1" in evals[0] and "eval/pass@2" in evals[1], sorted(evals[0])
    res = json.loads((wd / "eval" / "results.json").read_text())
    assert sorted(res["models"]) == ["step_1", "step_2"]
    assert all(len(next(iter(m["benchmarks"].values()))["problems"]) == 4 for m in res["models"].values())
    cfg = json.loads((wd / "run_config.json").read_text())
    assert cfg["rollout"]["stop_strings"] == ["</SOLUTION>"] and cfg["model"]["lora"]["rank"] == 8
