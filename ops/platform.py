"""The platform layer: one interface for the memory and copy primitives a CTM needs.

Everything above ``ops/`` is platform-free: it calls these primitives, never a
vendor API.  A platform is chosen by name (``ops.get_platform("cpu")``).

Primitives and their contracts (names as in FastDeploy, so engine code ports unchanged):

``set_device(device_id)``
    Bind the calling thread to a device.  A negative or non-integer id raises ``ValueError``.
``empty(shape, dtype)``
    Allocate device memory for a cache tensor (the model runner's allocation).
``free(tensor)``
    Release memory from ``empty``; outstanding views keep the bytes mapped until they go.
``set_data_ipc(tensor, name)``
    Export a device tensor under ``name`` so another process can attach it.
    Exporting a name twice raises ``FileExistsError``.
``share_external_data_(tensor, name, shape, use_ipc=True)``
    Attach the tensor exported as ``name``; ``tensor`` only gives the dtype.  The
    result aliases the exporter's memory (no copy).  A shape or dtype that does not
    match the export raises ``ValueError``.
``unset_data_ipc(tensor, name, close_ipc=True, unlink_shm=False)``
    Close an attachment; with ``unlink_shm`` also withdraw the export (exporter only).
``remove_orphans()`` / ``remove_attached()``
    Clean-up once the engine is gone: the creator's by its instance prefix; an attaching
    process's only of what it attached, by identity.
``host_alloc(nbytes) -> int`` / ``host_free(ptr)``
    Page-aligned host memory for swap space and staging buffers (FastDeploy's
    ``cuda_host_alloc``/``cuda_host_free`` are aliases).  Freeing an unknown pointer
    raises ``ValueError``.
``swap_cache_all_layers(caches, host_ptrs, num_cpu_blocks, device_block_ids, host_block_ids, device_id, mode)``
    For every layer ``l``, copy block ``device_block_ids[i]`` of ``caches[l]`` to/from
    block ``host_block_ids[i]`` of the host buffer at ``host_ptrs[l]``
    (``[num_cpu_blocks, *block_shape]``).  mode 0 device->host, 1 host->device.
``swap_cache_layout(caches, host_base_ptr, cache_shape, device_block_ids, host_block_ids, device_id, mode)``
    The same between per-layer caches of shape ``cache_shape`` and one block-major
    staging buffer ``[block, layer, *block_shape]`` at ``host_base_ptr``.
``memory_allocated(device_id=None) -> int``
    Bytes of device memory this process allocated with ``empty``.

Both copies check every id, length, size and dtype before the first byte moves and
raise ``ValueError`` naming the bad value; no copy writes outside its buffer.  A
destination block listed twice is refused.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Sequence

from .layout import CopyPlan, HostAllocations, all_layers_plan, layout_plan
from .modes import DEVICE_TO_HOST, HOST_TO_DEVICE, BlockIds
from .shm import sweep_orphans, unlink_if_same, unlink_segments

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BlockIds", "CopyPlan", "DEVICE_TO_HOST", "HOST_TO_DEVICE", "HostAllocations", "Platform"]


class Platform(ABC):
    """A device family: its memory, its IPC and its block copies."""

    name: str = "abstract"
    # True where device memory is ordinary host memory (the CPU platform): a storage
    # backend may then read and write the caches in place, with no staging copy.
    host_addressable: bool = False
    # True where IPC names carry an engine instance, so two engines on one host never collide:
    # ``ops.get_platform(name, instance=...)`` passes it only to such platforms.
    takes_instance: bool = False
    # The copy engines the platform offers (the first is its default), chosen with
    # ``ops.get_platform(name, copy_engine=...)``; () where the platform has one fixed way to copy.
    copy_engines: tuple[str, ...] = ()
    # True where a block copy is a plain memcpy of host memory that cannot stall on a device:
    # the CTM then runs a small swap on its serve thread instead of handing it to a pool.
    copies_cannot_stall: bool = False
    # True where one plan merged from several kinds' swap plans (``ops.layout.merge_plans``) copies
    # as the kinds' own plans would: the CTM then makes one copy call per task, not one per kind.
    merges_swap_plans: bool = True
    # True where device memory is a named shared-memory region that a process of another engine
    # instance on the same host can map (``exported_region``): the same-host peer transport of
    # prefill/decode (DESIGN §3.11) then copies a peer's blocks with the block-copy kernel.
    exports_device_memory: bool = False

    @property
    def segment_prefix(self) -> str:
        """The prefix of every shared-memory name this platform instance creates ('' if none)."""
        return ""

    @abstractmethod
    def read_bytes(self, tensor: Any) -> "np.ndarray":
        """A host copy of a device cache's bytes, ``[num_blocks, block_bytes]`` (tests, diagnostics)."""

    @abstractmethod
    def write_bytes(self, tensor: Any, data: "np.ndarray") -> None:
        """Overwrite a device cache with ``data``, exactly its size in bytes."""

    def remove_orphans(self) -> list[str]:
        """The creator's own clean-up: remove every name under this instance's prefix (its IPC handles
        and, where the memory itself is shared memory, the memory); the names removed.  Idempotent.
        Only the engine that created the names may call it: a process that attached removes what it
        attached, by identity (``remove_attached``)."""
        return unlink_segments(self.segment_prefix) if self.segment_prefix else []

    def attached_segments(self) -> dict[str, tuple[int, int]]:
        """Every shared-memory name this process attached through the platform, with the identity
        (device, inode) of the file it attached ({} where attaching maps no named segment)."""
        return {}

    def remove_attached(self) -> list[str]:
        """Once the engine is gone: unlink each segment this process attached (``attached_segments``),
        only while its name still holds the file attached; a later engine's segment under the name
        stays.  The names removed."""
        return [name for name, identity in self.attached_segments().items() if unlink_if_same(name, identity)]

    def sweep_orphans(self) -> list[str]:
        """Remove what processes that are provably gone created in /dev/shm and left (``ops.shm.sweep_orphans``:
        by each creator's record, by identity, only our uid's): an instance killed whole, engine and CTMs
        at once, leaves its caches, handles and signals for the next start to sweep.  The names removed."""
        return sweep_orphans()

    @abstractmethod
    def set_device(self, device_id: int) -> None: ...

    @abstractmethod
    def empty(self, shape: Sequence[int], dtype: str) -> Any: ...

    @abstractmethod
    def free(self, tensor: Any) -> None: ...

    @abstractmethod
    def set_data_ipc(self, tensor: Any, name: str) -> None: ...

    @abstractmethod
    def share_external_data_(self, tensor: Any, name: str, shape: Sequence[int], use_ipc: bool = True) -> Any: ...

    @abstractmethod
    def unset_data_ipc(self, tensor: Any, name: str, close_ipc: bool = True, unlink_shm: bool = False) -> None: ...

    @abstractmethod
    def host_alloc(self, nbytes: int) -> int: ...

    @abstractmethod
    def host_free(self, ptr: int) -> None: ...

    # -- block copies: a plan is checked once, then run many times ------------------
    @property
    @abstractmethod
    def host_allocations(self) -> "HostAllocations":
        """The bookkeeping of ``host_alloc`` that bounds-checks host pointers."""

    @abstractmethod
    def run_plan(self, plan: "CopyPlan", device_block_ids: BlockIds, host_block_ids: BlockIds, mode: int,
                 bulk: bool = False) -> int:
        """Copy the listed blocks of a checked plan; checks ids and mode first.  Returns the copy count.
        ``bulk``: the call is one piece of a transfer far larger than the CPU caches (a hint; a
        platform whose copies do not pass through the CPU caches ignores it)."""

    # A platform that can hash each block as it copies it (the CPU's kernel) sets this and defines
    # ``run_plan_digested(plan, device_ids, host_ids, mode, xxh3, out)``: a P/D pull with digests
    # then hashes what it received while it is still in the caches.
    digests_copies: bool = False

    def plan_all_layers(self, caches: Sequence[Any], host_ptrs: Sequence[int], num_cpu_blocks: int) -> "CopyPlan":
        """The checked plan of ``swap_cache_all_layers``; a CTM builds it once and reuses it per task."""
        return all_layers_plan(caches, host_ptrs, num_cpu_blocks, self.host_allocations)

    def plan_layout(self, caches: Sequence[Any], host_base_ptr: int, cache_shape: Sequence[int]) -> "CopyPlan":
        """The checked plan of ``swap_cache_layout``."""
        return layout_plan(caches, host_base_ptr, cache_shape, self.host_allocations)

    def swap_cache_all_layers(
        self,
        caches: Sequence[Any],
        host_ptrs: Sequence[int],
        num_cpu_blocks: int,
        device_block_ids: BlockIds,
        host_block_ids: BlockIds,
        device_id: int,
        mode: int,
    ) -> None:
        self.set_device(device_id)
        self.run_plan(self.plan_all_layers(caches, host_ptrs, num_cpu_blocks), device_block_ids, host_block_ids, mode)

    def swap_cache_layout(
        self,
        caches: Sequence[Any],
        host_base_ptr: int,
        cache_shape: Sequence[int],
        device_block_ids: BlockIds,
        host_block_ids: BlockIds,
        device_id: int,
        mode: int,
    ) -> None:
        self.set_device(device_id)
        self.run_plan(self.plan_layout(caches, host_base_ptr, cache_shape), device_block_ids, host_block_ids, mode)

    @abstractmethod
    def memory_allocated(self, device_id: int | None = None) -> int: ...

    def host_buffer(self, ptr: int, nbytes: int) -> "np.ndarray":
        """A uint8 numpy view of ``nbytes`` of host memory at ``ptr`` (inside a ``host_alloc`` allocation)."""
        import ctypes

        import numpy as np

        room = self.host_allocations.room(ptr, "host pointer")
        if nbytes < 0 or nbytes > room:
            raise ValueError(f"host view of {nbytes} bytes at {ptr:#x} exceeds its allocation ({room} bytes left)")
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    # FastDeploy's names for the host allocator.
    def cuda_host_alloc(self, nbytes: int) -> int:
        return self.host_alloc(nbytes)

    def cuda_host_free(self, ptr: int) -> None:
        self.host_free(ptr)
