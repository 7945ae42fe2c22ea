"""XLA's all-reduce across one process's devices, with and without JAX's distributed runtime.

    for on in 1 0; do bash scripts/mpirun.sh -np 2 \
        -x XLA_FLAGS=--xla_force_host_platform_device_count=2 -x JAX_PLATFORMS=cpu \
        -x JDIST_JAX_DISTRIBUTED=$on .venv/bin/python -m benchmarks local_collectives; done

Once `jax.distributed` is up, the CPU client runs every XLA collective through
its cross-process implementation (gloo), also one whose devices are all in
this process, such as the gradient sum between the local devices of a jit
step (docs/jax_processes.md "Cost"). Prints each rank's time for the sum of a
4 MB float32 buffer over its local devices (median of 20 after 3 warm-ups).
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jdist

BUFFER_FLOATS = 1 << 20  # 4 MB of float32 per device
ROUNDS = 20


def main(args: argparse.Namespace) -> int:
  topo = jdist.init()
  mesh = jdist.mesh()
  rows = np.ones((mesh.devices.size, BUFFER_FLOATS), np.float32)
  buffer = jax.device_put(rows, NamedSharding(mesh, PartitionSpec(jdist.DATA_AXIS)))
  total = jax.jit(lambda a: jnp.sum(a, axis=0))  # XLA's all-reduce over the local devices
  for _ in range(3):
    total(buffer).block_until_ready()
  times = []
  for _ in range(ROUNDS):
    began = time.perf_counter()
    total(buffer).block_until_ready()
    times.append(time.perf_counter() - began)
  print(f"rank {topo.process_index}: JAX processes {jax.process_count()}, "
        f"JDIST_JAX_DISTRIBUTED={os.environ.get('JDIST_JAX_DISTRIBUTED', '(default)')}: "
        f"{mesh.devices.size} local devices, sum of 4 MB "
        f"{statistics.median(times) * 1e3:.2f} ms (median of {ROUNDS})", flush=True)
  return 0
