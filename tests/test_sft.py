"""The SFT batch layout and loss against a NumPy cross-entropy over the model's own logits."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import tiny_config
from sage_jax.train.sft import encode_sft, sft_lengths, sft_loss


class CharTok:
    """ids = code points mod 50, plus 2 (0 = pad, 1 = EOS)."""

    def __call__(self, texts, add_special_tokens=False):
        one = lambda t: [2 + ord(ch) % 50 for ch in t]
        return {"input_ids": [one(t) for t in texts] if isinstance(texts, list) else one(texts)}


PROMPTS, COMPLETIONS = ["ab", "wxyz"], ["cde", "q"]


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_layout_marks_the_targets(loss_on):
    b = encode_sft(CharTok(), PROMPTS, COMPLETIONS, eos_id=1, length=8, pad_id=0, loss_on=loss_on)
    # row 0: a b c d e EOS pad pad; row 1: w x y z q EOS pad pad
    np.testing.assert_array_equal(b["mask"], [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
    want = b["mask"] if loss_on == "all" else np.array([[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(b["loss_mask"], want)
    assert b["tokens"][0, 5] == 1 and b["tokens"][1, 5] == 1
    np.testing.assert_array_equal(sft_lengths(CharTok(), PROMPTS, COMPLETIONS), [6, 6])
    with pytest.raises(ValueError, match="exceed data.max_sft_tokens=5"):
        encode_sft(CharTok(), PROMPTS, COMPLETIONS, eos_id=1, length=5)


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_loss_is_the_mean_cross_entropy_of_the_targets(loss_on):
    model = Decoder(tiny_config(hidden_size=32, num_layers=1), rngs=nnx.Rngs(0))  # vocab > 52
    b = encode_sft(CharTok(), PROMPTS, COMPLETIONS, eos_id=1, length=8, loss_on=loss_on)
    graphdef, params = nnx.split(model)
    loss, m = sft_loss(params, graphdef, {k: jnp.asarray(v) for k, v in b.items()}, chunk=4)
    logits = np.asarray(model(jnp.asarray(b["tokens"])), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp[:, :-1], b["tokens"][:, 1:, None], -1)[..., 0]
    w = b["loss_mask"][:, 1:]
    np.testing.assert_allclose(float(loss), (nll * w).sum() / w.sum(), rtol=1e-5)
    assert float(m["train/tokens"]) == w.sum() == (10 if loss_on == "all" else 6)
