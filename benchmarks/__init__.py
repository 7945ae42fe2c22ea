"""jdist's benchmarks: `python -m benchmarks SECTION` (`list`: the sections); docs/benchmarks."""
