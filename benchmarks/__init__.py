"""jdist's benchmarks: `python -m benchmarks SECTION` (`list`: the sections); see docs/benchmarks.

Layers: `harness` (what sections share; it never imports a section), `sections` (one
module or package per section, each declaring its `SECTION`), `registry` (finds them)
and `__main__` (the one parser).
"""
