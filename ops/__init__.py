"""Platform layer: device/host memory, IPC of caches and block copies.

``get_platform(name)`` returns a platform by name; the module-level functions
(``swap_cache_all_layers``, ``set_data_ipc``, ...) act on the process's current
platform, chosen by ``CTM_PLATFORM`` (default ``cpu``), so code written against
FastDeploy's ``cache_manager.ops`` ports unchanged.  See ``ops.platform`` for the
contracts.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from .platform import DEVICE_TO_HOST, HOST_TO_DEVICE, Platform


def _cpu(**kwargs: Any) -> Platform:
    from .cpu import CpuPlatform

    return CpuPlatform(**kwargs)


def _npu(**kwargs: Any) -> Platform:
    from .npu import NpuPlatform

    return NpuPlatform(**kwargs)


PLATFORMS: dict[str, Callable[..., Platform]] = {"cpu": _cpu, "npu": _npu}

_current: Platform | None = None
_current_lock = threading.Lock()


def get_platform(name: str, instance: str | None = None, **kwargs: Any) -> Platform:
    """A new platform instance; an unknown name raises ``ValueError`` listing the known ones.
    ``instance`` (an engine's id in IPC names) goes to every platform that takes one."""
    try:
        factory = PLATFORMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown platform {name!r}; known platforms: {', '.join(sorted(PLATFORMS))}") from None
    if instance is not None:
        kwargs["instance"] = instance
    return factory(**kwargs)


def current_platform() -> Platform:
    """The process-wide platform, created on first use from ``CTM_PLATFORM``."""
    global _current
    with _current_lock:
        if _current is None:
            _current = get_platform(os.environ.get("CTM_PLATFORM", "cpu"))
        return _current


def use_platform(platform: Platform) -> None:
    """Make ``platform`` the process-wide one (a CTM does this at start)."""
    global _current
    with _current_lock:
        _current = platform


def _forward(method: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(current_platform(), method)(*args, **kwargs)

    call.__name__ = method
    call.__doc__ = getattr(Platform, method).__doc__
    return call


set_device = _forward("set_device")
set_data_ipc = _forward("set_data_ipc")
share_external_data_ = _forward("share_external_data_")
unset_data_ipc = _forward("unset_data_ipc")
host_alloc = _forward("host_alloc")
host_free = _forward("host_free")
cuda_host_alloc = _forward("cuda_host_alloc")
cuda_host_free = _forward("cuda_host_free")
swap_cache_all_layers = _forward("swap_cache_all_layers")
swap_cache_layout = _forward("swap_cache_layout")
memory_allocated = _forward("memory_allocated")

__all__ = [
    "DEVICE_TO_HOST", "HOST_TO_DEVICE", "PLATFORMS", "Platform", "current_platform", "get_platform",
    "use_platform", "set_device", "set_data_ipc", "share_external_data_", "unset_data_ipc", "host_alloc",
    "host_free", "cuda_host_alloc", "cuda_host_free", "swap_cache_all_layers", "swap_cache_layout",
    "memory_allocated",
]
