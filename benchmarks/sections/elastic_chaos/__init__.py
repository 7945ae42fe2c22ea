"""The elastic chaos section: one `jdist train` through many faults on the rig (`run`)."""

from benchmarks.harness.section import Run, section
from benchmarks.sections.elastic_chaos import run

SECTION = section("elastic_chaos", "one jdist train under jdist launch through many faults",
                  rig=Run.of(run))
