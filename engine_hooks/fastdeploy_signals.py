"""The name FastDeploy's adoption imports ``IPCSignal`` by; it lives in ``engine_hooks.fastdeploy.signals``."""
from .fastdeploy.signals import IPCSignal

__all__ = ["IPCSignal"]
