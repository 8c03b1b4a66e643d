"""Multi-host runs: `jax.distributed` start-up, per-host batches, and what only process 0 does.

One program runs on every host (TPU pod workers, GPU nodes, or local processes in tests). Each host
owns the devices attached to it; a global array's rows split over (data, fsdp) live on the hosts
that own those devices, so each host loads only its rows (`global_batch`) and the reward
callback inside the step runs on each host for its own shards (`rewards.host.host_rewards`).
Checkpoints are written by all hosts together (Orbax); metrics by process 0 (`jax.process_index() == 0`).

Start-up (`maybe_initialize`), in order of precedence:
  1. explicit arguments, or the environment `JAX_COORDINATOR_ADDRESS` (host:port of process 0),
     `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (e.g. several GPU nodes started by hand or a scheduler);
  2. `SAGE_JAX_DISTRIBUTED=auto`: `jax.distributed.initialize()` with JAX's cluster auto-detection
     (Cloud TPU pod slices, SLURM, Open MPI, Kubernetes); `launch_tpu.sh` sets it;
  3. otherwise a single process: nothing to do.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

from sage_jax import sharding as shd

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_AUTO = "SAGE_JAX_DISTRIBUTED"

log = logging.getLogger(__name__)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment {name}={v!r} is not an integer") from None


def maybe_initialize(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_ids=None) -> bool:
    """Calls `jax.distributed.initialize` when the job has more than one process; True if it did.

    Must run before anything touches a JAX backend (no `jax.devices()` first). Idempotent.
    """
    if jax.distributed.is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes is not None and num_processes > 1:
        missing = [n for n, v in ((ENV_COORDINATOR, coordinator_address), (ENV_PROCESS_ID, process_id)) if v is None]
        if missing:
            raise ValueError(f"{ENV_NUM_PROCESSES}={num_processes} needs {' and '.join(missing)} as well")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"{ENV_PROCESS_ID}={process_id} must be in [0, {num_processes})")
        # CPU processes need a cross-process collectives backend (no-op for TPU / GPU clients).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=local_device_ids)
    elif os.environ.get(ENV_AUTO, "").lower() in ("1", "true", "auto"):
        jax.distributed.initialize()  # cluster auto-detection (TPU pod, SLURM, Open MPI, k8s)
    else:
        return False
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def global_batch(local: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Global arrays from each host's own rows, row-sharded over (data, fsdp). A host's rows are its
    process-contiguous share (`sharding.make_mesh` keeps each host's devices together; the data pipeline
    gives process p the p-th share)."""
    return {k: jax.make_array_from_process_local_data(shd.batch_sharding(mesh, np.ndim(v)), np.asarray(v))
            for k, v in local.items()}
