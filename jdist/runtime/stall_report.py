"""What the watchdog reports: where a rank is, and who stalled a wait.

Pure helpers of `jdist.runtime.watchdog`: reading a thread's frames
(tracing/compiling with JAX, the user's own line) and turning the peers'
answers into the message printed before the job is aborted.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Any

# Frames that mean "this thread is tracing or compiling with JAX": the
# compiler entry points (jax/_src/compiler.py), lowering to MLIR and tracing
# to a jaxpr. Dispatching or waiting for a step is none of these.
_COMPILE_FILES = ("compiler.py", "mlir.py", "partial_eval.py")
_COMPILE_FUNCTIONS = ("_trace_for_jit", "lower_sharding_computation", "_cached_lowering_to_hlo",
                      "trace_to_jaxpr", "trace_to_jaxpr_dynamic", "lower_jaxpr_to_module",
                      "_cached_compilation", "compile_or_get_cached")
_LIBRARY_DIRS = tuple({os.path.normpath(p) + os.sep for p in
                       (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                        sysconfig.get_paths()["platlib"])})
_JDIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# jdist's own training loop: where `jdist train` stands is a line of it, not
# of the console script that called it.
_USER_LEVEL = (os.path.join(_JDIST_DIR, "app", "train.py"),
               os.path.join(_JDIST_DIR, "app", "train_loop.py"))


def in_jax_compiler(frame) -> bool:
  """Whether a frame (or one it was called from) is JAX tracing or compiling."""
  while frame is not None:
    code = frame.f_code
    path = code.co_filename
    if f"{os.sep}jax{os.sep}" in path and (
        os.path.basename(path) in _COMPILE_FILES or code.co_name in _COMPILE_FUNCTIONS):
      return True
    frame = frame.f_back
  return False


def user_location(frame) -> str | None:
  """'file:line in function' of the innermost frame in the user's own code."""
  innermost = None
  while frame is not None:
    path = os.path.normpath(frame.f_code.co_filename)
    here = f"{_short_path(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
    innermost = innermost or here
    if path in _USER_LEVEL or not (path.startswith(_LIBRARY_DIRS)
                                   or path.startswith(_JDIST_DIR) or path.startswith("<")):
      return here
    frame = frame.f_back
  return innermost


def _short_path(path: str) -> str:
  try:
    relative = os.path.relpath(path)
  except ValueError:
    return path
  return path if relative.startswith("..") else relative


def is_missing(reply: dict[str, Any] | None) -> bool:
  """A peer that is neither in an exchange nor compiling (or did not answer)."""
  return reply is None or (reply.get("waiting_in") is None and not reply.get("compiling"))


def describe_stall(rank: int, size: int, label: str, waited: float, timeout: float,
                   replies: dict[int, dict[str, Any]], hosts: list[str] | None = None) -> str:
  """The watchdog's report: who is missing, and where everyone is.

  Args:
    rank: the reporting rank.
    size: number of ranks.
    label: the exchange the reporting rank waits in (e.g. "step 5 of train_step").
    waited: seconds it has waited.
    timeout: the deadline in seconds.
    replies: each answering peer's `Watchdog.status()`; peers absent from it
      did not answer.
    hosts: each rank's host name, to say which nodes the silent ranks are on.

  Returns:
    A multi-line message naming the missing ranks first.
  """
  lines = [f"jdist watchdog: rank {rank} waited {waited:.1f} s in {label} for the "
           f"other ranks (limit {timeout:g} s; raise it with jdist.init(timeout=...) "
           f"or the JDIST_TIMEOUT environment variable)."]
  missing, silent, waiting_in = [], [], set()
  for peer in range(size):
    if peer == rank:
      continue
    reply = replies.get(peer)
    if reply is None:
      missing.append(peer)
      silent.append(peer)
      lines.append(f"  rank {peer}: MISSING - did not answer (hung holding the Python "
                   f"interpreter, or exiting)")
      continue
    where = f" at {reply['where']}" if reply.get("where") else ""
    last = reply.get("last_completed") or f"{reply.get('completed', 0)} steps"
    if reply.get("compiling"):
      lines.append(f"  rank {peer}: still tracing/compiling with JAX{where}")
    elif reply.get("waiting_in") is None:
      missing.append(peer)
      lines.append(f"  rank {peer}: MISSING - not in any exchange for "
                   f"{reply.get('idle_s', 0.0):.1f} s{where}; last finished: {last}")
    else:
      waiting_in.add(reply["waiting_in"])
      lines.append(f"  rank {peer}: waiting in {reply['waiting_in']} for "
                   f"{reply.get('waiting_s', 0.0):.1f} s{where}")
  if silent:
    lines.append(describe_silent(silent, hosts))
  if missing:
    names = ", ".join(str(m) for m in missing)
    lines.append(f"Rank(s) {names} did not reach {label}. Aborting the job so no rank "
                 f"hangs forever.")
  elif waiting_in == {label}:
    lines.append(f"Every rank is waiting in {label}: the exchange itself is stuck (a "
                 f"deadlock inside the step, or a step slower than the limit). Aborting "
                 f"the job.")
  elif waiting_in:
    lines.append("Every rank is waiting, in different exchanges: the ranks' control "
                 "flow diverged (they call collectives in a different order). Aborting "
                 "the job.")
  else:
    lines.append("The other ranks are still compiling after the grace period. Aborting "
                 "the job.")
  return "\n".join(lines)


def describe_silent(silent: list[int], hosts: list[str] | None) -> str:
  """'ranks 2, 3 on host nodeB stopped answering ...': the silent ranks, by host.

  A rank whose watchdog does not answer at all is gone (its node is down or
  cut off) or wedged holding the Python interpreter; naming the host tells an
  operator which machine to look at.
  """
  by_host: dict[str, list[int]] = {}
  for peer in silent:
    by_host.setdefault(hosts[peer] if hosts else "", []).append(peer)
  parts = []
  for host, ranks in by_host.items():
    noun = "rank" if len(ranks) == 1 else "ranks"
    where = f" on host {host}" if host else ""
    parts.append(f"{noun} {', '.join(map(str, ranks))}{where}")
  every = hosts is not None and all(
      ranks == [r for r, h in enumerate(hosts) if h == host] for host, ranks in by_host.items())
  cause = ("every rank of that node is silent: the node is down or unreachable"
           if every else "down, unreachable, or hung holding the Python interpreter")
  return f"{'; '.join(parts)} stopped answering ({cause})."


def describe_departure(rank: int, label: str, number: int, host: bool,
                       gone: dict[int, dict[str, int]]) -> str:
  """The report when ranks left the job before the exchange this rank waits in.

  Args:
    rank: the reporting rank.
    label: the exchange it waits in.
    number: its count of steps (or host exchanges, with `host`) up to it.
    host: whether the wait is a host-side exchange.
    gone: departed ranks that never reached it, with their counts at exit
      ("steps", "host").
  """
  kind = "host exchanges" if host else "steps"
  left = "; ".join(f"rank {peer} exited after {counts['host' if host else 'steps']} {kind}"
                   for peer, counts in sorted(gone.items()))
  return (f"jdist watchdog: rank {rank} waits in {label} (its {kind[:-1]} {number}), but "
          f"{left}, so it can never arrive. The ranks ran different numbers of {kind}: "
          f"one left its loop early (sys.exit, return or break on one rank only). "
          f"Aborting the job so no rank hangs until the deadline.")


def describe_diverged_calls(rank: int, calls: dict[int, dict[str, Any]]) -> str:
  """The report when the ranks met in different host exchanges.

  Every host exchange starts with one gather of each rank's call
  (`jdist.runtime.world`), so different exchanges meet there instead of
  pairing their payloads wrongly.

  Args:
    rank: the reporting rank.
    calls: each rank's {"label": its exchange, "where": its line, "host":
      its host exchange count, "steps": its steps dispatched}.
  """
  groups: dict[tuple, list[int]] = {}
  for peer in sorted(calls):
    call = calls[peer]
    groups.setdefault((call["label"], call.get("where")), []).append(peer)
  parts = []
  for (label, where), ranks in groups.items():
    noun = "rank" if len(ranks) == 1 else "ranks"
    verb = "is" if len(ranks) == 1 else "are"
    at = f" at {where}" if where else ""
    parts.append(f"{noun} {', '.join(map(str, ranks))} {verb} in {label}{at}")
  numbers = sorted({call.get("host", 0) for call in calls.values()})
  which = (f"host exchange {numbers[0]}" if len(numbers) == 1 else
           "host exchanges " + ", ".join(map(str, numbers)))
  return "\n".join([
      f"jdist watchdog: rank {rank}: the ranks called different host collectives ({which}), "
      f"which can never complete together: {'; '.join(parts)}.",
      "The ranks' control flow diverged: a collective ran on some ranks only (for example "
      "inside `if topo.is_primary:`) or in another order. Every rank must call jdist's "
      "collectives (barrier, broadcast_params, host_allreduce, every CheckpointManager "
      "method...) in the same order. Aborting the job."])


def find_divergence(status: dict[int, dict[str, Any]], grace: float):
  """Two ranks whose waits exclude each other, or None.

  Rank X waits in its compiled step N; rank Y waits in a host exchange and
  has dispatched fewer than N steps. Every rank runs the same steps and host
  exchanges in the same order, so Y will not dispatch step N before X joins
  its host exchange, and X cannot (its step waits for Y's): they diverged.

  Args:
    status: each rank's `Watchdog.status()` (the reporting rank's included).
    grace: seconds both waits must have lasted (shorter ones may be transient).

  Returns:
    (x, x's status, y, y's status), or None.
  """
  for x, x_status in sorted(status.items()):
    if (x_status.get("waiting_in") is None or x_status.get("host_wait")
        or x_status.get("waiting_s", 0.0) < grace):
      continue
    for y, y_status in sorted(status.items()):
      if (y != x and y_status.get("host_wait") and y_status.get("waiting_s", 0.0) >= grace
          and y_status.get("dispatched", 0) < x_status.get("wait_number", 0)):
        return x, x_status, y, y_status
  return None


def describe_divergence(rank: int, x: int, x_status: dict[str, Any], y: int,
                        y_status: dict[str, Any]) -> str:
  """The report of `find_divergence`'s finding, as rank `rank` prints it."""
  retrace = y_status["waiting_in"].startswith("structure check")
  where = f" at {y_status['where']}" if y_status.get("where") else ""
  lines = [f"jdist watchdog: rank {rank}: rank {x} waits in {x_status['waiting_in']} (its "
           f"compiled step {x_status['wait_number']}), but rank {y} dispatched only "
           f"{y_status.get('dispatched', 0)} steps and waits in {y_status['waiting_in']}"
           f"{where}, so neither can go on."]
  if retrace:
    note = y_status.get("trace_note")
    lines.append(f"Rank {y} is re-tracing a step the other ranks run compiled"
                 + (f": {note}." if note else ".")
                 + " An input of another shape or dtype on one rank (a short last batch, a "
                   "cast) makes only that rank trace again. Give every rank batches of the "
                   "same shapes and dtypes (e.g. drop the last partial batch: "
                   "jdist.ShardedLoader's drop_last=True).")
  else:
    lines.append(f"The ranks ran different numbers of steps (uneven inputs: rank {x} runs a "
                 f"step that rank {y} never runs). Give every rank the same number of "
                 f"batches per epoch (jdist.ShardedLoader does, from data of the same size).")
  lines.append("Aborting the job so no rank hangs until the deadline.")
  return "\n".join(lines)
