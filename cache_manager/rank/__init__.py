"""What one rank does with its memory: what it holds (``resources``: device caches, host swap space,
storage, model version; ``signals``: the IPC signals it attached), the task scheduler, swap plans
and layer-wise copies, the RL clear/restore lifecycle and the barriers its ranks take together
(``lockstep``)."""
