"""The XLA:CPU settings jdist.init() makes: added where the user made none."""

import os

import jax
import pytest

from jdist import errors
from jdist.runtime import xla_cpu
from tests import launch

FLAG_OFF = f"{xla_cpu.FUSION_EMITTERS_FLAG}=false"


@pytest.fixture
def fresh_process(monkeypatch):
  """As if JAX had not created its backends yet."""
  monkeypatch.setattr(xla_cpu.jax_internals, "backends_initialized", lambda: False)
  monkeypatch.setattr(jax, "__version__", "0.10.2")


def test_fusion_emitters_flag_is_added_beside_the_users_flags(fresh_process, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  assert xla_cpu.avoid_slow_concatenation()
  assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", FLAG_OFF]
  monkeypatch.delenv("XLA_FLAGS")
  assert xla_cpu.avoid_slow_concatenation()
  assert os.environ["XLA_FLAGS"] == FLAG_OFF


@pytest.mark.parametrize("users", [f"{xla_cpu.FUSION_EMITTERS_FLAG}=true", FLAG_OFF])
def test_a_users_own_fusion_emitters_flag_is_kept(fresh_process, monkeypatch, users):
  monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=2 {users}")
  assert not xla_cpu.avoid_slow_concatenation()
  assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {users}"


def test_no_flag_after_backends_exist_or_on_an_unmeasured_release(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  jax.devices()  # the backends exist now: XLA would not read the flag
  assert not xla_cpu.avoid_slow_concatenation()
  monkeypatch.setattr(xla_cpu.jax_internals, "backends_initialized", lambda: False)
  monkeypatch.setattr(jax, "__version__", "0.12.0")  # XLA may no longer know the flag
  assert not xla_cpu.avoid_slow_concatenation()
  assert os.environ["XLA_FLAGS"] == ""


def test_host_threads_keep_a_users_nproc(monkeypatch):
  monkeypatch.setenv("NPROC", "3")
  xla_cpu.reserve_host_threads()
  assert os.environ["NPROC"] == "3"


def test_host_threads_after_backends_exist_refuse_several_devices_on_a_small_pool(monkeypatch):
  monkeypatch.delenv("NPROC", raising=False)
  jax.devices()  # the backends exist now: XLA would not read NPROC
  monkeypatch.setattr(xla_cpu.os, "cpu_count", lambda: 2)
  if jax.local_device_count() > 1:
    with pytest.raises(errors.InitOrderError, match="before any other JAX call") as info:
      xla_cpu.reserve_host_threads()
    assert f"NPROC={xla_cpu.MIN_HOST_THREADS}" in str(info.value)
  else:
    xla_cpu.reserve_host_threads()  # one device blocks at most one pool thread
  monkeypatch.setattr(xla_cpu.os, "cpu_count", lambda: xla_cpu.MIN_HOST_THREADS)
  xla_cpu.reserve_host_threads()  # a pool this large is enough
  assert "NPROC" not in os.environ  # too late to matter: not set


def test_late_init_advice_names_every_variable_the_fix_needs():
  """NPROC alone would only lead to JAX's distributed runtime refusing to start."""
  on = xla_cpu.late_init_advice(jax_distributed=True)
  assert "call jdist.init() before any other JAX call" in on and "only fix" in on
  assert f"mpirun -x NPROC={xla_cpu.MIN_HOST_THREADS} -x JDIST_JAX_DISTRIBUTED=0" in on
  off = xla_cpu.late_init_advice(jax_distributed=False)
  assert f"mpirun -x NPROC={xla_cpu.MIN_HOST_THREADS} ...)" in off
  assert "JDIST_JAX_DISTRIBUTED" not in off
  jax_backend = xla_cpu.late_init_advice(jax_distributed=True, backend="jax")
  assert "only fix with backend='jax'" in jax_backend and "NPROC" not in jax_backend


def test_init_sets_the_flag_and_this_xla_accepts_it_in_a_subprocess():
  # XLA stops a process at an XLA_FLAGS entry it does not know: a computation
  # after jdist.init() proves the installed XLA takes the flag.
  script = ("import os, jax, jax.numpy as jnp, jdist; jdist.init(); "
            "print('FLAGS', os.environ['XLA_FLAGS']); "
            "print('SUM', float(jnp.concatenate([jnp.ones((3, 4)).ravel(), jnp.ones(2)]).sum()))")
  done = launch.python(["-c", script], devices=2, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  assert FLAG_OFF in done.stdout and "SUM 14.0" in done.stdout, done.stdout
