"""The benchmark sections: each module or package here defines `SECTION`
(`benchmarks.harness.section.Section`); `benchmarks.registry` finds them."""
