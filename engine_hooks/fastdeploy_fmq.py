"""The name FastDeploy's adoption imports ``FMQ`` by in its engine; it lives in ``engine_hooks.fastdeploy.fmq``."""
from .fastdeploy.fmq import FMQ

__all__ = ["FMQ"]
