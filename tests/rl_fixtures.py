"""A tiny RL setup shared by the RL-step tests: random tiny Qwen2, char tokenizer, toy reward."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import char_tokenizer, tiny_config
from sage_jax.rewards.host import HostReward, encode_answers
from sage_jax.policy import optim, state as train_state
from sage_jax.rl import losses, step as R
from sage_jax.sampling import SamplingConfig, left_pad

TOK = char_tokenizer()
PROMPTS = ["1+2=", "3*4=", "5-1=", "2+2="]
ANSWERS = ["3", "12", "4", "4"]


def count_ones(completions, answers):
    # Dense toy reward so groups have variance even for a random model.
    return np.array([c.count("1") / 4.0 for c in completions], np.float32)


def batch():
    p, m = left_pad([TOK(x, add_special_tokens=False)["input_ids"] for x in PROMPTS], 0)
    return dict(prompt=jnp.asarray(p), prompt_mask=jnp.asarray(m), answer=jnp.asarray(encode_answers(TOK, ANSWERS, 8)))


def setup(reward_fn=count_ones, seed=0, lr=1e-3, tx=None, decoder_remat="none", num_layers=1, **rl):
    """(cfg, graphdef, state, jitted step); `tx`: an optax optimizer in place of AdamW at `lr`;
    `decoder_remat`: the Decoder's own remat (in the graphdef, so every pass of the step sees it). One layer by
    default: the step's phases, not depth, are under test, and a second layer costs ~50% more compile time."""
    rl.setdefault("group_size", 4)
    rl.setdefault("sampling", SamplingConfig(max_new_tokens=16, eos_ids=(2,), pad_id=0,
                                                  decode_segments=2))  # segmented, at less compile time
    rl.setdefault("loss", losses.LossConfig(beta=0.04))
    cfg = R.RLConfig(**rl)
    model = Decoder(tiny_config(hidden_size=64, num_layers=num_layers), rngs=nnx.Rngs(seed), remat=decoder_remat)
    if tx is None:
        tx, lr_fn = optim.make_optimizer(optim.OptimConfig(learning_rate=lr))
    else:
        lr_fn = lambda step: jnp.float32(lr)
    graphdef, state = train_state.init_train_state(model, cfg, tx, seed)
    step = R.make_rl_step(graphdef, cfg, tx, lr_fn, HostReward(TOK, reward_fn))
    return cfg, graphdef, state, step
