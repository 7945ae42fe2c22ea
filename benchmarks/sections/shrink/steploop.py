"""One rank of the ULFM cost loop: `jdist train --shrink`'s exchange, timed step by step.

`cost.py` starts it as `python -c LOOP_CODE STEPS WARMUP`: fixed host compute, then one
`ShrinkableComm.sum` of the digits CNN's gradient size and `confirm()` every
`CONFIRM_EVERY` steps; rank 0 prints the mean step and exchange times as JSON.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

GRADIENT_ELEMENTS = 131_080 + 3  # the digits CNN's parameters, then loss, correct, examples


def main(steps: int = 200, warmup: int = 20, compute: int = 192) -> int:
  """Runs `steps` timed steps after `warmup` (collective); rank 0 prints the JSON line."""
  from jdist.app import train_shrink  # pylint: disable=import-outside-toplevel
  from jdist.collectives import shrinkable  # pylint: disable=import-outside-toplevel
  comm = shrinkable.ShrinkableComm()
  rng = np.random.default_rng(comm.rank)
  matrix = rng.standard_normal((compute, compute)) if compute else None
  gradient = rng.standard_normal(GRADIENT_ELEMENTS)
  times, exchanges = [], []
  for step in range(warmup + steps):
    began = time.perf_counter()
    if matrix is not None:
      for _ in range(4):
        np.tanh(matrix @ matrix)  # the same work every step (the result is dropped)
    exchanged = time.perf_counter()
    comm.sum(gradient)
    if (step + 1) % train_shrink.CONFIRM_EVERY == 0:
      comm.confirm()  # as jdist train --shrink: the window's sums count once agreed
    ended = time.perf_counter()
    if step >= warmup:
      times.append(ended - began)
      exchanges.append(ended - exchanged)
  if comm.rank == 0:
    print(json.dumps({"processes": comm.size, "hosts": sorted(set(comm.hosts)),
                      "steps": steps, "step_s": statistics.fmean(times),
                      "exchange_s": statistics.fmean(exchanges)}), flush=True)
  return 0
