"""The shrink section (`run`; `faults` and `cost` its parts)."""

from benchmarks.harness.section import Run, section
from benchmarks.sections.shrink import run

SECTION = section("shrink", "jdist launch --shrink through faults on the rig; ULFM's cost",
                  rig=Run.of(run, report=run.markdown, out="docs/benchmarks/cluster",
                             quick=True))
