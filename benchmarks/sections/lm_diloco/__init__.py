"""The language-model section: a small transformer's validation loss at equal tokens
and time to a loss, DiLoCo against plain over shaped links (`run`); `train` is
the worker measurement, `workload` the model and corpus, `report` the report."""

from benchmarks.harness.section import Run, section
from benchmarks.sections.lm_diloco import report
from benchmarks.sections.lm_diloco import run

SECTION = section(
    "lm_diloco", "a small transformer language model: validation loss at equal tokens and "
    "time to a loss, DiLoCo against plain over shaped links",
    shaped=Run.of(run, report=report.markdown, out="docs/benchmarks/lm_diloco", quick=True))
