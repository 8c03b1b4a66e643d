"""Tiny random Hugging Face checkpoints made on the fly (transformers + torch, fixed seed, offline)."""

from __future__ import annotations

import os

FAMILIES = {
    # name: (config class, kwargs) - small, but with every feature the family has switched on.
    "qwen2_untied_gqa4": ("Qwen2Config", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2_tied_gqa2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
}


def make_hf_model(out_dir: str, family: str, seed: int = 0, vocab_size: int = 97, hidden_size: int = 64,
                  num_layers: int = 2, **overrides) -> str:
    import torch
    import transformers

    cls_name, kw = FAMILIES[family]
    kw = dict(kw)
    kw.update(overrides)
    cfg = getattr(transformers, cls_name)(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size + 8,
                                          num_hidden_layers=num_layers, max_position_embeddings=512,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random biases / norm scales, so a dropped bias or norm cannot pass unnoticed
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def hf_logits(path: str, tokens, mask=None):
    """Reference logits from transformers (fp32, eager attention) with positions from the mask."""
    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = torch.tensor(np.asarray(tokens), dtype=torch.long)
    if mask is None:
        mask = np.ones_like(np.asarray(tokens))
    m = torch.tensor(np.asarray(mask), dtype=torch.long)
    pos = (m.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=m, position_ids=pos).logits.float().numpy()
