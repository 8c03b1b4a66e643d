"""LoRA: zero-B adapters are the identity, only adapters train, the reference is the base, exports load
in transformers (merged) and peft (adapter only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.models import hf, lora
from sage_jax.models.decoder import Decoder
from sage_jax.models.tiny import tiny_config
from sage_jax.policy import optim, state as train_state
from sage_jax.rl import losses, step as R
from sage_jax.policy.logprobs import sequence_logp_entropy
from tests import hf_fixtures, rl_fixtures as F

LCFG = lora.LoRAConfig(rank=4, alpha=8.0)


def _tiny(seed=0):
    return Decoder(tiny_config(hidden_size=64, num_layers=2), rngs=nnx.Rngs(seed))


def _tokens(vocab, shape=(2, 9)):
    return jax.random.randint(jax.random.key(3), shape, 1, vocab)


def _randomise_b(model, seed=5, std=0.05):
    """Non-zero B (as after training) so the adapters change the output."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    for _, _, _, ad in lora.iter_adapters(model):
        ad.b[...] = std * jax.random.normal(next(keys), ad.b.shape, ad.b.dtype)


def state_bytes(state) -> dict[str, int]:
    """Test helper: bytes of the trainable params, the frozen params and the optimizer state."""
    nbytes = lambda t: sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(t) if hasattr(x, "dtype"))
    return dict(params=nbytes(state.params), frozen=nbytes(state.frozen_params), ref=nbytes(state.ref_params),
                opt_state=nbytes(state.opt_state))


_fwd = nnx.jit(lambda m, t: m(t))


def test_zero_b_is_the_base_model():
    model = _tiny()
    tokens = _tokens(model.cfg.vocab_size)
    base = np.asarray(_fwd(model, tokens))
    lora.add_lora(model, LCFG)
    assert len(list(lora.iter_adapters(model))) == 2 * 7
    np.testing.assert_array_equal(np.asarray(_fwd(model, tokens)), base)
    _randomise_b(model)
    assert np.abs(np.asarray(_fwd(model, tokens)) - base).max() > 1e-3  # the adapters are in the forward


def test_targets_subset_and_config_checks():
    model = lora.add_lora(_tiny(), lora.LoRAConfig(rank=2, targets=("q", "v")))
    assert {t for _, t, _, _ in lora.iter_adapters(model)} == {"q", "v"}
    with pytest.raises(ValueError, match="targets"):
        lora.LoRAConfig(targets=("qq",))


def test_one_step_trains_only_adapters_and_reference_is_base():
    # with remat and gradient accumulation on as well: the base's Variables come from outside the update
    # scan, which an NNX transform (remat) inside it must not try to update
    cfg = R.RLConfig(group_size=4, sampling=F.SamplingConfig(max_new_tokens=8, eos_ids=(2,), pad_id=0),
                     loss=losses.LossConfig(beta=0.04), remat="full", grad_accum_steps=2)
    tx, lr_fn = optim.make_optimizer(optim.OptimConfig(learning_rate=1e-2))
    base_model = _tiny()
    _, base_params = nnx.split(base_model)
    base_np = jax.tree.map(np.asarray, base_params)
    # full fine-tuning state for the byte comparison
    full = state_bytes(train_state.init_train_state(_tiny(), cfg, tx, 0)[1])

    model = lora.add_lora(_tiny(), lora.LoRAConfig(rank=4, alpha=8.0, dropout=0.1))  # dropout in training
    graphdef, state = train_state.init_train_state(model, cfg, tx, 0)
    sizes = state_bytes(state)
    print(f"\nbytes full FT: {full}\nbytes LoRA r={LCFG.rank}: {sizes}")
    assert state.ref_params is None  # no second copy of the weights
    assert sizes["params"] < full["params"] / 4 and sizes["opt_state"] < full["opt_state"] / 4
    assert full["ref"] == full["params"]  # full FT keeps a reference copy; LoRA does not
    assert all(isinstance(v, lora.LoRAParam) for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    a0 = jax.tree.map(np.asarray, state.params)

    step = R.make_rl_step(graphdef, cfg, tx, lr_fn, F.HostReward(F.TOK, F.count_ones))
    state, m = step(state, F.batch())
    assert np.isfinite(float(m["train/loss"]))
    # the base weights did not move (bit for bit); the adapters did
    for a, b in zip(jax.tree.leaves(base_np), jax.tree.leaves(state.frozen_params)):
        np.testing.assert_array_equal(np.asarray(b), a)
    moved = [float(np.abs(np.asarray(b) - a).max()) for a, b in zip(jax.tree.leaves(a0), jax.tree.leaves(state.params))]
    assert min(moved) > 0

    # reference = base arrays with adapters zeroed: its log-probs equal the base model's exactly
    tokens = _tokens(base_model.cfg.vocab_size, (3, 10))
    mask = jnp.ones_like(tokens)
    ref = train_state.merge_policy(graphdef, jax.tree.map(jnp.zeros_like, state.params), state.frozen_params)
    slp = nnx.jit(lambda m: sequence_logp_entropy(m, tokens, mask, 4))
    lp_ref, ent_ref = slp(ref)
    lp_base, ent_base = slp(base_model)
    np.testing.assert_array_equal(np.asarray(lp_ref), np.asarray(lp_base))
    lp_pol, _ = slp(train_state.policy_model(graphdef, state))
    assert np.abs(np.asarray(lp_pol) - np.asarray(lp_base)).max() > 0  # the policy did change


@pytest.fixture(scope="module")
def adapted_hf(tmp_path_factory):
    base_dir = hf_fixtures.make_hf_model(str(tmp_path_factory.mktemp("base")), "qwen2_untied_gqa4")
    model, mcfg = hf.load(base_dir)
    lora.add_lora(model, lora.LoRAConfig(rank=4, alpha=8.0))
    _randomise_b(model)
    tokens = np.asarray(_tokens(mcfg.vocab_size, (2, 11)))
    return base_dir, model, mcfg, tokens, np.asarray(_fwd(model, jnp.asarray(tokens)))


def test_merged_export_loads_in_transformers(adapted_hf, tmp_path):
    base_dir, model, mcfg, tokens, ours = adapted_hf
    out = hf.save(model, mcfg, str(tmp_path / "merged"))
    theirs = hf_fixtures.hf_logits(out, tokens)
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert np.abs(hf_fixtures.hf_logits(base_dir, tokens) - ours).max() > 1e-3  # the merge is not a no-op


def test_adapter_only_export_loads_with_peft(adapted_hf, tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    base_dir, model, _, tokens, ours = adapted_hf
    out = hf.save_peft_adapter(model, str(tmp_path / "adapter"), base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                             attn_implementation="eager")
    pm = peft.PeftModel.from_pretrained(base, out)
    pm.eval()
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def test_peft_adapter_round_trip_restores_every_adapter_exactly(adapted_hf, tmp_path):
    base_dir, model, _, tokens, ours = adapted_hf
    out = hf.save_peft_adapter(model, str(tmp_path / "adapter"), base_dir)
    fresh, _ = hf.load(base_dir)
    lora.add_lora(fresh, lora.LoRAConfig(rank=4, alpha=8.0), seed=9)  # other A, B = 0
    hf.load_peft_adapter(fresh, out)
    for (_, _, _, a), (_, _, _, b) in zip(lora.iter_adapters(model), lora.iter_adapters(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(b.a[...]), np.asarray(a.a[...]))
        np.testing.assert_array_equal(np.asarray(b.b[...]), np.asarray(a.b[...]))
    np.testing.assert_array_equal(np.asarray(_fwd(fresh, jnp.asarray(tokens))), ours)


def test_adapter_written_by_peft_loads_with_its_logits(adapted_hf, tmp_path):
    """The other direction: PEFT's own save_pretrained (random, non-zero B) read into our adapters gives
    PEFT's logits (fp32 logits: 1e-4)."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    base_dir, _, _, tokens, _ = adapted_hf
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                             attn_implementation="eager")
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    pm = peft.get_peft_model(base, pcfg)
    pm.eval()
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    pm.save_pretrained(str(tmp_path / "peft"))
    model, _ = hf.load(base_dir)
    lora.add_lora(model, lora.LoRAConfig(rank=4, alpha=8.0))
    hf.load_peft_adapter(model, str(tmp_path / "peft"))
    np.testing.assert_allclose(np.asarray(_fwd(model, jnp.asarray(tokens))), theirs, atol=1e-4, rtol=0)


def test_peft_adapter_of_another_rank_or_without_lora_is_one_error(adapted_hf, tmp_path):
    from sage_jax.models.config import ConfigError

    base_dir, model, _, _, _ = adapted_hf
    out = hf.save_peft_adapter(model, str(tmp_path / "adapter"), base_dir)
    other, _ = hf.load(base_dir)
    lora.add_lora(other, lora.LoRAConfig(rank=2, alpha=8.0))
    with pytest.raises(ConfigError, match="adapter_config.json: r=4 but model.lora gives 2"):
        hf.load_peft_adapter(other, out)
    plain, _ = hf.load(base_dir)
    with pytest.raises(ConfigError, match="has no LoRA adapters"):
        hf.load_peft_adapter(plain, out)
    with pytest.raises(hf.CheckpointError, match="adapter_config.json: missing"):
        hf.load_peft_adapter(model, str(tmp_path))


def test_lora_from_config():
    from sage_jax import config_lib, defaults

    c = defaults.default_config()
    assert config_lib.lora_config(c) is None
    c.model.lora.rank, c.model.lora.alpha, c.model.lora.targets = 8, 32.0, "q, v,down"
    lc = config_lib.lora_config(c)
    assert (lc.rank, lc.scale, lc.targets) == (8, 4.0, ("q", "v", "down"))
    c.model.lora.targets = "q,nope"
    with pytest.raises(config_lib.ConfigValidationError, match="model.lora"):
        config_lib.lora_config(c)


def test_sharded_init_keeps_base_and_places_adapters(adapted_hf):
    _, model, _, _, _ = adapted_hf
    mesh = jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding.mesh  # hf.load's 1-device mesh
    cfg = R.RLConfig(group_size=2, loss=losses.LossConfig(beta=0.04))
    tx, _ = optim.make_optimizer(optim.OptimConfig())
    graphdef, state = train_state.init_train_state_sharded(model, cfg, tx, 0, mesh)
    assert state.ref_params is None and state.frozen_params is not None
    assert all(isinstance(x.sharding, jax.sharding.NamedSharding) for x in jax.tree.leaves(state))
    n_adapters = sum(x.size for x in jax.tree.leaves(state.params))
    n_base = sum(x.size for x in jax.tree.leaves(state.frozen_params))
    assert 0 < n_adapters < n_base / 4


@pytest.mark.parametrize("remat", ["full"])  # "none" runs inside the RL-step test above
def test_dropout_only_with_a_training_key(remat):
    model = lora.add_lora(_tiny(), lora.LoRAConfig(rank=4, dropout=0.5))
    _randomise_b(model)
    model.remat = remat
    graphdef, params = nnx.split(model)
    tokens = _tokens(model.cfg.vocab_size)

    def run(p, key):
        m = nnx.merge(graphdef, p)
        if key is not None:
            lora.set_dropout_key(m, key)
        return m(tokens)

    f = jax.jit(run)
    no_key = np.asarray(f(params, None))
    ref = lora.add_lora(_tiny(), lora.LoRAConfig(rank=4, dropout=0.0))
    nnx.update(ref, params)
    np.testing.assert_array_equal(no_key, np.asarray(_fwd(ref, tokens)))  # no key: dropout off
    k1, k2 = jax.random.key(1), jax.random.key(2)
    d1 = np.asarray(f(params, k1))
    assert np.abs(d1 - no_key).max() > 1e-4  # on with a key
    np.testing.assert_array_equal(np.asarray(f(params, k1)), d1)  # deterministic in the key
    assert np.abs(np.asarray(f(params, k2)) - d1).max() > 1e-4
    g = jax.jit(jax.grad(lambda p: run(p, k1).sum()))(params)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("q", "v")])
def test_state_bytes_match_the_estimates_of_the_memory_plan(targets):
    """The analytic counts `gpu_estimates` (and so experiments/memory_plan.py's LoRA table) uses
    equal the bytes a real train state holds: full FT = params + reference + Adam m, v; LoRA = adapters +
    Adam m, v, with the base frozen and no reference copy."""
    import gpu_estimates as ge

    cfg = R.RLConfig(group_size=4, sampling=F.SamplingConfig(max_new_tokens=8, eos_ids=(2,), pad_id=0),
                     loss=losses.LossConfig(beta=0.04))
    tx, _ = optim.make_optimizer(optim.OptimConfig(learning_rate=1e-3))
    model = _tiny()
    shape = ge.Shape.of(model.cfg)
    n = ge.param_count(shape)
    full = state_bytes(train_state.init_train_state(model, cfg, tx, 0)[1])
    counts = 2 * 4  # Adam's and the schedule's int32 step counters
    assert full == dict(params=4 * n, frozen=0, ref=4 * n, opt_state=2 * 4 * n + counts)
    lcfg = lora.LoRAConfig(rank=4, alpha=8.0, targets=targets)
    sizes = state_bytes(train_state.init_train_state(lora.add_lora(_tiny(), lcfg), cfg, tx, 0)[1])
    n_lora = ge.lora_param_count(shape, 4, targets)
    assert sizes == dict(params=4 * n_lora, frozen=4 * n, ref=0, opt_state=2 * 4 * n_lora + counts)
    print(f"\nLoRA r=4 {targets}: trainable + optimizer bytes {sizes['params'] + sizes['opt_state']} vs full FT "
          f"{full['params'] + full['ref'] + full['opt_state']} "
          f"({(sizes['params'] + sizes['opt_state']) / (full['params'] + full['ref'] + full['opt_state']):.3%})")
