"""TRL's side of the learning-parity study: GRPOTrainer on the embedded testbed, set up as configs/tiny.py:grpo.

Run by the pinned TRL venv (run.py builds it and calls this script):

    experiments/bench/.venv-trl/bin/python experiments/learning_parity/trl_grpo.py --model DIR \
        --prompts PROMPTS.json --seed 0 --out OUT_DIR

`PROMPTS.json` holds this project's own training prompts, in the order its data pipeline gives them for the
seed (`[{"prompt": text, "answer": str}, ...]`, 8 per step), so both sides see the same problems in the
same order. Everything the demo config sets is set the same way here (see README.md's table); the optimizer
is built by hand because the HF Trainer's own AdamW skips weight decay on biases and norms and its
warmup starts at lr 0, where optax's `adamw` decays every parameter and this project's warmup starts at
lr / (W + 1). Writes OUT_DIR/model (HF format, `save_model`) and OUT_DIR/log.json (TRL's logged rows).
"""

import argparse
import json
import os
import sys

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from sage_jax.rewards.verifiers import exact_match_reward  # noqa: E402  (numpy only: the same reward as the JAX side)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    rows = json.load(open(a.prompts))
    assert len(rows) >= a.steps * a.prompts_per_step, "fewer prompts than steps x prompts per step"
    tok = AutoTokenizer.from_pretrained(a.model)
    # The export's ids through the auto class must be tokenizer.json's (sage_jax.models.tiny writes it so).
    generic = PreTrainedTokenizerFast.from_pretrained(a.model)
    for r in rows[:64]:
        assert tok(r["prompt"], add_special_tokens=False)["input_ids"] == \
            generic(r["prompt"], add_special_tokens=False)["input_ids"], (type(tok).__name__, r["prompt"])
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)

    def reward(completions, answer, **kw):
        return exact_match_reward(completions, answer).tolist()

    cfg = GRPOConfig(
        output_dir=os.path.join(a.out, "trainer"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        learning_rate=a.lr, beta=a.beta, num_generations=a.group,
        per_device_train_batch_size=a.prompts_per_step * a.group, gradient_accumulation_steps=1, num_iterations=1,
        steps_per_generation=1, shuffle_dataset=False, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="grpo", scale_rewards="group", epsilon=0.2,
        importance_sampling_level="token", mask_truncated_completions=False, use_vllm=False, max_steps=a.steps,
        logging_steps=1, save_strategy="no", report_to="none", max_grad_norm=1.0, seed=a.seed,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)
    W = a.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / (W + 1) if s < W else 1.0)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]}
                            for r in rows[: a.steps * a.prompts_per_step]])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          optimizers=(opt, sched))
    trainer.train()
    trainer.save_model(os.path.join(a.out, "model"))
    tok.save_pretrained(os.path.join(a.out, "model"))
    log = [r for r in trainer.state.log_history if "reward" in r]
    json.dump({"trl_version": trl.__version__, "torch_version": torch.__version__, "rows": log},
              open(os.path.join(a.out, "log.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
