"""The suite section: all-reduce, overhead, compression, scaling, backends, network (`run`)."""

from benchmarks.harness import report
from benchmarks.harness.section import Run, section
from benchmarks.sections.suite import run

SECTION = section("suite", "the suite: all-reduce, overhead, compression, "
                  "scaling, backends, network (results.md and figures)",
                  host=Run.of(run, report=report.markdown, out="docs/benchmarks", quick=True))
