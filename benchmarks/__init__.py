"""jdist's benchmarks: one entry point, `python -m benchmarks SECTION`.

    python -m benchmarks list           # the sections and where each runs
    python -m benchmarks                # the suite (~10 min on 2 cores); `suite` for short
    python -m benchmarks --quick        # the smoke run CI uses (tiny sizes)
    python -m benchmarks network        # jdist vs PyTorch DDP on shaped links (root; ~16 min)
    python -m benchmarks network --on rig   # the same on the cluster rig (root)
    python -m benchmarks accuracy       # accuracy vs compression (~27 min)
    mpirun -np 2 python -m benchmarks styles      # a jit step against data_parallel

Modules: `registry` (every section, where it runs, its report renderer),
`__main__` (the one parser), `outputs` (writes every report), `suite` (the
suite's driver), `timing` (warm-up, interleaving, medians), `workload`
(models, data, train steps), one module per measured part (`allreduce`,
`overhead`, `compression`, `selection`, `scaling`, `accuracy`,
`network_steps`), `worker` (a job's process), `jobs` (launching jobs and
merging ranks), `analysis` (ratios and targets), `report` and `plots`
(results.md and the figures). The network section: `netns` (shaped network
namespaces), `cluster` (the rig), `torch_peer` (the PyTorch DDP peer),
`network` and `cluster_bench` (its drivers on shaped links and on the rig)
and `network_report` / `cluster_report`. See docs/benchmarks/index.md.
"""
