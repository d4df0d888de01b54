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


def _cpu_class() -> type[Platform]:
    from .cpu import CpuPlatform

    return CpuPlatform


def _npu_class() -> type[Platform]:
    from .npu import NpuPlatform  # imports no vendor module: that happens when one is constructed

    return NpuPlatform


def _cpu(**kwargs: Any) -> Platform:
    return _cpu_class()(**kwargs)


def _npu(**kwargs: Any) -> Platform:
    return _npu_class()(**kwargs)


PLATFORMS: dict[str, Callable[..., Platform]] = {"cpu": _cpu, "npu": _npu}
PLATFORM_CLASSES: dict[str, Callable[[], type[Platform]]] = {"cpu": _cpu_class, "npu": _npu_class}

_current: Platform | None = None
_current_lock = threading.Lock()


def _unknown(name: Any) -> ValueError:
    return ValueError(f"unknown platform {name!r}; known platforms: {', '.join(sorted(PLATFORMS))}")


def copy_engines(name: str) -> tuple[str, ...]:
    """The copy engines platform ``name`` offers (its class's ``copy_engines``; () for none), without
    constructing it.  An unknown name raises ``ValueError`` listing the known ones."""
    try:
        cls = PLATFORM_CLASSES[name]()
    except (KeyError, TypeError):
        raise _unknown(name) from None
    return tuple(cls.copy_engines)


def get_platform(name: str, instance: str | None = None, copy_engine: str | None = None, **kwargs: Any) -> Platform:
    """A new platform instance; an unknown name raises ``ValueError`` listing the known ones.
    ``instance`` (an engine's id in IPC names) goes to every platform that takes one.  ``copy_engine``
    is passed only when not None, and only to a platform that offers it: otherwise ``ValueError``
    naming the platform and the engines it has."""
    try:
        factory = PLATFORMS[name]
    except (KeyError, TypeError):
        raise _unknown(name) from None
    if instance is not None:
        kwargs["instance"] = instance
    if copy_engine is not None:
        engines = copy_engines(name)
        if copy_engine not in engines:
            raise ValueError(f"platform {name!r} has no copy engine {copy_engine!r}; its copy engines: "
                             f"{', '.join(engines) if engines else 'none'}")
        kwargs["copy_engine"] = copy_engine
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
    "DEVICE_TO_HOST", "HOST_TO_DEVICE", "PLATFORMS", "PLATFORM_CLASSES", "Platform", "copy_engines",
    "current_platform", "get_platform",
    "use_platform", "set_device", "set_data_ipc", "share_external_data_", "unset_data_ipc", "host_alloc",
    "host_free", "cuda_host_alloc", "cuda_host_free", "swap_cache_all_layers", "swap_cache_layout",
    "memory_allocated",
]
