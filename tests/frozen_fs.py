"""A real ext4 file system on a loop device that a test can freeze, for faults of a frozen store.

``loop_ext4(directory)`` makes an image under ``directory`` (``truncate`` + ``mkfs.ext4 -q``), attaches
it to a loop device (``losetup``), mounts it and yields a ``LoopFs``; ``freeze()`` is ``fsfreeze -f`` (what a snapshot
tool or a stalled SAN does: every writer to it blocks in uninterruptible sleep, D state, until the
thaw, and no signal ends it), ``thaw()`` is ``fsfreeze -u``.  The context always thaws, then
unmounts and detaches the loop device, whatever the test did.  A test must thaw before it
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
DETACH_WAIT_S = 5.0    # how long a detached loop device may still be listed for its image


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=check)


class LoopFs:
    def __init__(self, image: Path, device: str, mount: Path) -> None:
        self.image = image
        self.device = device
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
        self.detach()

    def attached(self) -> bool:
        """Whether a loop device still backs the image."""
        return bool(_run("losetup", "-j", str(self.image), check=False).stdout.strip())

    def detach(self) -> None:
        """Detach the loop device (unmounted) and wait until the kernel no longer lists it."""
        _run("losetup", "-d", self.device, check=False)  # ENXIO: already detached
        deadline = time.monotonic() + DETACH_WAIT_S
        while self.attached():
            if time.monotonic() >= deadline:
                # Seen when another process made a mount namespace while the file system was mounted
                # (a concurrent test's unshare): its copy of the mount holds the device.  The detach
                # set autoclear, so the kernel lets the device go when that namespace ends.
                logger.warning("loop device %s still backs %s %.0fs after its detach: another mount namespace "
                               "holds a copy of the mount; it detaches when that namespace ends", self.device,
                               self.image, DETACH_WAIT_S)
                return
            time.sleep(0.1)


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
    res = _run("losetup", "--find", "--show", str(image), check=False)
    if res.returncode:
        pytest.skip(f"no loop device here (losetup exited {res.returncode}: {res.stderr.strip()})")
    fs = LoopFs(image, res.stdout.strip(), mount)
    res = _run("mount", "-t", "ext4", fs.device, str(mount), check=False)
    if res.returncode:
        fs.detach()
        pytest.skip(f"cannot mount an ext4 loop device here (mount exited {res.returncode}: {res.stderr.strip()})")
    try:
        yield fs
    finally:
        fs.unmount()
