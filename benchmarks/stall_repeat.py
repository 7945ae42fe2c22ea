"""Repeats the watchdog's stall scenario and counts correct aborts.

Each repetition launches `tests/jobs/stall.py` under mpirun: rank 1 sleeps
60 s before step 5 of a small data-parallel training loop started with
`jdist.init(timeout=T)`. A repetition is correct when the job exits non-zero
within T + 15 s of the stall starting and the watchdog's report names rank 1
and the step. Prints one line per repetition and a summary:

  python -m benchmarks stall_repeat --repeat 10 --devices 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from tests.jobs import faults  # noqa: E402  (needs the repository on sys.path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--repeat", type=int, default=10)
  parser.add_argument("--devices", type=int, default=1, help="local devices per process")
  parser.add_argument("--timeout", type=float, default=10.0, help="jdist.init(timeout=...)")


def main(args: argparse.Namespace) -> int:

  correct, times = 0, []
  for index in range(1, args.repeat + 1):
    try:
      result = faults.run(["stall:5"], devices=args.devices, timeout=args.timeout)
    except faults.TimeoutExpired as err:
      print(f"run {index}: HUNG (mpirun killed after {err.timeout:g} s)", flush=True)
      continue
    why = faults.check_stall_abort(result, args.timeout)
    try:
      to_abort = result.since("sleeping")
      times.append(to_abort)
      shown = f"{to_abort:.1f} s"
    except AssertionError:
      shown = "n/a (the stall never started)"
    print(f"run {index}: {'aborted correctly' if why is None else 'WRONG: ' + why}; "
          f"exit {result.returncode}; stall start to job end {shown}", flush=True)
    if why is not None:
      sys.stderr.write(result.stderr[-3000:] + "\n")
    correct += why is None
  summary = (f"{correct}/{args.repeat} aborted correctly (2 processes x {args.devices} "
             f"devices, timeout {args.timeout:g} s)")
  if times:
    summary += (f"; stall start to job end: min {min(times):.1f} s, median "
                f"{statistics.median(times):.1f} s, max {max(times):.1f} s")
  print(summary)
  return 0 if correct == args.repeat else 1
