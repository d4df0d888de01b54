"""The FastDeploy façade's queue secret: HKDF-SHA256 of the authkey under a random salt per queue,
handed to the CTMs in a private file whose path (never the secret) is in the engine's environment."""
from __future__ import annotations

import hmac
import os
import stat

import pytest

from cache_manager.queue import wire
from engine_hooks.fastdeploy.queue import DEFAULT_AUTHKEY, EngineCacheQueue, queue_secret
from engine_hooks.fastdeploy.secret import SECRET_LABEL, derive_secret

AUTHKEY = b"an engine's own authkey"


@pytest.fixture
def clean_env(monkeypatch):
    """The secret variables as they were, whatever a test does."""
    for name in (wire.SECRET_ENV, wire.SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    yield


def _secret_values_in_environ(secret: bytes) -> list[str]:
    return [k for k, v in os.environ.items() if secret.hex() in v.lower() or secret.hex().upper() in v]


def test_the_derivation_is_hkdf_sha256_with_a_salt_and_a_label():
    salt = bytes(range(16))
    prk = hmac.digest(salt, AUTHKEY, "sha256")
    assert derive_secret(AUTHKEY, salt) == hmac.digest(prk, SECRET_LABEL + b"\x01", "sha256")
    assert queue_secret(AUTHKEY, salt) == (derive_secret(AUTHKEY, salt), True)
    assert queue_secret(AUTHKEY)[0] != queue_secret(AUTHKEY)[0]  # a fresh salt each time
    assert derive_secret(AUTHKEY, salt, b"another label") != derive_secret(AUTHKEY, salt)
    with pytest.raises(ValueError, match="salt"):
        derive_secret(AUTHKEY, b"short")
    secret, derived = queue_secret(DEFAULT_AUTHKEY)
    assert not derived and len(secret) == 32


def test_the_secret_is_in_a_private_file_and_never_in_the_environment(clean_env):
    os.environ[wire.SECRET_ENV] = "00" * 32  # a stale one would win over the file in the CTMs: it goes
    queue = EngineCacheQueue(address=("127.0.0.1", 0), authkey=AUTHKEY, is_server=True, num_client=1)
    try:
        secret = queue._core.secret
        assert wire.SECRET_ENV not in os.environ and _secret_values_in_environ(secret) == []
        path = os.environ[wire.SECRET_FILE_ENV]
        assert queue.secret_env() == {wire.SECRET_FILE_ENV: path}
        directory = os.path.dirname(path)
        for where, mode in ((directory, 0o700), (path, 0o600)):
            st = os.lstat(where)
            assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == mode, (where, oct(st.st_mode))
        assert stat.S_ISREG(os.lstat(path).st_mode) and os.listdir(directory) == ["secret"]
        assert wire.load_secret() == secret  # what a CTM launched now reads
    finally:
        queue.close()
    assert not os.path.exists(path) and not os.path.exists(directory)
    assert wire.SECRET_FILE_ENV not in os.environ
    queue.close()  # idempotent


def test_two_facades_with_the_same_authkey_have_different_secrets(clean_env):
    a = EngineCacheQueue(address=("127.0.0.1", 0), authkey=AUTHKEY, is_server=True, num_client=1)
    try:
        b = EngineCacheQueue(address=("127.0.0.1", 0), authkey=AUTHKEY, is_server=True, num_client=1)
        try:
            assert a._core.secret != b._core.secret
            files = [q.secret_env()[wire.SECRET_FILE_ENV] for q in (a, b)]
            assert files[0] != files[1] and [open(f).read() for f in files] == [a._core.secret.hex(),
                                                                               b._core.secret.hex()]
        finally:
            b.close()
        assert not os.path.exists(files[1]) and os.path.exists(files[0])
    finally:
        a.close()
    assert not os.path.exists(files[0])


def test_a_forked_child_never_removes_the_engines_file(clean_env):
    queue = EngineCacheQueue(address=("127.0.0.1", 0), authkey=AUTHKEY, is_server=True, num_client=1)
    try:
        path = queue.secret_env()[wire.SECRET_FILE_ENV]
        pid = os.fork()
        if pid == 0:  # runs the finalizer as a child exiting normally would
            queue._core.secret_file._finalizer()
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.exists(path)
    finally:
        queue.close()
    assert not os.path.exists(path)
