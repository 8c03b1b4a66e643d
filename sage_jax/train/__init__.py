"""Jobs: the training loop (rl, sft), `mode=eval`, checkpoints and the metrics writer."""
