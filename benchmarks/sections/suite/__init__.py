"""The suite: all-reduce, overhead, compression, scaling,
backends and the network section, written to results.md (`run`); one module
per measured part, each a worker measurement (`NAME`, `run(ctx)`)."""

from benchmarks.harness import report
from benchmarks.harness.section import Run, section
from benchmarks.sections.suite import run

SECTION = section("suite", "the suite: all-reduce, overhead, compression, "
                  "scaling, backends, network (results.md and figures)",
                  host=Run.of(run, report=report.markdown, out="docs/benchmarks", quick=True))
