"""The fused RL step and what it is made of: rollout, advantages, guides, losses, the update phase."""
