import itertools
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from ops.cpu import CpuPlatform
from ops.shm import unlink_segments

_instances = itertools.count()


@pytest.fixture(autouse=True, scope="session")
def _ctm_logs(tmp_path_factory):
    """CTM logs of the whole run in one pytest temp dir, not in the checkout's ./log."""
    os.environ.setdefault("CTM_LOG_DIR", str(tmp_path_factory.mktemp("ctm-logs")))
    yield


@pytest.fixture
def cpu():
    """A CPU platform with a unique instance id; fails the test if it leaves a segment behind."""
    platform = CpuPlatform(instance=f"t{os.getpid()}i{next(_instances)}", copy_threads=2)
    yield platform
    for ptr in list(platform._device):
        alloc = platform._device.pop(ptr)
        if alloc.owned:
            alloc.segment.unlink()
        alloc.segment.close()
    for ptr in platform._hosts:
        platform.host_free(ptr)
    leftovers = unlink_segments(platform.segment_prefix)
    assert not leftovers, f"segments left in /dev/shm: {leftovers}"


SMALL_FS_BYTES = 2 << 20  # the small tmpfs: 512 pages of 4 KiB


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for the test (a filesystem the test can really fill); needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS_BYTES},mode=0755", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {mnt}: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)   # still busy: detach it anyway
