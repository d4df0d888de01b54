"""What the segment tests share (tests/transfer_factory/file/: test_file_store_segments.py,
test_file_store_processes.py): the payload each key always holds (also the preamble of their child
processes' scripts, COMMON), a store opened without fsync, and reads that assert every hit is bit-exact."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from transfer_factory.file.store import FileStore
from transfer_factory.kvcache_storage import CORRUPT, NOT_FOUND, OK

REPO = Path(__file__).resolve().parents[1]
NS = "model-tp2-0123456789abcdef"
MAXLEN = 600 << 10

# Shared by the tests and their child processes: key i always holds payload(i), so any byte that
# differs from payload(i) is a wrong byte, whoever wrote it.
COMMON = r"""
import numpy as np

NS = "model-tp2-0123456789abcdef"


def size_of(i):
    if i % 97 == 0:
        return 512 << 10
    return 4096 + (i * 7919) % (60 << 10)


def payload(i):
    return np.random.default_rng(i).integers(0, 256, size_of(i), dtype=np.uint8)


def key_of(i):
    return "%s/%064x/0/%s" % (NS, i // 2, "kv"[i % 2])
"""
_ns: dict = {}
exec(COMMON, _ns)
payload, key_of, size_of = _ns["payload"], _ns["key_of"], _ns["size_of"]


def open_store(root, **options) -> FileStore:
    return FileStore(NS, 0, {"root": str(root), "fsync": False, **options})


_OUT = np.empty(MAXLEN, dtype=np.uint8)


def read_one(store: FileStore, i: int) -> int:
    """The code of key i's read; asserts that a hit is bit-exact."""
    out = _OUT
    code = store.batch_get([key_of(i)], [out.ctypes.data], [MAXLEN])[0]
    if code > 0:
        assert code == size_of(i) and np.array_equal(out[:code], payload(i)), f"key {i}: wrong bytes"
    else:
        assert code in (NOT_FOUND, CORRUPT), (i, code)
    return code


def check_all(root, ids, must: set[int] = frozenset()) -> tuple[int, int]:
    """Reopens the store: every id reads back bit-exact or misses, and those in ``must`` hit.
    Returns (hits, misses)."""
    hits = misses = 0
    with open_store(root) as store:
        for i in ids:
            code = read_one(store, i)
            if code > 0:
                hits += 1
            else:
                assert i not in must, f"key {i} was acknowledged and is gone ({code})"
                misses += 1
    return hits, misses


def segments(root) -> list[Path]:
    return sorted(Path(root).rglob("*.seg"))


def put_ids(store: FileStore, ids) -> None:
    arrs = [payload(i) for i in ids]
    assert store.batch_set([key_of(i) for i in ids], [a.ctypes.data for a in arrs],
                           [a.nbytes for a in arrs]) == [OK] * len(ids)
