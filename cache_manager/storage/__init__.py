"""The rank's storage movers: they feed a storage backend from the rank's device caches.

- ``staged_mover.StorageMover``: host-staged backends (file, mooncake): device blocks are copied
  into a block-major staging buffer and stored as one object per block, kind and rank.
- ``device_mover.DeviceStorageMover``: device-direct backends (EMS, AttentionStore) that move the
  device blocks themselves.
- ``io_threads``: the I/O threads, scatter leases and per-task statistics both movers share.
"""
from cache_manager.storage.device_mover import DeviceStorageMover
from cache_manager.storage.staged_mover import TRANSFER_MODES, StorageMover, resolve_transfer

__all__ = ["DeviceStorageMover", "StorageMover", "TRANSFER_MODES", "resolve_transfer"]
