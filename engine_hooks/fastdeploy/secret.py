"""The FastDeploy façade's queue secret: derived from the engine's ``authkey`` with HKDF-SHA256 under a
fresh random salt per queue, and handed to the CTMs in a private file, never in the environment.

* Derivation (RFC 5869): ``PRK = HMAC-SHA256(salt, authkey)``, ``secret = HMAC-SHA256(PRK, label || 1)``
  with the label ``b"ctm-queue-secret\\0"``.  The salt (16 random bytes) stays in the engine's memory,
  so two queues with the same authkey have different secrets, and an authkey that leaks (FastDeploy
  configurations and command lines carry it) does not give the secret away.
* Hand-over: ``SecretFile`` writes the secret as hex into a 0600 file in a fresh 0700 directory of
  ours and the engine exports only its *path* (``CTM_QUEUE_SECRET_FILE``), which every CTM it
  launches inherits and ``wire.load_secret`` checks (our own, private, regular).  Every other child
  of the engine inherits a path it can read only as our uid: the secret itself is in no process's
  environment.  The file goes at ``close()``, or when the process exits.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import shutil
import stat
import tempfile
import weakref

from cache_manager.queue import wire

logger = logging.getLogger(__name__)

SECRET_LABEL = b"ctm-queue-secret\0"
SALT_BYTES = 16
DEFAULT_AUTHKEY = b"cache_queue_service"  # FastDeploy's fixed default: public, so never a secret


def queue_secret(authkey: bytes | str, salt: bytes | None = None) -> tuple[bytes, bool]:
    """(the 32-byte queue secret, whether it derives from ``authkey``): HKDF-SHA256 of ``authkey``
    under ``salt`` (a fresh random one if None, so every queue has its own secret); a random secret
    for the public default key."""
    key = authkey.encode() if isinstance(authkey, str) else authkey
    if not isinstance(key, (bytes, bytearray)):
        raise ValueError(f"authkey must be bytes, got {type(authkey).__name__}")
    if not key or bytes(key) == DEFAULT_AUTHKEY:
        return wire.new_secret(), False
    return derive_secret(bytes(key), new_salt() if salt is None else salt), True


def derive_secret(authkey: bytes, salt: bytes, label: bytes = SECRET_LABEL) -> bytes:
    """HKDF-SHA256 (extract, then one block of expand) of ``authkey``: 32 bytes."""
    if len(salt) < SALT_BYTES:
        raise ValueError(f"salt of {len(salt)} bytes: at least {SALT_BYTES} are needed")
    prk = hmac.digest(salt, authkey, "sha256")
    return hmac.digest(prk, label + b"\x01", "sha256")


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def _private_parent() -> str | None:
    """``$XDG_RUNTIME_DIR`` when it is a private directory of ours (tmpfs, per user), else the default
    temporary directory (``mkdtemp`` makes a fresh, unguessable 0700 directory there either way)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            st = os.stat(runtime)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return runtime
    return None


def _remove(directory: str, owner_pid: int) -> None:
    # A forked child inherits this finalizer: only the process that wrote the file removes it.
    if os.getpid() == owner_pid:
        shutil.rmtree(directory, ignore_errors=True)


class SecretFile:
    """``secret`` as hex in ``path``: 0600, in a fresh 0700 directory of ours; removed by ``close()``
    (idempotent) or at exit."""

    def __init__(self, secret: bytes):
        self.directory = tempfile.mkdtemp(prefix="ctm-queue-", dir=_private_parent())
        try:
            os.chmod(self.directory, 0o700)  # whatever the umask did
            self.path = os.path.join(self.directory, "secret")
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, secret.hex().encode("ascii"))
            finally:
                os.close(fd)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _remove, self.directory, os.getpid())

    def env(self) -> dict[str, str]:
        """What a CTM needs in its environment to read the secret."""
        return {wire.SECRET_FILE_ENV: self.path}

    def export(self) -> None:
        """Point this process's environment (inherited by the CTMs the engine launches) at the file.
        A ``CTM_QUEUE_SECRET`` there would win over the file in the CTMs (``wire.load_secret``) and is
        a secret in every child's environment: it goes."""
        if os.environ.pop(wire.SECRET_ENV, None) is not None:
            logger.warning("EngineCacheQueue: removed %s from the environment: the CTMs read the queue's secret "
                           "from the private file named by %s", wire.SECRET_ENV, wire.SECRET_FILE_ENV)
        os.environ[wire.SECRET_FILE_ENV] = self.path

    def close(self) -> None:
        """Remove the file and its directory, and the environment's pointer to them."""
        if os.environ.get(wire.SECRET_FILE_ENV) == self.path:
            del os.environ[wire.SECRET_FILE_ENV]
        self._finalizer()
