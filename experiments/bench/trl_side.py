"""TRL side of the RL-step benchmark: GRPOTrainer (beta > 0, no vLLM, fp32 or bf16, CPU or CUDA) timed per step.

Run by the TRL virtual environment's python (bench.py creates it and calls this script):

    experiments/bench/.venv-trl/bin/python experiments/bench/trl_side.py --model DIR --prompts FILE \
        --completion-len 64 --group 8 --steps 8 --warmup 2 --out trl_tiny.json

Prints / writes JSON: the wall time between consecutive optimizer-step ends (one step = rollout +
reward + reference forward + policy forward/backward + AdamW update; with `--steps-per-generation S`, a step
is one generation and its S updates, the `old` pass included), the median after `--warmup` steps, and the
completion lengths TRL saw (all `--completion-len`, or the `--lengths` schedule's).
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

    def __init__(self, partial_out, cuda, steps_per_generation=1):
        self.cuda, self.S = cuda, steps_per_generation
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
        updates = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        steps = [sum(updates[i:i + self.S]) for i in range(0, len(updates) - self.S + 1, self.S)]
        json.dump(dict(step_s=steps, partial=True), open(self.partial_out, "w"))

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "completions/mean_length" in logs:
            self.lengths.append((logs["completions/min_length"], logs["completions/max_length"],
                                 logs["completions/mean_length"]))


def force_lengths(model, lengths, eos_id):
    """The varlen workload's schedule (experiments/bench/varlen.py): row b of each `generate` call ends with EOS
    as its lengths[b]-th token, and cannot end before; a row at the cap (lengths[b] = max_completion_length) ends
    there, as in our sampler. A logits processor added to the model's own generate; nothing else changes."""
    from transformers import LogitsProcessor, LogitsProcessorList

    target = torch.tensor(lengths)

    class Forced(LogitsProcessor):
        def __init__(self, prompt_len):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            pos = input_ids.shape[1] - self.prompt_len  # the index of the completion token chosen now
            L = target.to(scores.device)
            scores[pos < L - 1, eos_id] = -float("inf")
            force = pos == L - 1
            scores[force] = -float("inf")
            scores[force, eos_id] = 0.0
            return scores

    generate = model.generate

    def generate_forced(*args, **kw):
        assert kw["input_ids"].shape[0] == len(lengths), (kw["input_ids"].shape, len(lengths))
        return generate(*args, logits_processor=LogitsProcessorList([Forced(kw["input_ids"].shape[1])]), **kw)

    model.generate = generate_forced


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
    ap.add_argument("--lengths", default=None, help="JSON list of each row's completion length (the varlen "
                                                    "workload); default: every completion at --completion-len")
    ap.add_argument("--steps-per-generation", type=int, default=1,
                    help="optimizer steps per generation batch; a step's time is then one generation's steps")
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
    lengths = json.load(open(a.lengths)) if a.lengths else None
    if lengths:  # unshuffled, so row b of the generation batch is prompt b // group, as on our side
        force_lengths(model, lengths, tok.eos_token_id)
        forcing = dict(shuffle_dataset=False)
    else:  # full-length completions: the EOS logit is masked until max_completion_length tokens exist
        forcing = dict(generation_kwargs={"min_new_tokens": a.completion_len})
    S = a.steps_per_generation
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp, use_cpu=not cuda, bf16=bf16, fp16=False, gradient_checkpointing=checkpointing,
            learning_rate=a.lr, beta=a.beta, num_generations=a.group, per_device_train_batch_size=rows // S,
            steps_per_generation=S, gradient_accumulation_steps=1, num_iterations=1,
            max_completion_length=a.completion_len, temperature=1.0, top_p=1.0, top_k=0, **forcing,
            loss_type="grpo", scale_rewards="group", use_vllm=False, max_steps=a.steps * S, logging_steps=1,
            save_strategy="no", report_to="none", weight_decay=0.0, max_grad_norm=1.0,
            lr_scheduler_type="constant", warmup_steps=0, seed=0, dataloader_num_workers=0,
            disable_tqdm=True, log_completions=False,
        )
        timer = StepTimer(a.out, cuda, S)
        ds = Dataset.from_dict({"prompt": prompts})
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: count_ones(completions, None).tolist(),
                              args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer])
        trainer.train()
    updates = [b - a_ for a_, b in zip(timer.stamps, timer.stamps[1:])]
    steps = [sum(updates[i:i + S]) for i in range(0, len(updates), S)]  # a generation and its S updates
    timed = steps[a.warmup:]
    res = dict(trl_version=trl.__version__, transformers_version=transformers.__version__,
               torch_version=torch.__version__, torch_threads=torch.get_num_threads(), step_s=steps,
               update_s=updates, steps_per_generation=S, forced_lengths=lengths,
               median_step_s=statistics.median(timed), completion_lengths=timer.lengths,
               rows=rows, completion_len=a.completion_len, variant=a.variant, device=a.device,
               cuda_peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
    json.dump(res, open(a.out, "w"), indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
