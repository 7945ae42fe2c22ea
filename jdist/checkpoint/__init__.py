"""Checkpoints: `CheckpointManager` (`manager`) and the stored layout (`layout`).

`manager` runs the collective save and restore (rank 0 writes with orbax);
`layout` says how a state's copies are stored and read back in either step
style. `jdist.checkpoint.CheckpointManager` is public.
"""

from jdist.checkpoint.manager import CheckpointManager

__all__ = ("CheckpointManager",)
