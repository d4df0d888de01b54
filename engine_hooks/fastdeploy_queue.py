"""The name FastDeploy's adoption imports ``EngineCacheQueue`` by; it lives in ``engine_hooks.fastdeploy.queue``."""
from .fastdeploy.queue import EngineCacheQueue

__all__ = ["EngineCacheQueue"]
