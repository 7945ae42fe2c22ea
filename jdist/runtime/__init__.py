"""The runtime: who the processes are and how they talk between steps.

`topology` (what `jdist.init()` finds and starts), `world` (the MPI world:
the one place that imports mpi4py), `host` (host-side exchanges between
steps: broadcast, all-reduce of host values, barrier, agreeing on an
outcome), `watchdog` and `stall_report` (deadlines on every blocking
exchange, and what a stall reports). Nothing here knows about steps,
gradients or compression.
"""
