"""The engine core every front door shares (``engine_core``: task tracking, the supervisor, the host-slot
guard) and what the front doors are built from: futures, errors, launching and restarting CTMs, the
engine's device caches and signals, RL cache control, layer-wise tasks, wire tasks and metrics."""
