"""The decoder (Qwen2 / Qwen2.5 / Qwen3 / Llama 3), LoRA, and Hugging Face import / export."""
