"""FileStore on a real full filesystem (DESIGN §4, issue 8): a small tmpfs is mounted for each test
and filled for real, by a ballast file or by the store itself; nothing about the filesystem is mocked.

Needs root to mount; skipped with the reason otherwise."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from pathlib import Path

import numpy as np

from transfer_factory.file.store import HEADER_SIZE, FileStore
from transfer_factory.kvcache_storage import NO_SPACE, NOT_FOUND, OK

log = logging.getLogger(__name__)

NS = "model-tp2-0123456789abcdef"
FS_BYTES = 2 << 20                 # the tmpfs of the small_fs fixture (tests/conftest.py)
PAGE = 4096
FAIL_FAST_S = 2.0                  # a write on a full disk must answer at once, never wait for space


def fill(path: Path) -> int:
    """Writes a ballast file until the filesystem refuses another byte; returns its size."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (1 << 20, PAGE, 1):              # big steps, then the last pages and bytes
            data = b"\xee" * chunk
            while True:
                try:
                    n = os.write(fd, data)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
                written += n
                if n < chunk:
                    break
    finally:
        os.close(fd)
    assert os.statvfs(path).f_bavail == 0
    return written


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def block_keys(i: int) -> list[str]:
    h = hashlib.sha256(f"block {i}".encode()).hexdigest()
    return [f"{NS}/{h}/0/k", f"{NS}/{h}/0/v"]


def batch_of(blocks: list[int]) -> list[str]:
    """The CTM's order: every block's K, then every block's V."""
    keys = [block_keys(i) for i in blocks]
    return [k for k, _ in keys] + [v for _, v in keys]


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


# ------------------------------------------------------------------------------------ a full disk
def test_a_full_disk_fails_writes_cleanly_and_they_succeed_once_space_frees(small_fs: Path) -> None:
    n = 60000                                         # 15 pages per object, 30 per block
    store = FileStore(NS, 0, {"root": str(small_fs / "store"), "fsync": True})
    ballast = small_fs / "ballast"
    fill(ballast)
    blocks = [0, 1, 2, 3]
    keys = batch_of(blocks)
    srcs = [rand(n, i) for i in range(len(keys))]
    ptrs, sizes = [a.ctypes.data for a in srcs], [n] * len(keys)

    start = time.monotonic()
    assert store.batch_set(keys, ptrs, sizes) == [NO_SPACE] * len(keys)
    took = time.monotonic() - start
    assert took < FAIL_FAST_S, took
    assert files_under(small_fs) == ["ballast"]       # no temp file, no object
    assert store.exists(keys) == [0] * len(keys) and len(store) == 0
    outs = [np.full(n, 0xA5, dtype=np.uint8) for _ in keys]
    assert store.batch_get(keys, [o.ctypes.data for o in outs], sizes) == [NOT_FOUND] * len(keys)
    assert all((o == 0xA5).all() for o in outs)       # a miss writes no byte

    # Room for one object, not two: the K of each block fits, its V does not.  The block must not
    # stay half-stored (the issue-8 jam): its K is removed and reports the failure too.
    os.truncate(ballast, os.path.getsize(ballast) - pages(HEADER_SIZE + n) - PAGE)
    for _ in range(3):                                # the same outcome however often the CTM retries
        start = time.monotonic()
        assert store.batch_set(keys[:1] + keys[4:5], ptrs[:1] + ptrs[4:5], [n, n]) == [NO_SPACE, NO_SPACE]
        assert time.monotonic() - start < FAIL_FAST_S
        assert files_under(small_fs) == ["ballast"]
    assert store.exists(keys) == [0] * len(keys)

    ballast.unlink()                                  # space frees: no restart, no reset
    start = time.monotonic()
    assert store.batch_set(keys, ptrs, sizes) == [OK] * len(keys)
    wrote = time.monotonic() - start
    outs = [np.zeros(n, dtype=np.uint8) for _ in keys]
    assert store.batch_get(keys, [o.ctypes.data for o in outs], sizes) == sizes
    for src, out in zip(srcs, outs):
        assert np.array_equal(src, out)
    assert not [f for f in files_under(small_fs) if ".tmp." in f]
    log.info("full disk: %d writes failed in %.3f s; after freeing, %d objects written in %.3f s and %d bytes "
             "compared bit-exact", len(keys), took, len(keys), wrote, n * len(keys))
    store.close()


def test_the_store_filling_the_disk_itself_evicts_its_oldest_blocks(small_fs: Path) -> None:
    n = 100000                                        # 25 pages per object: about 10 blocks fit in 2 MiB
    store = FileStore(NS, 0, {"root": str(small_fs / "store"), "fsync": True})   # capacity 64 GiB >> 2 MiB
    assert store.capacity_bytes > FS_BYTES
    data: dict[int, list[np.ndarray]] = {}
    for i in range(40):
        data[i] = [rand(n, 2 * i), rand(n, 2 * i + 1)]
        keys = batch_of([i])
        start = time.monotonic()
        assert store.batch_set(keys, [a.ctypes.data for a in data[i]], [n, n]) == [OK, OK], i
        assert time.monotonic() - start < FAIL_FAST_S
    present = [i for i in data if store.exists(block_keys(i)) == [1, 1]]
    halves = [i for i in data if store.exists(block_keys(i)) in ([1, 0], [0, 1])]
    assert halves == []                               # eviction never leaves a block half-stored
    assert present == list(range(40 - len(present), 40)) and 5 <= len(present) < 20   # the newest survive
    compared = 0
    for i in present:
        outs = [np.zeros(n, dtype=np.uint8) for _ in range(2)]
        assert store.batch_get(block_keys(i), [o.ctypes.data for o in outs], [n, n]) == [n, n]
        assert np.array_equal(outs[0], data[i][0]) and np.array_equal(outs[1], data[i][1])
        compared += 2 * n
    assert not [f for f in files_under(small_fs) if ".tmp." in f]
    # A batch of one block (200 KB) is more than a segment (128 KiB on this 2 MiB filesystem), so
    # each block has a segment of its own and whole segments were dropped, oldest first.
    segments = [f for f in files_under(small_fs) if f.endswith(".seg")]
    assert len(segments) == len(files_under(small_fs)) == len(present) and len(store) == 2 * len(present)
    log.info("store filled its own disk: 40 blocks written, the newest %d kept, %d bytes compared bit-exact",
             len(present), compared)
    store.close()


def test_small_objects_sharing_segments_fill_the_disk_and_whole_segments_go(small_fs: Path) -> None:
    """Blocks of two 8 KB objects: about eight share each 128 KiB segment.  Filling the disk, the
    store drops its oldest whole segments and every write succeeds; what remains is the newest
    blocks, none of them half, bit-exact."""
    n = 8000
    store = FileStore(NS, 0, {"root": str(small_fs / "store"), "fsync": True})
    data: dict[int, list[np.ndarray]] = {}
    for i in range(400):
        data[i] = [rand(n, 2 * i), rand(n, 2 * i + 1)]
        assert store.batch_set(batch_of([i]), [a.ctypes.data for a in data[i]], [n, n]) == [OK, OK], i
    present = [i for i in data if store.exists(block_keys(i)) == [1, 1]]
    assert [i for i in data if store.exists(block_keys(i)) in ([1, 0], [0, 1])] == []
    assert present == list(range(400 - len(present), 400)) and 50 <= len(present) < 200
    for i in present:
        outs = [np.zeros(n, dtype=np.uint8) for _ in range(2)]
        assert store.batch_get(block_keys(i), [o.ctypes.data for o in outs], [n, n]) == [n, n]
        assert np.array_equal(outs[0], data[i][0]) and np.array_equal(outs[1], data[i][1])
    segments = [f for f in files_under(small_fs) if f.endswith(".seg")]
    assert len(segments) < len(present) // 4                # many blocks per segment
    store.close()


def test_a_disk_full_of_other_files_keeps_the_cache(small_fs: Path) -> None:
    """When evicting everything could not make room, nothing is evicted: the write fails, the cache stays."""
    n = 8000
    store = FileStore(NS, 0, {"root": str(small_fs / "store"), "fsync": False})
    small = [rand(n, i) for i in range(2)]
    assert store.batch_set(batch_of([0]), [a.ctypes.data for a in small], [n, n]) == [OK, OK]
    fill(small_fs / "ballast")
    big = [rand(10 * n, 10 + i) for i in range(2)]     # needs far more than the cache holds
    assert store.batch_set(batch_of([1]), [a.ctypes.data for a in big], [10 * n] * 2) == [NO_SPACE] * 2
    assert store.exists(batch_of([0, 1])) == [1, 0, 1, 0]
    store.close()


# ------------------------------------------------------------------------------------ TP=2, real CTMs
