"""The trainable policy shared by the RL and SFT jobs: its train state, its optimizer, its per-token log-probs."""
