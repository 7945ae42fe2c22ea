"""The network section: on shaped links (`shaped`) or on the rig (`rig`)."""

from benchmarks.harness.section import Run, section
from benchmarks.sections.network import report
from benchmarks.sections.network import rig
from benchmarks.sections.network import shaped

SECTION = section(
    "network", "jdist's modes against PyTorch DDP, whole training steps and all-reduce, over "
    "shaped links (network.md) or on the rig (cluster/results.md)",
    shaped=Run.of(shaped, report=report.markdown, out="docs/benchmarks", quick=True),
    rig=Run.of(rig, report=report.rig_markdown, out="docs/benchmarks/cluster", quick=True))
