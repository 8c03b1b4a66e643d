"""SFT from scratch of the embedded tiny base model on the procedural arithmetic task (CPU).

This is how `sage_jax/assets/tiny_base` was made (experiments/tiny_base/README.md has the full recipe):

    python -m sage_jax.models.tiny --out=/tmp/tiny_init
    python -m sage_jax.main --config=configs/tiny_sft.py --workdir=/tmp/tiny_sft \
        --config.model.path=/tmp/tiny_init

Expected: train/loss falls from ~4.6 (uniform over 100 characters) to well under 0.5; the export in
/tmp/tiny_sft/export_hf reaches pass@1 between 0.1 and 0.6 on the procedural test split, with pass@8
clearly higher.
"""

from sage_jax.config_lib import default_config


def get_config(arg=None):
    c = default_config()
    c.mode = "sft"
    c.seed = 0
    c.max_steps = 400  # optimizer steps, chosen for the pass@1 band (see experiments/tiny_base/README.md)
    c.checkpoint_every = 100
    c.log_every = 50
    c.model.path = "/tmp/tiny_init"
    c.data.batch_size = 64  # sequences per step
    c.data.max_sft_tokens = 96  # prompt + worked solution + EOS, characters
    c.optim.learning_rate = 3e-3
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 50
    c.optim.weight_decay = 0.01
    c.eval.num_problems = 128
    c.eval.n = 16
    c.eval.max_new_tokens = 48
    c.eval.at_start = False
    return c
