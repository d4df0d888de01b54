"""Shared pieces of the NPU-platform tests: the vendor stand-ins on the path, an engine and a CTM
platform over exported caches, and device bytes read and written by copy (never a host view)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

STANDINS = str(Path(__file__).resolve().parent / "standins")
SHAPE = (16, 2, 4, 8)  # [blocks, heads, block_size, head_dim]: 128 bytes of bf16 per block
BLOCK_BYTES = 128
LAYERS = 3


def use_acl_standin(tmp_path: Path, monkeypatch) -> Path:
    """The pyACL stand-in (and its siblings) importable here and in launched CTMs; its data dir."""
    acl_dir = tmp_path / "acl"
    acl_dir.mkdir(exist_ok=True)
    monkeypatch.syspath_prepend(STANDINS)
    monkeypatch.setenv("ACL_STANDIN_DIR", str(acl_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (STANDINS, os.environ.get("PYTHONPATH")) if p))
    return acl_dir


def forget_standin_modules() -> None:
    """Drop the stand-ins from sys.modules, so a later test sees no 'acl'."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("acl", "llm_datadist")]:
        del sys.modules[name]


class Rig:
    """An engine platform that exports per-layer caches (random bytes) and a CTM platform that
    imports them and owns host swap space, as in a service; ``plan`` is the swap plan."""

    def __init__(self, copy_engine: str = "acl", layers: int = LAYERS, num_cpu: int = 8):
        from ops.npu import NpuPlatform

        self.engine = NpuPlatform(instance="rig")
        self.ctm = NpuPlatform(instance="rig", copy_engine=copy_engine)
        self.engine.set_device(0)
        self.ctm.set_device(0)
        rng = np.random.default_rng(0)
        self.exported, self.attached, self.host = [], [], []
        for layer in range(layers):
            t = self.engine.empty(list(SHAPE), "bfloat16")
            self.engine.write_bytes(t, rng.integers(0, 256, (SHAPE[0], BLOCK_BYTES), dtype=np.uint8))
            self.engine.set_data_ipc(t, self.name(layer))
            self.exported.append(t)
            self.attached.append(self.ctm.share_external_data_(SimpleNamespace(dtype="bfloat16"), self.name(layer),
                                                               list(SHAPE)))
            self.host.append(self.ctm.host_alloc(num_cpu * BLOCK_BYTES))
        self.plan = self.ctm.plan_all_layers(self.attached, self.host, num_cpu)

    @staticmethod
    def name(layer: int) -> str:
        return f"key_caches_{layer}_rank0.device0"

    def read(self) -> list[np.ndarray]:
        return [self.engine.read_bytes(t) for t in self.exported]

    def zero(self) -> None:
        for t in self.exported:
            self.engine.write_bytes(t, np.zeros((SHAPE[0], BLOCK_BYTES), np.uint8))

    def close(self) -> None:
        for ptr in self.host:
            self.ctm.host_free(ptr)
        for layer, (t, view) in enumerate(zip(self.exported, self.attached)):
            self.ctm.unset_data_ipc(view, self.name(layer), close_ipc=True)  # importers close first (CANN docs)
            self.engine.unset_data_ipc(t, self.name(layer), close_ipc=False, unlink_shm=True)
            self.engine.free(t)


# ---------------------------------------------------------------------------- a service's device bytes
def leftovers(port: int) -> list[str]:
    """Segments and NPU IPC handles the service with this port could leave behind."""
    from tests.service_helpers import segments_of

    return segments_of(port) + sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ctm.npu.{port}."))


def caches(svc) -> dict:
    """(rank, kind, layer) -> device tensor."""
    return {(r, kind, layer): t for r, per_rank in enumerate(svc.caches.tensors)
            for kind, layers in per_rank.items() for layer, t in enumerate(layers)}


def fill(svc, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in caches(svc).values():
        shape = svc.platform.read_bytes(t).shape
        svc.platform.write_bytes(t, rng.integers(0, 256, shape, dtype=np.uint8))


def blocks(svc, ids) -> dict:
    return {k: svc.platform.read_bytes(t)[list(ids)] for k, t in caches(svc).items()}


def clear(svc, ids) -> None:
    for t in caches(svc).values():
        data = svc.platform.read_bytes(t)
        data[list(ids)] = 0
        svc.platform.write_bytes(t, data)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def scattered_swaps_are_bit_exact(svc, seed: int) -> bool:
    """Blocks 1, 4, 5, 9 out to host slots and back into 10, 11, 12, 15, every other block zeroed
    in between: True when every byte came back."""
    fill(svc, seed=seed)
    want = blocks(svc, [1, 4, 5, 9])
    svc.swap_to_cpu([1, 4, 5, 9], [0, 2, 3, 7]).result(timeout=30)
    clear(svc, range(svc.spec.num_blocks))
    svc.swap_to_gpu([10, 11, 12, 15], [0, 2, 3, 7]).result(timeout=30)
    return same(blocks(svc, [10, 11, 12, 15]), want)
