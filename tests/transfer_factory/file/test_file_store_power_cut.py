"""A real power cut under two processes sharing one rank directory (issue 24 item 12).

Process A appends records and is stopped (SIGSTOP) between its write and its fdatasync; process B
(this test) opens the same rank directory, is told the keys exist and stores them again: OK, with
nothing written (B relies on A's records).  Then the power is "cut": the loop device's backing
image is copied as the kernel has written it so far, without any sync, so the copy holds exactly
what was made durable (the mounted filesystem's dirty pages are not in the backing file until
writeback, which is held off for the test).  The copy, mounted, must serve every key B was told
was stored, bit-exact.  Before the fix B acknowledged A's unsynced records and the copy lost them.

Root only (mkfs, losetup, mount); skipped elsewhere.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from transfer_factory.file.store import FileStore
from transfer_factory.file.store_io import address_of
from transfer_factory.kvcache_storage import OK

REPO = Path(__file__).resolve().parents[3]
NAMESPACE, RANK = "powercut", 0
OBJECT_BYTES = 16 << 10
KEYS = [f"{NAMESPACE}/blk{i:04d}/{RANK}/{kind}" for i in range(4) for kind in ("k", "v")]   # 8 objects
CONTROL = [f"{NAMESPACE}/ctl{i:04d}/{RANK}/{kind}" for i in range(2) for kind in ("k", "v")]
WRITEBACK_KNOBS = {"/proc/sys/vm/dirty_expire_centisecs": "360000", "/proc/sys/vm/dirty_writeback_centisecs": "0"}

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("mkfs.ext4", "losetup", "mount", "umount")),
    reason="needs root, mkfs.ext4, losetup and mount")

# Process A: stores KEYS, stopping itself just before the append's fdatasync.
CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from tests.transfer_factory.file.test_file_store_power_cut import KEYS, NAMESPACE, RANK, payloads
from transfer_factory.file.store import FileStore
from transfer_factory.file.store_io import address_of
real = os.fdatasync
def stop_then_sync(fd):
    os.kill(os.getpid(), signal.SIGSTOP)   # paused between its write and its sync
    real(fd)
os.fdatasync = stop_then_sync
store = FileStore(NAMESPACE, RANK, {"root": sys.argv[2]})
bufs = payloads(KEYS)
store.batch_set(KEYS, [address_of(b) for b in bufs], [len(b) for b in bufs])
"""


def payloads(keys: list[str]) -> list[bytearray]:
    """Distinct, reproducible bytes per key."""
    return [bytearray(np.random.default_rng(_seed(k)).integers(0, 256, OBJECT_BYTES, dtype=np.uint8).tobytes())
            for k in keys]


def _seed(key: str) -> int:
    return int.from_bytes(key.encode()[-16:].rjust(16, b"\0"), "little") % (1 << 32)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class Disk:
    """An ext4 image on a loop device, mounted; everything undone by ``close``."""

    def __init__(self, image: Path, mountpoint: Path, make: bool) -> None:
        self.image, self.mountpoint, self.loop = image, mountpoint, None
        self.mounted = False
        if make:
            with open(image, "wb") as f:
                f.truncate(64 << 20)
            _run("mkfs.ext4", "-q", "-F", str(image))
        self.loop = _run("losetup", "-f", "--show", str(image))
        mountpoint.mkdir(exist_ok=True)
        # commit=600: no periodic journal commit either; the store's own syncs are what make bytes durable.
        _run("mount", "-o", "commit=600", self.loop, str(mountpoint))
        self.mounted = True

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.mountpoint)], check=False)
            self.mounted = False
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], check=False)
            self.loop = None


def _wait_stopped(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        if got == pid:
            assert os.WIFSTOPPED(status), f"process A ended before its sync (status {status:#x})"
            return
        time.sleep(0.01)
    raise AssertionError("process A never reached its fdatasync")


def _read_back(store: FileStore, keys: list[str]) -> list[bytearray | None]:
    bufs = [bytearray(OBJECT_BYTES) for _ in keys]
    res = store.batch_get(keys, [address_of(b) for b in bufs], [len(b) for b in bufs])
    return [b if r == OBJECT_BYTES else None for b, r in zip(bufs, res)]


def test_keys_acknowledged_over_another_process_s_unsynced_records_survive_a_power_cut(tmp_path):
    saved = {}
    disks: list[Disk] = []
    child = None
    try:
        for knob, value in WRITEBACK_KNOBS.items():   # no writeback of dirty pages while the test runs
            saved[knob] = Path(knob).read_text()
            Path(knob).write_text(value)
        try:
            disk = Disk(tmp_path / "disk.img", tmp_path / "mnt", make=True)
        except (subprocess.CalledProcessError, OSError) as exc:
            pytest.skip(f"cannot mount an ext4 image on a loop device here: {exc}")
        disks.append(disk)
        root = str(disk.mountpoint / "store")
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), root], cwd=str(REPO))
        _wait_stopped(child.pid, 60)

        store = FileStore(NAMESPACE, RANK, {"root": root})           # B: this process
        rank_dir = Path(root) / NAMESPACE / f"rank{RANK}"
        a_segments = sorted(p.name for p in rank_dir.glob("*.seg"))
        assert len(a_segments) == 1, a_segments
        assert store.exists(KEYS) == [1] * len(KEYS)                # A's records, still unsynced, are seen
        bufs = payloads(KEYS)
        assert store.batch_set(KEYS, [address_of(b) for b in bufs], [len(b) for b in bufs]) == [OK] * len(KEYS)
        assert sorted(p.name for p in rank_dir.glob("*.seg")) == a_segments, "B wrote copies: nothing tested"
        ctl = payloads(CONTROL)                                      # B's own records: durable either way
        assert store.batch_set(CONTROL, [address_of(b) for b in ctl], [len(b) for b in ctl]) == [OK] * len(CONTROL)

        # The power cut: the backing file as the loop device has written it, no sync of anything.
        shutil.copyfile(disk.image, tmp_path / "after_cut.img")
        child.kill()
        child.wait()
        child = None
        store.close()
        disk.close()

        restored = Disk(tmp_path / "after_cut.img", tmp_path / "mnt2", make=False)   # mounting replays the journal
        disks.append(restored)
        after = FileStore(NAMESPACE, RANK, {"root": str(restored.mountpoint / "store")})
        try:
            got = _read_back(after, KEYS + CONTROL)
        finally:
            after.close()
        lost = [k for k, g in zip(KEYS + CONTROL, got) if g is None]
        assert not lost, f"{len(lost)} acknowledged keys lost by the power cut: {lost}"
        for key, g, want in zip(KEYS + CONTROL, got, bufs + ctl):
            assert g == want, f"{key} read back other bytes"
    finally:
        if child is not None:
            child.kill()
            child.wait()
        for d in reversed(disks):
            d.close()
        for knob, value in saved.items():
            Path(knob).write_text(value)
