"""jdist's benchmark suite.

    python -m benchmarks            # the full suite (~10 min on 2 cores)
    python -m benchmarks --quick    # the smoke run CI uses (tiny sizes)
    python -m benchmarks.network    # jdist vs PyTorch DDP on shaped links (root; ~16 min)
    python -m benchmarks.accuracy   # accuracy vs compression (~27 min)
    mpirun -np 2 python -m benchmarks.allocator   # page faults of fresh XLA buffers
    python benchmarks/stall_repeat.py             # the watchdog, 10 repetitions

Modules: `timing` (warm-up, interleaving, medians), `workload` (models,
data, train steps), one module per measured section (`allreduce`,
`overhead`, `compression`, `selection`, `scaling`, `accuracy`,
`network_steps`), `worker`
(a job's process), `jobs` (launching jobs and merging ranks), `analysis`
(ratios and targets), `report` and `plots` (results.md and the figures).
The network section: `netns` (shaped network namespaces), `torch_peer`
(the PyTorch DDP peer), `network` (its driver) and `network_report`.
"""
