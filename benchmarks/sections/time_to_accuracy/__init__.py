"""The time-to-accuracy section (`run`; `train` the worker measurement, `report`)."""

from benchmarks.harness.section import Run, section
from benchmarks.sections.time_to_accuracy import report
from benchmarks.sections.time_to_accuracy import run

SECTION = section(
    "time_to_accuracy", "seconds to a test accuracy, jdist's modes against PyTorch DDP over "
    "shaped links",
    shaped=Run.of(run, report=report.markdown, out="docs/benchmarks/time_to_accuracy",
                  quick=True))
