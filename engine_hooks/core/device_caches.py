"""The engine's device caches: allocated per rank, per cache group and layer, exported by FastDeploy name
(``{group}_{layer}_rank{r}.device{d}``: FastDeploy's own for K, V and scales, the same scheme for the
other groups of a cache layout).

On the CPU platform this stands in for the model runner, which owns the device caches
on a real accelerator; the CTMs only ever attach to them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from cache_manager.cache_data import cache_name
from cache_manager.cache_layout import CacheLayout
from cache_manager.cache_spec import CacheSpec, as_layout
from ops.platform import Platform

logger = logging.getLogger(__name__)


@dataclass
class DeviceCaches:
    """Every rank's exported caches: ``tensors[rank][group][i]``, the group's ``i``-th layer."""

    platform: Platform
    spec: CacheSpec | CacheLayout
    num_ranks: int
    device_ids: list[int]
    tensors: list[dict[str, list[Any]]] = field(default_factory=list)

    def create_rank(self, rank: int) -> None:
        self.platform.set_device(self.device_ids[rank])  # each rank's caches on its own device
        caches: dict[str, list[Any]] = {}
        self.tensors.append(caches)
        layout = as_layout(self.spec)
        for group in layout.groups:
            caches[group.name] = []
            for layer, rows in zip(group.layers, layout.rows(group)):
                tensor = self.platform.empty([rows, *group.block_shape], group.dtype)
                caches[group.name].append(tensor)
                self.platform.set_data_ipc(tensor, cache_name(group.name, layer, rank, self.device_ids[rank]))

    def close(self) -> None:
        layers_of = {g.name: g.layers for g in as_layout(self.spec).groups}
        for rank, caches in enumerate(self.tensors):
            for kind, tensors in caches.items():
                for layer, tensor in zip(layers_of[kind], tensors):
                    name = cache_name(kind, layer, rank, self.device_ids[rank])
                    self.platform.unset_data_ipc(tensor, name, close_ipc=False, unlink_shm=True)
                    self.platform.free(tensor)
        self.tensors.clear()
