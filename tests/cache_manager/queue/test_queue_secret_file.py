"""The queue's secret file: read only when it is a regular file of the current user's, private to it."""
from __future__ import annotations

import os
import re
import stat

import pytest

from cache_manager.queue import wire


# -- the secret file ------------------------------------------------------------------------
def write_secret(path, mode: int = 0o600, uid: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, (b"k" * 32).hex().encode() + b"\n")
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, -1)
    finally:
        os.close(fd)


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    return lambda path: monkeypatch.setenv(wire.SECRET_FILE_ENV, str(path))


def test_secret_file_good_case(tmp_path, secret_env):
    path = tmp_path / "secret"
    write_secret(path)
    secret_env(path)
    assert wire.load_secret() == b"k" * 32


def test_secret_file_readable_by_others_is_refused(tmp_path, secret_env):
    path = tmp_path / "secret"
    write_secret(path, 0o644)
    secret_env(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*mode 644.*owner only"):
        wire.load_secret()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@needs_root
def test_secret_file_of_another_user_is_refused(tmp_path, secret_env):
    path = tmp_path / "secret"
    write_secret(path, uid=65534)
    secret_env(path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: owned by uid 65534, not by the current user")):
        wire.load_secret()


@needs_root
def test_secret_symlink_to_another_users_file_is_refused(tmp_path, secret_env):
    target, link = tmp_path / "theirs", tmp_path / "secret"
    write_secret(target, uid=65534)
    link.symlink_to(target)
    secret_env(link)
    with pytest.raises(ValueError, match=re.escape(f"{link}: owned by uid 65534")):
        wire.load_secret()


def test_secret_path_that_is_not_a_regular_file_is_refused(tmp_path, secret_env):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    secret_env(fifo)
    with pytest.raises(ValueError, match=re.escape(f"{fifo}: not a regular file")):
        wire.load_secret()  # and it returns: opening a FIFO must not block
    secret_env(tmp_path / "missing")
    with pytest.raises(ValueError, match="missing: cannot open it"):
        wire.load_secret()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
