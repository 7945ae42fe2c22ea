"""jdist's benchmarks: one entry point, `python -m benchmarks SECTION`.

    python -m benchmarks list           # the sections and where each runs
    python -m benchmarks                # the suite (~10 min on 2 cores); `suite` for short
    python -m benchmarks --quick        # the smoke run CI uses (tiny sizes)
    python -m benchmarks network        # jdist vs PyTorch DDP on shaped links (root; ~16 min)
    python -m benchmarks network --on rig   # the same on the cluster rig (root)
    python -m benchmarks accuracy       # accuracy vs compression (~27 min)
    mpirun -np 2 python -m benchmarks styles      # a jit step against data_parallel

Layers: `harness` (what sections share: `section` (Section, Run), `jobs`,
`worker`, `timing`, `netns` (shaped links), `cluster` (the rig), `workload`,
`torch_peer`, `analysis`, `report`, `plots`, `outputs`), which never imports a
section; `sections` (one module or package per section, each declaring its
`SECTION`); `registry` (finds them) and `__main__` (the one parser). See
docs/benchmarks/index.md.
"""
