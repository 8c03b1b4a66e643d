"""KV-cache sampler: parity with transformers generate, log-prob consistency, filters, EOS handling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import make_hf_model

from sage_jax import sampling
from sage_jax.models import hf
from sage_jax.policy import logprobs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_model(str(tmp_path_factory.mktemp("hf") / "m"), "qwen2_untied_gqa4", seed=3)


@pytest.fixture(scope="module")
def model(ckpt):
    return hf.load(ckpt)[0]


def _prompts():
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 97, size=(4, 7)).astype(np.int32)
    mask = np.ones_like(toks)
    mask[1, :3] = 0
    mask[2, :1] = 0
    toks[mask == 0] = 0
    return toks, mask


def _run(model, cfg, key=0):
    g, s = nnx.split(model)
    toks, mask = _prompts()
    return sampling.make_generate_fn(g, cfg)(s, toks, mask, jax.random.key(key)), toks, mask


@pytest.mark.parametrize("family", ["qwen2_untied_gqa4", "llama3"])
def test_greedy_matches_transformers_generate(tmp_path, family):
    import torch
    import transformers

    d = make_hf_model(str(tmp_path / family), family, seed=5)
    model, _ = hf.load(d)
    out, toks, mask = _run(model, sampling.SamplingConfig(max_new_tokens=16, temperature=0.0))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).generate(
        torch.tensor(toks, dtype=torch.long), attention_mask=torch.tensor(mask), max_new_tokens=16,
        do_sample=False, pad_token_id=0, eos_token_id=None)
    np.testing.assert_array_equal(np.asarray(out.tokens_BxT), ref[:, toks.shape[1]:].numpy())


# 12 tokens -> 11 cache slots: one loop, four segments, a segment per slot, more segments than slots
@pytest.mark.parametrize("temperature, segments", [(1.0, 1), (0.7, 4), (1.0, 11), (1.0, 40)])
def test_sampler_logp_equals_full_forward(model, temperature, segments):
    cfg = sampling.SamplingConfig(max_new_tokens=12, temperature=temperature, eos_ids=(5, 7), pad_id=0,
                                  decode_segments=segments)
    out, toks, mask = _run(model, cfg, key=1)
    full = jnp.concatenate([jnp.asarray(toks), out.tokens_BxT], 1)
    full_mask = jnp.concatenate([jnp.asarray(mask), out.mask_BxT], 1)
    lp, ent = logprobs.sequence_logp_entropy(model, full, full_mask, toks.shape[1], chunk=5,
                                             temperature=temperature)
    m = np.asarray(out.mask_BxT).astype(bool)
    assert np.abs(np.asarray(lp) - np.asarray(out.logp_BxT))[m].max() <= 1e-4
    assert np.abs(np.asarray(ent) - np.asarray(out.entropy_BxT))[m].max() <= 1e-4
    assert np.all(np.asarray(out.logp_BxT)[~m] == 0)


def test_top_k_one_is_greedy(model):
    greedy, _, _ = _run(model, sampling.SamplingConfig(max_new_tokens=10, temperature=0.0))
    topk1, _, _ = _run(model, sampling.SamplingConfig(max_new_tokens=10, temperature=1.3, top_k=1), key=7)
    np.testing.assert_array_equal(np.asarray(greedy.tokens_BxT), np.asarray(topk1.tokens_BxT))
    assert np.allclose(np.asarray(topk1.logp_BxT), 0.0, atol=1e-6)  # a one-token distribution


def test_eos_masks_everything_after_first_eos(model):
    free, _, _ = _run(model, sampling.SamplingConfig(max_new_tokens=12, temperature=0.0))
    free = np.asarray(free.tokens_BxT)
    eos = int(free[0, 3])  # row 0 emits this token at step 3 (perhaps earlier too)
    out, _, _ = _run(model, sampling.SamplingConfig(max_new_tokens=12, temperature=0.0, eos_ids=(eos,), pad_id=0))
    toks, mask = np.asarray(out.tokens_BxT), np.asarray(out.mask_BxT)
    for r in range(free.shape[0]):
        hits = np.flatnonzero(free[r] == eos)
        stop = hits[0] if len(hits) else free.shape[1] - 1
        np.testing.assert_array_equal(mask[r], (np.arange(12) <= stop).astype(np.int32))
        np.testing.assert_array_equal(toks[r, :stop + 1], free[r, :stop + 1])
        assert np.all(toks[r, stop + 1:] == 0)


@pytest.mark.parametrize("segments", [1, 4])  # 4: every row stops in the first segment; none of the others run
def test_stops_early_when_all_rows_done(model, segments):
    free, _, _ = _run(model, sampling.SamplingConfig(max_new_tokens=12, temperature=0.0))
    first = tuple(int(t) for t in np.asarray(free.tokens_BxT)[:, 1])  # every row's second token
    out, _, _ = _run(model, sampling.SamplingConfig(max_new_tokens=12, temperature=0.0, eos_ids=first,
                                                    decode_segments=segments))
    assert int(out.num_steps) <= 2
    assert np.asarray(out.mask_BxT)[:, 2:].sum() == 0


def test_segmented_decode_samples_what_one_loop_samples(model):
    """The segments change which slots a step reads, not what it computes: same tokens, same log-probs."""
    outs = [_run(model, sampling.SamplingConfig(max_new_tokens=14, temperature=1.0, eos_ids=(5,),
                                                decode_segments=n), key=4)[0] for n in (1, 3, 13)]
    for o in outs[1:]:
        np.testing.assert_array_equal(np.asarray(o.tokens_BxT), np.asarray(outs[0].tokens_BxT))
        np.testing.assert_array_equal(np.asarray(o.mask_BxT), np.asarray(outs[0].mask_BxT))
        assert int(o.num_steps) == int(outs[0].num_steps)
        np.testing.assert_allclose(np.asarray(o.logp_BxT), np.asarray(outs[0].logp_BxT), atol=1e-5)
        np.testing.assert_allclose(np.asarray(o.entropy_BxT), np.asarray(outs[0].entropy_BxT), atol=1e-5)


@pytest.mark.parametrize("slots, segments", [(0, 4), (1, 4), (11, 4), (12, 4), (11, 1), (5, 9), (127, 8)])
def test_segment_lengths_split_the_slots_evenly(slots, segments):
    lengths = sampling.segment_lengths(slots, segments)
    assert sum(lengths) == slots
    assert len(lengths) == min(slots, segments)
    assert all(n >= 1 for n in lengths) and (not lengths or max(lengths) - min(lengths) <= 1)


def _np_filter(logits, temperature, top_k, top_p, min_p):
    x = logits.astype(np.float64) / temperature
    out = np.full_like(x, -np.inf)
    for i, row in enumerate(x):
        keep = np.ones(row.shape, bool)
        if top_k:
            keep &= row >= np.sort(row)[::-1][top_k - 1]
        r = np.where(keep, row, -np.inf)
        if top_p < 1:
            p = np.exp(r - r.max()); p /= p.sum()
            order = np.argsort(-r, kind="stable")
            cum = 0.0
            k2 = np.zeros_like(keep)
            for j in order:
                if cum < top_p:
                    k2[j] = True
                cum += p[j]
            keep &= k2
            r = np.where(keep, row, -np.inf)
        if min_p:
            p = np.exp(r - r.max()); p /= p.sum()
            keep &= p >= min_p * p.max()
        out[i] = np.where(keep, row, -np.inf)
    return out


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.1), (8, 0.8, 0.05)])
def test_filters_match_numpy(top_k, top_p, min_p):
    logits = np.random.default_rng(2).normal(size=(6, 50)).astype(np.float32) * 2
    cfg = sampling.SamplingConfig(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    ours = np.asarray(sampling.filter_logits(jnp.asarray(logits), cfg))
    ref = _np_filter(logits, 0.8, top_k, top_p, min_p)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    np.testing.assert_allclose(ours[~np.isinf(ours)], ref[~np.isinf(ref)], rtol=1e-6)


def test_samples_only_from_kept_tokens():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(512, 40)).astype(np.float32))
    cfg = sampling.SamplingConfig(temperature=1.0, top_k=3)
    tok = sampling.sample_token(logits, jax.random.key(0), cfg)[0]
    top3 = np.argsort(-np.asarray(logits), axis=1)[:, :3]
    assert all(t in row for t, row in zip(np.asarray(tok), top3))


def test_chunked_logp_matches_direct_and_gradient():
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.normal(size=(2, 13, 8)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(8, 31)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 31, size=(2, 13)))

    def direct(w):
        lsm = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w), -1)
        return jnp.take_along_axis(lsm, y[..., None], -1)[..., 0], -jnp.sum(jnp.exp(lsm) * lsm, -1)

    lp, ent = logprobs.token_logp_entropy(h, w, y, chunk=4)
    lp0, ent0 = direct(w)
    np.testing.assert_allclose(lp, lp0, atol=1e-5)
    np.testing.assert_allclose(ent, ent0, atol=1e-5)
    g = jax.grad(lambda w: logprobs.token_logp_entropy(h, w, y, chunk=4)[0].sum())(w)
    g0 = jax.grad(lambda w: direct(w)[0].sum())(w)
    np.testing.assert_allclose(g, g0, atol=1e-5)


def test_bad_sampling_config():
    with pytest.raises(ValueError, match="top_p"):
        sampling.SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling.SamplingConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="decode_segments"):
        sampling.SamplingConfig(decode_segments=0)
