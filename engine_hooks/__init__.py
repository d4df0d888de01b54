"""What an engine imports: create and export caches, start the CTMs, submit tasks and get futures."""
from cache_manager.cache_layout import CacheLayout, TensorGroup
from cache_manager.cache_presets import preset
from cache_manager.cache_spec import CacheSpec
from .core.errors import (
    CacheServiceError,
    CachesClearedError,
    CacheUpdateError,
    RankDiedError,
    ServiceClosed,
    StartupError,
    TaskFailedError,
    TaskTimeoutError,
)
from .fastdeploy.queue import EngineCacheQueue
from .service import CacheTransferService

__all__ = [
    "CacheSpec", "CacheLayout", "TensorGroup", "preset", "CacheTransferService", "CacheServiceError", "CachesClearedError", "CacheUpdateError", "RankDiedError", "ServiceClosed", "StartupError",
    "TaskFailedError", "TaskTimeoutError", "EngineCacheQueue",
]
