"""IPC names carry a random token per engine instance, so another local user cannot predict (and
squat) them to stop the engine from starting (DESIGN §4); a CTM without the token keeps FastDeploy's
port-only names and says they are predictable."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from cache_manager.cache_data import (KV_CACHE_STATUS_SIGNAL, PER_RANK_SIGNALS, WORKER_HEALTHY_LIVE_SIGNAL,
                                      cache_name)
from cache_manager.ipc_signal import (IPC_TOKEN_ENV, IPCSignal, engine_ipc_suffix, ipc_suffix, new_ipc_token,
                                      signal_segment_name)
from cache_manager.layer_progress import LAYER_PROGRESS_SIGNAL
from engine_hooks import CacheTransferService
from engine_hooks.core.launcher import free_port
from ops.shm import SHM_DIR, SharedMemorySegment
from tests.service_helpers import SMALL, segments_of, start_service

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")


def squat_as_nobody(names: list[str]) -> None:
    """Create each of ``names`` in /dev/shm from a child that runs as uid 65534, as another local user
    would (O_EXCL, mode 0644, a few bytes of theirs)."""
    pid = os.fork()
    if pid == 0:  # the child: only syscalls, then _exit
        code = 0
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for name in names:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                os.write(fd, b"theirs")
                os.close(fd)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the squatter could not create its names"


def remove_as_root(names: list[str]) -> None:
    for name in names:
        path = os.path.join(SHM_DIR, name)
        if os.path.lexists(path):
            os.unlink(path)


def test_names_with_a_token_and_without():
    token = new_ipc_token()
    assert len(token) == 16 and int(token, 16) >= 0 and token != new_ipc_token()
    suffix = ipc_suffix(8700, token)
    assert suffix == f"8700.{token}"
    assert signal_segment_name("cache_ready_signal", suffix) == f"ctm.8700.{token}.cache_ready_signal"
    # ours without a token, port only; FastDeploy's own is "cache_ready_signal.8700" (fastdeploy_segment_name)
    assert signal_segment_name("cache_ready_signal", 8700) == "ctm.cache_ready_signal.8700"
    assert ipc_suffix(8700, None) == "8700"
    for bad in ("", "0123", "0123456789ABCDEF", "../../etc/passwd", "0123456789abcdef0"):
        with pytest.raises(ValueError, match="IPC token"):
            ipc_suffix(8700, bad)


def test_a_ctm_without_the_token_keeps_the_port_names_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="cache_manager.ipc_signal"):
        assert engine_ipc_suffix(8700, {}) == "8700"
    [record] = caplog.records
    assert "predictable" in record.getMessage() and IPC_TOKEN_ENV in record.getMessage()
    caplog.clear()
    token = new_ipc_token()
    with caplog.at_level(logging.WARNING, logger="cache_manager.ipc_signal"):
        assert engine_ipc_suffix(8700, {IPC_TOKEN_ENV: token}) == f"8700.{token}"
    assert caplog.records == []
    with pytest.raises(ValueError, match="IPC token"):
        engine_ipc_suffix(8700, {IPC_TOKEN_ENV: "not-hex"})


def test_two_engines_draw_different_tokens():
    a = CacheTransferService(SMALL, tp=1, engine_worker_queue_port=free_port())
    b = CacheTransferService(SMALL, tp=1, engine_worker_queue_port=a.port)  # even on the same port
    assert a.ipc_token != b.ipc_token and a.instance != b.instance
    assert a.instance == f"{a.port}.{a.ipc_token}" and a.platform.segment_prefix == f"ctm.{a.instance}."


@needs_root
def test_a_name_that_exists_is_refused_naming_its_owner():
    suffix = ipc_suffix(free_port(), new_ipc_token())
    name, signal = f"ctm.test.exists{os.getpid()}", signal_segment_name("exists", suffix)
    squat_as_nobody([name, signal])
    try:
        with pytest.raises(FileExistsError, match=rf"'{name}' already exists, owned by uid {NOBODY}"):
            SharedMemorySegment(name, 64, create=True)
        with pytest.raises(FileExistsError, match=rf"'{signal}' already exists, owned by uid {NOBODY}"):
            IPCSignal("exists", np.zeros(1, np.int32), suffix=suffix, create=True)
        assert all(os.lstat(os.path.join(SHM_DIR, n)).st_uid == NOBODY for n in (name, signal))
    finally:
        remove_as_root([name, signal])


@needs_root
def test_squatting_the_predictable_names_does_not_stop_the_engine(tmp_path):
    port = free_port()
    # every name an engine on this port had before tokens: its signals, the layer board, the cache
    # handles and the first data segment of this process
    old = [signal_segment_name(n, port) for n in PER_RANK_SIGNALS + (WORKER_HEALTHY_LIVE_SIGNAL,
                                                                     KV_CACHE_STATUS_SIGNAL, LAYER_PROGRESS_SIGNAL)]
    old += [f"ctm.{port}.{cache_name(kind, layer, 0, 0)}" for kind in ("key_caches", "value_caches")
            for layer in range(SMALL.num_layers)]
    old += [f"ctm.{port}.dev{os.getpid()}-0"]
    squat_as_nobody(old)
    try:
        svc = start_service(tp=1, engine_worker_queue_port=port, log_dir=str(tmp_path))
        try:
            ours = [n for n in segments_of(port) if n not in old]
            assert ours and all(n.startswith(f"ctm.{port}.{svc.ipc_token}.") for n in ours), ours
            assert svc.swap_to_cpu([1, 2], [0, 1]).result(20)  # the CTM attached the token's names
        finally:
            svc.shutdown()
        assert segments_of(port) == sorted(old), "ours must go, the squatter's must stay"
        for name in old:
            path = os.path.join(SHM_DIR, name)
            assert os.lstat(path).st_uid == NOBODY and open(path, "rb").read() == b"theirs"
        log = (tmp_path / "cache_transfer_manager_rank0.log").read_text()
        assert "predictable" not in log  # the CTM got the token
    finally:
        remove_as_root(old)
