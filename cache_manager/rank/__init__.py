"""What one rank does with its memory: what it holds (``resources``: device caches, host swap space,
storage, model version; ``signals``: the IPC signals it attached), the task scheduler, swap plans
and layer-wise copies, the RL clear/restore lifecycle and the barriers its ranks take together
(``lockstep``)."""

# Submodules, not names: the scheduler's unit tests and the flag parser import one piece alone.
__all__ = ["layerwise_copy", "lifecycle", "lockstep", "resources", "scheduler", "signals", "swap_plans"]
