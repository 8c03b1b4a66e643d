"""The fused RL step and what it is made of: rollout, advantages, guides, losses, log-probs, train state, optimizer."""
