"""Host (CPU) devices on demand: `--cpu-devices N` for testing without accelerators.

XLA reads `--xla_force_host_platform_device_count` from `XLA_FLAGS` when JAX
creates its backends, so the count must be set before the first JAX
computation; `force_cpu_devices` sets it, or refuses once it is too late.
"""

from __future__ import annotations

import os

import jax

from jdist.runtime import jax_internals
from jdist.app.config import ConfigError

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def force_cpu_devices(count: int) -> None:
  """Makes JAX create `count` CPU devices in this process (CPU testing only).

  Sets `XLA_FLAGS=--xla_force_host_platform_device_count=count` and JAX's
  platform to "cpu". XLA reads the flag when JAX creates its backends, so
  this must run before the first JAX computation.

  Args:
    count: host devices per process (>= 1).

  Raises:
    ConfigError: JAX's backends already exist with another device count.
  """
  if jax_internals.backends_initialized():
    if jax.default_backend() != "cpu" or jax.local_device_count() != count:
      raise ConfigError(
          f"cpu_devices (--cpu-devices)={count}: JAX is already running with "
          f"{jax.local_device_count()} {jax.default_backend()} devices, so the device "
          f"count can no longer change. Set it before any JAX computation, or set "
          f"XLA_FLAGS={CPU_DEVICES_FLAG}={count} JAX_PLATFORMS=cpu in the environment.")
    return
  flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
           if not flag.startswith(CPU_DEVICES_FLAG)]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"{CPU_DEVICES_FLAG}={count}"])
  jax.config.update("jax_platforms", "cpu")
