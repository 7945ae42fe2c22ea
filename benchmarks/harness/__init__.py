"""What the benchmark sections share; it never imports a section (docs/benchmarks/index.md)."""
