"""FileStore segments under real writer processes (transfer_factory/file/segments.py).

Every check compares bytes: after a writer is SIGKILLed (at a random moment, or stopped at a
point made observable: half-way through a batch's write, after the write but before its sync,
in the middle of a compaction), and after two processes wrote one rank directory at once, every
key either reads back bit-exact or is a miss.  No assertion is about time.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.file_store_segment_helpers import COMMON, REPO, check_all, open_store, put_ids, segments

# A writer: batches of blocks (K and V of consecutive ids) from `first` on; after each batch that
# returned OK it prints "acked <first id> <end id>".  `stop` makes one moment observable: it
# prints "stopped" there and waits to be killed.
_WRITER = COMMON + r"""
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


# ------------------------------------------------------------------------------------ two processes
_BOTH = COMMON + r"""
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
