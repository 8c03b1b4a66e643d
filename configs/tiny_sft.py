"""SFT from scratch of the embedded tiny base model on the procedures corpus (CPU, ~20 min on 2 cores).

This is how `sage_jax/assets/tiny_base` was made (experiments/tiny_base/README.md has the full recipe):

    python -m sage_jax.models.tiny --out=/tmp/tiny_init
    python -m sage_jax.main --config=configs/tiny_sft.py --workdir=/tmp/tiny_sft \
        --config.model.path=/tmp/tiny_init

Expected (experiments/tiny_base/sft_metrics.jsonl): train/loss from ~1.1 at step 50 to ~0.03 at step 1500;
held-out pass@1 0.490 and pass@16 0.859 at step 1500 (3-5 operands), the four procedures sampled in the
corpus' proportions (rule 0.20, terms 0.05, left 0.50, right 0.25).
"""

from sage_jax.defaults import default_config


def get_config(arg=None):
    c = default_config()
    c.mode = "sft"
    c.seed = 0
    c.max_steps = 1500  # optimizer steps (see experiments/tiny_base/README.md)
    c.checkpoint_every = 250
    c.log_every = 50
    c.eval_every = 250
    c.model.path = "/tmp/tiny_init"
    c.data.builder_config = "strategies_sft"  # 3-5 operands, procedures mixed (sage_jax.data.builders)
    c.data.batch_size = 64  # sequences per step
    c.data.max_sft_tokens = 128  # prompt + worked solution + EOS, characters
    c.optim.learning_rate = 3e-3
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 50
    c.optim.weight_decay = 0.01
    c.eval.num_problems = 128
    c.eval.n = 16
    c.eval.max_new_tokens = 96
    c.eval.at_start = False
    return c
