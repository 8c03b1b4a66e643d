"""Data: TFDS builders for the math datasets and the procedural task (`builders`, `sources`, `procedural`,
`strategies`, `files`), prompt templates (`templates`) and the grain pipeline (`pipeline`). Import the module
you need, e.g. `from sage_jax.data import builders; builders.load_split("procedural_arithmetic", "train")`."""
