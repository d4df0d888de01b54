"""A real ext4 file system on a loop device that a test can freeze, for faults of a frozen store.

``loop_ext4(directory)`` makes an image under ``directory`` (``truncate`` + ``mkfs.ext4 -q``), mounts
it with ``mount -o loop`` and yields a ``LoopFs``; ``freeze()`` is ``fsfreeze -f`` (what a snapshot
tool or a stalled SAN does: every writer to it blocks in uninterruptible sleep, D state, until the
thaw, and no signal ends it), ``thaw()`` is ``fsfreeze -u``.  The context always thaws, then
unmounts (the loop device goes with the mount), whatever the test did.  A test must thaw before it
waits for a process that may be writing there (stopping a CTM, say): only the thaw ends such a
wait.  The test process itself must not write there while frozen.

Skips (``pytest.skip``, naming why) unless root, with the tools present and a loop device to mount.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

logger = logging.getLogger(__name__)

TOOLS = ("truncate", "mkfs.ext4", "mount", "umount", "fsfreeze", "losetup")
CMD_TIMEOUT_S = 60.0   # none of these commands waits for a frozen writer (umount only runs thawed)
UMOUNT_TRIES = 20      # an umount right after a process let go of the mount may find it busy a moment


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=check)


class LoopFs:
    def __init__(self, image: Path, mount: Path) -> None:
        self.image = image
        self.mount = mount
        self.frozen = False

    def freeze(self) -> None:
        _run("fsfreeze", "-f", str(self.mount))
        self.frozen = True
        logger.warning("froze %s: writers there block until the thaw", self.mount)

    def thaw(self) -> None:
        """Idempotent: thawing a file system that is not frozen is harmless."""
        if not os.path.ismount(self.mount):
            return
        res = _run("fsfreeze", "-u", str(self.mount), check=False)
        if res.returncode and self.frozen:
            raise RuntimeError(f"fsfreeze -u {self.mount} failed ({res.returncode}): {res.stderr.strip()}")
        if self.frozen:
            logger.warning("thawed %s", self.mount)
        self.frozen = False

    def unmount(self) -> None:
        """Thaw, then unmount (a few tries while busy, then lazily: never left mounted)."""
        self.thaw()
        for _ in range(UMOUNT_TRIES):
            if not os.path.ismount(self.mount):
                break
            res = _run("umount", str(self.mount), check=False)
            if res.returncode == 0:
                break
            logger.warning("umount %s: %s; trying again", self.mount, res.stderr.strip())
            time.sleep(0.25)
        else:
            logger.error("umount %s kept failing: detaching it lazily", self.mount)
            _run("umount", "-l", str(self.mount), check=False)
        left = _run("losetup", "-j", str(self.image), check=False).stdout.split()
        if left:  # autoclear detaches the loop device at the umount; one left over is detached here
            device = left[0].rstrip(":")
            logger.error("loop device %s still backs %s: detaching it", device, self.image)
            _run("losetup", "-d", device, check=False)


def skip_reason() -> str | None:
    """Why a loop-mounted file system cannot be frozen here, or None."""
    if os.geteuid() != 0:
        return "mounting and freezing a loop file system needs root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    return None


@contextmanager
def loop_ext4(directory: Path, size_mb: int = 64) -> Iterator[LoopFs]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    image, mount = directory / "fs.img", directory / "mnt"
    mount.mkdir()
    _run("truncate", "-s", f"{size_mb}M", str(image))
    _run("mkfs.ext4", "-q", "-F", str(image))
    res = _run("mount", "-o", "loop", str(image), str(mount), check=False)
    if res.returncode:
        pytest.skip(f"cannot loop-mount an ext4 image here (mount exited {res.returncode}: {res.stderr.strip()})")
    fs = LoopFs(image, mount)
    try:
        yield fs
    finally:
        fs.unmount()
