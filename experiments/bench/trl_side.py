"""TRL side of the RL-step benchmark: GRPOTrainer (beta > 0, no vLLM, fp32 or bf16, CPU or CUDA) timed per step.

Run by the TRL virtual environment's python (bench.py creates it and calls this script):

    experiments/bench/.venv-trl/bin/python experiments/bench/trl_side.py --model DIR --prompts FILE \
        --completion-len 64 --group 8 --steps 8 --warmup 2 --out trl_tiny.json

Prints / writes JSON: the wall time between consecutive optimizer-step ends (one step = rollout +
reward + reference forward + policy forward/backward + AdamW update), the median after `--warmup`
steps, and the completion lengths TRL saw (all must equal `--completion-len`).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root: studies import each other as experiments.<study>
from experiments.bench.reward import count_ones  # noqa: E402  (the same reward function as the JAX side)


class StepTimer(TrainerCallback):
    """Step i's time = its end stamp minus the previous one (train begin for the first)."""

    def __init__(self, partial_out, cuda):
        self.cuda = cuda
        self.stamps = []
        self.lengths = []
        self.partial_out = partial_out

    def on_train_begin(self, args, state, control, **kw):
        self.stamps.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        if self.cuda:  # the step's kernels are queued asynchronously: stamp when they have run
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        # Written after every step, so a caller that times out still gets the steps done so far.
        steps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        json.dump(dict(step_s=steps, partial=True), open(self.partial_out, "w"))

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "completions/mean_length" in logs:
            self.lengths.append((logs["completions/min_length"], logs["completions/max_length"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    ap.add_argument("--completion-len", type=int, required=True)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="fp32", choices=("fp32", "bf16", "defaults"),
                    help="fp32: bf16=False, no gradient checkpointing (like ours); bf16: bf16 autocast, no "
                         "gradient checkpointing; defaults: TRL's own (bf16 autocast, gradient checkpointing)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    a = ap.parse_args()
    bf16, checkpointing = a.variant != "fp32", a.variant == "defaults"
    cuda = a.device == "cuda"
    if a.threads:
        torch.set_num_threads(a.threads)

    torch.manual_seed(0)
    prompts = json.load(open(a.prompts))
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rows = len(prompts) * a.group
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp, use_cpu=not cuda, bf16=bf16, fp16=False, gradient_checkpointing=checkpointing,
            learning_rate=a.lr, beta=a.beta, num_generations=a.group, per_device_train_batch_size=rows,
            gradient_accumulation_steps=1, num_iterations=1, max_completion_length=a.completion_len,
            # Full-length completions: the EOS logit is masked until max_completion_length tokens exist.
            generation_kwargs={"min_new_tokens": a.completion_len}, temperature=1.0, top_p=1.0, top_k=0,
            loss_type="grpo", scale_rewards="group", use_vllm=False, max_steps=a.steps, logging_steps=1,
            save_strategy="no", report_to="none", weight_decay=0.0, max_grad_norm=1.0,
            lr_scheduler_type="constant", warmup_steps=0, seed=0, dataloader_num_workers=0,
            disable_tqdm=True, log_completions=False,
        )
        timer = StepTimer(a.out, cuda)
        ds = Dataset.from_dict({"prompt": prompts})
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: count_ones(completions, None).tolist(),
                              args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer])
        trainer.train()
    steps = [b - a_ for a_, b in zip(timer.stamps, timer.stamps[1:])]
    timed = steps[a.warmup:]
    res = dict(trl_version=trl.__version__, transformers_version=transformers.__version__,
               torch_version=torch.__version__, torch_threads=torch.get_num_threads(), step_s=steps,
               median_step_s=statistics.median(timed), completion_lengths=timer.lengths,
               rows=rows, completion_len=a.completion_len, variant=a.variant, device=a.device,
               cuda_peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
    json.dump(res, open(a.out, "w"), indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
