"""What an engine imports: create and export caches, start the CTMs, submit tasks and get futures."""
from .core.device_caches import CacheSpec
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
    "CacheSpec", "CacheTransferService", "CacheServiceError", "CachesClearedError", "CacheUpdateError", "RankDiedError", "ServiceClosed", "StartupError",
    "TaskFailedError", "TaskTimeoutError", "EngineCacheQueue",
]
