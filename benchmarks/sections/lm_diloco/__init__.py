"""The language-model section (`run`; `train` the worker measurement, `workload`, `report`)."""

from benchmarks.harness.section import Run, section
from benchmarks.sections.lm_diloco import report
from benchmarks.sections.lm_diloco import run

SECTION = section(
    "lm_diloco", "a small transformer language model: validation loss at equal tokens and "
    "time to a loss, DiLoCo against plain over shaped links",
    shaped=Run.of(run, report=report.markdown, out="docs/benchmarks/lm_diloco", quick=True))
