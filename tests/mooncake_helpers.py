"""What the MooncakeStore tests share (test_mooncake_store.py, test_mooncake_prefault.py,
test_mooncake_config.py, test_mooncake_master.py): a real mooncake_master (LocalMooncakeMaster),
registered buffers and keys.  Import it after ``pytest.importorskip("mooncake.store")``.
"""
import os

import numpy as np
import pytest

from scripts.local_mooncake_master import LocalMooncakeMaster

SMALL = {"global_segment_size": "64mb", "local_buffer_size": "16mb"}


@pytest.fixture(autouse=True)
def _clean_mooncake_env(monkeypatch):
    """Tests set their own MOONCAKE_* variables; none leak in from the shell."""
    for name in list(os.environ):
        if name.startswith("MOONCAKE_") or name in ("LOCAL_HOSTNAME", "MC_RPC_TIMEOUT_MS",
                                                    "MC_RPC_CONNECT_TIMEOUT_MS", "MC_STORE_CLIENT_SETUP_RETRIES"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def master():
    with LocalMooncakeMaster(lease_ttl_ms=500) as m:
        yield m
    assert not m.is_running()



class Buffers:
    """``count`` objects of ``size`` bytes in one registered array, plus a zeroed destination."""

    def __init__(self, store, count, size, seed=0):
        self.count, self.size = count, size
        self.src = np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        store.register_buffer(self.src.ctypes.data, self.src.nbytes)
        store.register_buffer(self.dst.ctypes.data, self.dst.nbytes)

    def src_ptrs(self, n=None):
        return [self.src.ctypes.data + i * self.size for i in range(n or self.count)]

    def dst_ptrs(self, n=None):
        return [self.dst.ctypes.data + i * self.size for i in range(n or self.count)]

    def sizes(self, n=None):
        return [self.size] * (n or self.count)


def keys_for(ns, tag, n, rank=0, kind="k"):
    return [f"{ns}/{tag}{i:04d}/{rank}/{kind}" for i in range(n)]
