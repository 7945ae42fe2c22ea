"""The data axis and the ledger of bytes that cross processes.

Every route (`jdist.collectives.routes`) records the bytes this process
sends across processes in the active `measure()` ledger, by the
bandwidth-optimal algorithm's count: an all-reduce of b bytes sends
2(P-1)/P*b per process, an all-gather of b bytes per process sends (P-1)*b.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from jdist.runtime import flight_recorder

DATA_AXIS = "data"


@dataclasses.dataclass
class WireLedger:
  """Bytes and MPI calls this process sends across processes per step."""
  bytes: int = 0
  calls: int = 0


_ledger: contextvars.ContextVar[WireLedger | None] = contextvars.ContextVar(
    "jdist_wire_ledger", default=None)


@contextlib.contextmanager
def measure(scheme: str | None = None):
  """Collects the cross-process traffic of the collectives traced inside.

  Args:
    scheme: the communication scheme tracing them ("DiLoCo"), which names
      their exchanges in the flight recorder and the timeline.
  """
  ledger = WireLedger()
  token = _ledger.set(ledger)
  try:
    with flight_recorder.scheme(scheme):
      yield ledger
  finally:
    _ledger.reset(token)


def record(nbytes: float, calls: int) -> None:
  """Adds one exchange's bytes and MPI calls to the active ledger, if any."""
  ledger = _ledger.get()
  if ledger is not None:
    ledger.bytes += int(round(nbytes))
    ledger.calls += calls
