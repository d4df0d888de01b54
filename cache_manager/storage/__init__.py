"""The rank's storage movers: they feed a storage backend from the rank's device caches.

- ``staged_mover.StorageMover``: host-staged backends (file, mooncake): device blocks are copied
  into a block-major staging buffer and stored as one object per block, kind and rank.
- ``device_mover.DeviceStorageMover``: device-direct backends (EMS, AttentionStore) that move the
  device blocks themselves.
- ``transfer_modes``: the ``--storage_transfer`` modes and how a rank picks its path; the flag
  parser imports it alone, so this package imports no mover by itself.
- ``io_threads``: the I/O threads, scatter leases and per-task statistics both movers share.
"""

# Submodules, not names: importing the package must not load a mover (see transfer_modes above).
__all__ = ["device_mover", "io_threads", "staged_mover", "staging", "transfer_modes"]
