"""FileStore segment format under real crashes and damage (transfer_factory/file/segments.py).

Every check compares bytes: after a writer is SIGKILLed (at a random moment, or stopped at a
point made observable: half-way through a batch's write, after the write but before its sync,
in the middle of a compaction), after segments are torn, truncated or damaged, and after two
processes wrote one rank directory at once, every key either reads back bit-exact or is a miss.
No assertion is about time.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from transfer_factory.file.segments import HEADER_SIZE, segment_size
from transfer_factory.file.store import FileStore
from transfer_factory.kvcache_storage import CORRUPT, NOT_FOUND, OK, UNAVAILABLE

REPO = Path(__file__).resolve().parents[1]
NS = "model-tp2-0123456789abcdef"
MAXLEN = 600 << 10

# Shared by the test and its child processes: key i always holds payload(i), so any byte that
# differs from payload(i) is a wrong byte, whoever wrote it.
_COMMON = r"""
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
exec(_COMMON, _ns)
payload, key_of, size_of = _ns["payload"], _ns["key_of"], _ns["size_of"]

# A writer: batches of blocks (K and V of consecutive ids) from `first` on; after each batch that
# returned OK it prints "acked <first id> <end id>".  `stop` makes one moment observable: it
# prints "stopped" there and waits to be killed.
_WRITER = _COMMON + r"""
import os, sys, time
from transfer_factory.file.store import FileStore

root, first, count, batch, stop, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    sys.argv[5], int(sys.argv[6])
store = FileStore(NS, 0, {"root": root, "fsync": True, "capacity_bytes": capacity})
armed = [False]


def hold():
    print("stopped", flush=True)
    while True:
        time.sleep(1)


if stop == "mid_write":             # a real partial write: half the batch's bytes reach the file
    import ctypes
    from transfer_factory.file import log as file_log
    real = file_log.write_records
    def write_records(fd, offset, headers, ptrs, sizes, counts=None):
        if armed[0]:
            image = []
            for i in range(len(ptrs)):
                image += [bytes(headers[i * 56:(i + 1) * 56]), ctypes.string_at(ptrs[i], sizes[i])]
            image = b"".join(image)
            os.pwrite(fd, image[:len(image) // 2 + 1], offset)
            hold()
        return real(fd, offset, headers, ptrs, sizes, counts)
    file_log.write_records = write_records
elif stop == "before_sync":         # every byte written, the sync (the commit) not done
    real_sync = os.fdatasync
    def fdatasync(fd):
        if armed[0]:
            hold()
        return real_sync(fd)
    os.fdatasync = fdatasync
elif stop == "compaction":          # the copies are durable, the old segment not removed yet
    real_compact, real_unlink = store.space_policy.compact, os.unlink
    def compact(seg):
        armed[0] = real_compact(seg)
        return armed[0]
    def unlink(path, *a, **kw):
        if armed[0] and str(path).endswith(".seg"):
            hold()
        return real_unlink(path, *a, **kw)
    store.space_policy.compact, os.unlink = compact, unlink

print("ready", flush=True)
i = first
n = 0
while i < first + count:
    ids = list(range(i, min(i + batch, first + count)))
    # With a compaction to catch, block 0 is stored again with every batch: still stored, so it
    # is refreshed (most recently used) and its first segment stays partly live.
    hot = [0, 1] if stop == "compaction" and i else []
    arrs = [payload(j) for j in ids + hot]
    n += 1
    if stop in ("mid_write", "before_sync"):
        armed[0] = n == 3
    codes = store.batch_set([key_of(j) for j in ids + hot], [a.ctypes.data for a in arrs],
                            [a.nbytes for a in arrs])
    if codes == [0] * len(arrs):
        print("acked %d %d" % (ids[0], ids[-1] + 1), flush=True)
    i += batch
print("done", flush=True)
"""


class Child:
    """A writer process whose stdout lines are collected as they come."""

    def __init__(self, root: Path, first: int, count: int, batch: int, stop: str = "none",
                 capacity: int = 1 << 30):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root), str(first), str(count), str(batch), stop, str(capacity)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        self.lines: list[str] = []
        self.event = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            self.event.set()

    def wait_for(self, word: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while word not in self.lines:
            if self.proc.poll() is not None:
                self.reader.join(5)
                assert word in self.lines, self.proc.stderr.read()
                return
            assert time.monotonic() < deadline, f"no {word!r} from the writer: {self.lines[-3:]}"
            self.event.wait(0.5)
            self.event.clear()

    def kill(self) -> set[int]:
        """SIGKILLs it; returns the ids of every batch it reported stored."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.reader.join(30)
        self.proc.stderr.close()
        acked = set()
        for line in self.lines:
            if line.startswith("acked "):
                a, b = map(int, line.split()[1:])
                acked.update(range(a, b))
        return acked


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


# ------------------------------------------------------------------------------------ killed writers
def test_a_writer_killed_at_random_moments_leaves_only_whole_objects(tmp_path):
    """Six writers in turn, each SIGKILLed at a random moment of its loop of batch_sets (often in
    the middle of a write); after each, a fresh store reads every key back bit-exact or misses,
    and every batch a writer reported stored is there."""
    rng = random.Random(12)
    acked: set[int] = set()
    count = 1500
    for round_ in range(6):
        first = round_ * count
        child = Child(tmp_path, first, count, batch=rng.choice([4, 16, 40]))
        child.wait_for("ready")
        time.sleep(rng.uniform(0.05, 0.5))               # not an assertion: where the kill lands
        acked |= child.kill()
        hits, misses = check_all(tmp_path, range(first + count), must=acked)
        assert hits >= len(acked)
    assert acked and len(segments(tmp_path)) >= 2        # each writer appended to a segment of its own


@pytest.mark.parametrize("stop", ["mid_write", "before_sync"])
def test_a_writer_killed_inside_a_commit(tmp_path, stop):
    """Stopped half-way through the third batch's write (a real partial record on disk), or with
    the batch written but not synced, then killed: the two batches before it are whole, the third
    reads back whole or misses, and the store goes on (new batches land and read back)."""
    child = Child(tmp_path, 0, 300, batch=10, stop=stop)
    child.wait_for("stopped")
    acked = child.kill()
    assert acked == set(range(20))
    hits, misses = check_all(tmp_path, range(40), must=acked)
    if stop == "mid_write":
        assert misses >= 1                               # at least the torn record of the third batch
        [seg] = segments(tmp_path)
        assert seg.stat().st_size > 0
    with open_store(tmp_path) as store:
        put_ids(store, range(1000, 1010))
    check_all(tmp_path, list(range(40)) + list(range(1000, 1010)), must=acked | set(range(1000, 1010)))


def test_a_compaction_killed_before_the_old_segment_goes(tmp_path):
    """A small capacity forces compactions; the writer is killed after a compaction's copies are
    written and synced but before the old segment is removed: both copies are right, so every key
    reads back bit-exact or misses, and nothing read is wrong."""
    cap = 2 << 20
    child = Child(tmp_path, 0, 5000, batch=6, stop="compaction", capacity=cap)
    child.wait_for("stopped")
    child.kill()
    hits, _ = check_all(tmp_path, range(5000), must={0, 1})   # block 0 was live in the segment compacted
    assert hits > 2


# ------------------------------------------------------------------------------------ torn and damaged segments
def _filled(root, ids) -> FileStore:
    store = open_store(root)
    put_ids(store, ids)
    return store


def test_a_torn_segment_tail_is_stepped_over_on_reopen(tmp_path):
    """The segment's last record cut at many points, or garbage after it: rebuilt on reopen with
    every other record bit-exact; the torn one misses; new records after the tail are found."""
    ids = list(range(30))
    for cut in (1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, 1000):
        root = tmp_path / f"cut{cut}"
        with _filled(root, ids) as store:
            last = store.object_location(key_of(ids[-1]))
        os.truncate(last.path, last.offset + cut)
        with open_store(root) as store:
            assert len(store) == len(ids) - 1
            for i in ids[:-1]:
                assert read_one(store, i) > 0
            assert read_one(store, ids[-1]) < 0
            put_ids(store, [500, 501])
        check_all(root, ids[:-1] + [500, 501], must=set(ids[:-1]) | {500, 501})
    root = tmp_path / "garbage"
    with _filled(root, ids) as store:
        last = store.object_location(key_of(ids[-1]))
    with open(last.path, "ab") as f:
        f.write(b"CTKR" + os.urandom(5000))             # a torn header that even starts right
    check_all(root, ids, must=set(ids))


@pytest.mark.parametrize("damage", ["zeroed_page", "garbage_header", "truncated_header"])
def test_a_torn_record_in_the_middle_of_a_segment_is_a_miss(tmp_path, damage):
    """A record in the middle of a segment torn (a page of zeros over its header, garbage over
    its header, or its header half overwritten by zeros): on reopen it misses and the scan finds
    every record after it; before the reopen, the open store misses it too."""
    ids = list(range(40))
    victim = 17
    store = _filled(tmp_path, ids)
    loc = store.object_location(key_of(victim))
    with open(loc.path, "r+b") as f:
        if damage == "zeroed_page":
            f.seek(loc.offset - 100)
            f.write(b"\0" * 4096)                        # the end of the record before it too
        elif damage == "garbage_header":
            f.seek(loc.offset)
            f.write(os.urandom(HEADER_SIZE))
        else:
            f.seek(loc.offset + HEADER_SIZE // 2)
            f.write(b"\0" * (HEADER_SIZE // 2))
    assert read_one(store, victim) < 0
    store.close()
    gone = {victim, victim - 1} if damage == "zeroed_page" else {victim}
    with open_store(tmp_path) as store:
        for i in ids:
            code = read_one(store, i)
            assert (code < 0) == (i in gone), (i, code)


def test_a_flipped_payload_byte_in_the_middle_is_a_miss_after_reopen(tmp_path):
    """Damage the scan cannot see (the header is intact): found at read, marked dead, and a miss
    from then on, across reopens; the records around it read back bit-exact."""
    ids = list(range(20))
    with _filled(tmp_path, ids) as store:
        loc = store.object_location(key_of(7))
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + HEADER_SIZE + 1234)
        byte = f.read(1)
        f.seek(loc.offset + HEADER_SIZE + 1234)
        f.write(bytes([byte[0] ^ 0x10]))
    with open_store(tmp_path) as store:
        assert len(store) == 20                          # the scan reads headers only
        assert read_one(store, 7) == CORRUPT
        for i in ids:
            assert (read_one(store, i) < 0) == (i == 7)
    with open_store(tmp_path) as store:
        assert len(store) == 19 and store.exists([key_of(7)]) == [0]


# ------------------------------------------------------------------------------------ two processes
_BOTH = _COMMON + r"""
import sys
from transfer_factory.file.store import FileStore

root, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = FileStore(NS, 0, {"root": root, "fsync": True})
print("ready", flush=True)
sys.stdin.readline()
shared = list(range(100000, 100040))                    # both store these: same key, same bytes
for start in range(first, first + count, 8):
    ids = list(range(start, min(start + 8, first + count))) + shared[(start // 8) % 5 * 8:][:8]
    arrs = [payload(j) for j in ids]
    codes = store.batch_set([key_of(j) for j in ids], [a.ctypes.data for a in arrs], [a.nbytes for a in arrs])
    assert codes == [0] * len(ids), codes
print("written", flush=True)
sys.stdin.readline()                                    # the other one has written too
wrong = missing = 0
out = np.empty(600 << 10, dtype=np.uint8)
for j in list(range(0, 2 * count)) + shared:
    code = store.batch_get([key_of(j)], [out.ctypes.data], [out.nbytes])[0]
    if code <= 0:
        missing += 1
    elif code != size_of(j) or not np.array_equal(out[:code], payload(j)):
        wrong += 1
print("read %d %d" % (wrong, missing), flush=True)
"""


def test_two_processes_write_one_rank_directory_at_once_and_both_read_everything(tmp_path):
    count = 400
    procs = [subprocess.Popen([sys.executable, "-c", _BOTH, str(tmp_path), str(first), str(count)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for first in (0, count)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:                                  # go together
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline().strip() == "written", p.stderr.read()
        assert len(segments(tmp_path)) >= 2              # each appended to segments of its own
        for p in procs:
            p.stdin.write("read\n")
            p.stdin.flush()
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert out.split() == ["read", "0", "0"], out    # no wrong byte, nothing missing
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    everything = list(range(2 * count)) + list(range(100000, 100040))
    check_all(tmp_path, everything, must=set(everything))


# ------------------------------------------------------------------------------------ capacity and reclaiming
def test_capacity_and_reclaiming_bound_memory_and_disk_over_many_writes(tmp_path):
    """Thousands of objects through a 3 MiB store, with reads that reorder the LRU and deletes:
    after every call the live bytes stay within the capacity and the segment files within the
    capacity plus one segment; the newest objects read back bit-exact, and compaction kept the
    objects that were read recently."""
    cap = 3 << 20
    seg = segment_size(cap, 0)
    rng = random.Random(3)
    store = open_store(tmp_path, capacity_bytes=cap)
    assert store.segment_bytes == seg
    hot = list(range(0, 40, 2))                          # read after every batch: must survive
    put_ids(store, hot)
    i = 1000
    for n in range(400):
        batch = list(range(i, i + rng.choice([1, 2, 6, 12])))
        i += len(batch)
        put_ids(store, batch)
        for h in hot:
            assert read_one(store, h) > 0, h
        if n % 7 == 0:
            assert store.delete([key_of(rng.randrange(1000, i))])[0] in (OK, NOT_FOUND)
        disk = sum(p.stat().st_size for p in segments(tmp_path))
        assert store.used_bytes <= cap
        assert disk == store.disk_bytes
        assert disk <= cap + seg, (n, disk)
    for j in range(i - 4, i):
        assert read_one(store, j) > 0
    # Few files: segments hold many objects (compacted survivors may sit in small ones).
    assert len(segments(tmp_path)) <= 2 * (cap // seg) + 4
    store.close()
    with open_store(tmp_path, capacity_bytes=cap) as again:   # what the index said is what is on disk
        for h in hot:
            assert read_one(again, h) > 0
        assert again.used_bytes <= cap


def test_many_small_objects_make_few_files_and_clear_removes_them(tmp_path):
    """The point of segments: ten thousand 4 KiB objects are a handful of files, and clear()
    removes them all."""
    store = open_store(tmp_path, capacity_bytes=1 << 30)
    a = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    for b in range(100):
        keys = [f"{NS}/{b * 100 + j:064x}/0/k" for j in range(100)]
        assert store.batch_set(keys, [a.ctypes.data] * 100, [4096] * 100) == [OK] * 100
    assert len(store) == 10000
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 2, files
    out = np.empty(4096, dtype=np.uint8)
    assert store.batch_get([f"{NS}/{1234:064x}/0/k"], [out.ctypes.data], [4096]) == [4096]
    assert np.array_equal(out, a)
    store.clear()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [] and len(store) == 0
    store.close()


# ------------------------------------------------------------------------------------ the directory under an open store
def test_a_rank_directory_moved_away_or_replaced_under_an_open_store(tmp_path):
    """Moved away: every call fails softly and the directory is not made again; back: the store
    works again.  Replaced by an empty one: the old objects are misses (never the bytes of the
    files it still holds open) and new ones land in the new directory."""
    store = open_store(tmp_path)
    put_ids(store, range(6))
    d = store.directory
    aside = d.with_name("aside")
    d.rename(aside)
    out = np.empty(MAXLEN, dtype=np.uint8)
    assert store.batch_get([key_of(0)], [out.ctypes.data], [MAXLEN]) == [UNAVAILABLE]
    assert store.exists([key_of(0)]) == [UNAVAILABLE]
    a = payload(6)
    assert store.batch_set([key_of(6)], [a.ctypes.data], [a.nbytes]) == [UNAVAILABLE]
    assert not d.exists()
    aside.rename(d)
    assert read_one(store, 0) > 0
    put_ids(store, [6])
    shutil.rmtree(d)
    d.mkdir(mode=0o700)
    for i in range(7):
        assert read_one(store, i) == NOT_FOUND
    put_ids(store, [7, 8])
    store.close()
    check_all(tmp_path, range(9), must={7, 8})
    assert len(segments(tmp_path)) == 1


def test_a_writer_goes_on_after_another_process_clears_the_directory(tmp_path):
    writer, other = open_store(tmp_path), open_store(tmp_path)
    put_ids(writer, range(4))
    other.clear()
    assert segments(tmp_path) == []
    put_ids(writer, range(10, 14))                       # its segment was removed: it starts a new one
    writer.close()
    other.close()
    hits, _ = check_all(tmp_path, list(range(4)) + list(range(10, 14)), must=set(range(10, 14)))
    assert hits == 4
