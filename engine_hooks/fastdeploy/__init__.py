"""The FastDeploy front door: its ``EngineCacheQueue`` façade (``queue``) over the engine core, with its
queue address, control requests, transfer tasks, IPC signals and queue secret.  Adopters import it by
the names FastDeploy's adoption uses: ``engine_hooks.fastdeploy_queue`` and ``engine_hooks.fastdeploy_signals``."""
