"""What the FileStore tests share (tests/transfer_factory/file/: test_file_store.py, test_file_store_damage.py,
test_file_store_capacity.py, test_file_store_directories.py, test_file_store_concurrency.py): the
namespace, key and payload makers, a store opened without fsync, single-object put and get, and the
``store`` fixture (a test module binds it with ``store = store_fixture``)."""
from pathlib import Path

import numpy as np
import pytest

from transfer_factory.file.store import FileStore

REPO = Path(__file__).resolve().parents[1]
NS = "model-tp2-0123456789abcdef"


def key(i, rank=0, kind="k", ns=NS):
    return f"{ns}/{i:064x}/{rank}/{kind}"


def rand_bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def open_store(root, namespace=NS, rank=0, **options):
    options.setdefault("fsync", False)
    return FileStore(namespace=namespace, rank=rank, options={"root": str(root), **options})


def put(store, k, arr):
    return store.batch_set([k], [arr.ctypes.data], [arr.nbytes])[0]


def get(store, k, n):
    out = np.zeros(n, dtype=np.uint8)
    code = store.batch_get([k], [out.ctypes.data], [n])[0]
    return code, out


@pytest.fixture(name="store")
def store_fixture(tmp_path):
    with open_store(tmp_path / "kv") as s:
        yield s
