import os
import sys

# Tests run on CPU, offline, with a single host device unless a test file sets XLA_FLAGS itself
# (the sharding tests run in subprocesses for that reason).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, os.path.dirname(__file__))
