"""What the benchmark sections share: jobs and their worker processes, timing,
shaped links and the rig, workloads, the PyTorch peer, reports. It never
imports a section (tests/test_registry.py checks)."""
