"""What one rank does with its memory: the task scheduler, swap plans and layer-wise copies, the
RL clear/restore lifecycle."""
