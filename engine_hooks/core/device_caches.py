"""The engine's device caches: allocated per rank, per layer and kind, exported by FastDeploy name.

On the CPU platform this stands in for the model runner, which owns the device caches
on a real accelerator; the CTMs only ever attach to them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from cache_manager.cache_data import cache_name
from cache_manager.cache_spec import CacheSpec
from ops.platform import Platform

logger = logging.getLogger(__name__)


@dataclass
class DeviceCaches:
    """Every rank's exported caches: ``tensors[rank][kind][layer]``."""

    platform: Platform
    spec: CacheSpec
    num_ranks: int
    device_ids: list[int]
    tensors: list[dict[str, list[Any]]] = field(default_factory=list)

    def create_rank(self, rank: int) -> None:
        self.platform.set_device(self.device_ids[rank])  # each rank's caches on its own device
        caches: dict[str, list[Any]] = {}
        self.tensors.append(caches)
        for kind, block_shape, dtype in self.spec.kinds():
            caches[kind] = []
            for layer, blocks in enumerate(self.spec.layer_blocks()):
                tensor = self.platform.empty([blocks] + block_shape, dtype)
                caches[kind].append(tensor)
                self.platform.set_data_ipc(tensor, cache_name(kind, layer, rank, self.device_ids[rank]))

    def close(self) -> None:
        for rank, caches in enumerate(self.tensors):
            for kind, layers in caches.items():
                for layer, tensor in enumerate(layers):
                    name = cache_name(kind, layer, rank, self.device_ids[rank])
                    self.platform.unset_data_ipc(tensor, name, close_ipc=False, unlink_shm=True)
                    self.platform.free(tensor)
        self.tensors.clear()
