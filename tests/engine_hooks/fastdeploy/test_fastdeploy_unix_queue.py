"""FastDeploy's Unix-socket queue address (``FD_ENGINE_TASK_QUEUE_WITH_SHM=1``, its default):
``EngineCacheQueue(address="/dev/shm/fd_task_queue_<port>.sock")`` serves the engine's own handles and
real CTMs launched as FastDeploy launches them, while the path in world-writable /dev/shm is a name
only: nothing is created there, and what another user plants there is never used."""
from __future__ import annotations

import logging
import os
import select
import socket

import numpy as np
import pytest

from cache_manager.cache_data import CacheStatus
from cache_manager.queue.unix_address import SHM_QUEUE_ENV, ctm_queue_endpoint, fastdeploy_queue_path
from cache_manager.queue.wire import SECRET_FILE_ENV
from engine_hooks.fastdeploy.queue import EngineCacheQueue
from engine_hooks.core.launcher import free_port
from tests.fastdeploy_engine import FastDeployEngine

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")

class Squatter:
    """Another local user (uid 65534, a forked child: only syscalls) listening at ``path`` and
    counting the connections it gets, until ``stop()`` returns that count."""

    def __init__(self, path: str):
        stop_r, self._stop_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.close(self._stop_w)  # else the test's close of its end would never reach stop_r
                os.close(self._out_r)
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind(path)
                s.listen(64)
                os.write(out_w, b"L")
                accepted = 0
                while True:
                    ready = select.select([s, stop_r], [], [], 60)[0]
                    if s in ready:
                        s.accept()[0].close()
                        accepted += 1
                    if stop_r in ready or not ready:
                        break
                os.write(out_w, str(accepted).encode())
            except BaseException:
                code = 1
            os._exit(code)
        os.close(stop_r)
        os.close(out_w)
        assert os.read(self._out_r, 1) == b"L", "the squatter could not listen"

    def stop(self) -> int:
        os.close(self._stop_w)
        data = os.read(self._out_r, 64)
        os.close(self._out_r)
        os.waitpid(self.pid, 0)
        return int(data)


def round_trip(engine: FastDeployEngine, queue: EngineCacheQueue, task: str) -> None:
    """A swap out and back in through ``queue`` (any handle), bit-exact on every rank, kind and layer."""
    engine.fill(seed=len(task))
    views = engine.views()
    before = {k: v.copy() for k, v in views.items()}
    queue.put_transfer_task((CacheStatus.SWAP2CPU, f"{task}-out", [1], [1, 2], [0, 1]))
    assert engine.signals_for(1) == [(CacheStatus.SWAP2CPU, f"{task}-out", [1], [1, 2], [0, 1])]
    for v in views.values():
        v[[1, 2]] = 0
    queue.put_transfer_task((CacheStatus.SWAP2GPU, f"{task}-in", [1], [5, 6], [0, 1]))
    assert engine.signals_for(1) == [(CacheStatus.SWAP2GPU, f"{task}-in", [1], [5, 6], [0, 1])]
    for key, v in views.items():
        assert np.array_equal(v[[5, 6]], before[key][[1, 2]]), f"rank/kind/layer {key} differs"


@pytest.fixture
def restore_env():
    saved = {k: os.environ.get(k) for k in (SECRET_FILE_ENV, SHM_QUEUE_ENV)}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_the_engine_and_shell_launched_ctms_share_fastdeploys_unix_socket_queue(restore_env):
    engine = FastDeployEngine(tp=2, unix_socket=True, fastdeploy_signals=True)
    try:
        requested = fastdeploy_queue_path(engine.cache_queue_port)
        assert engine.queue.address == requested
        served = engine.queue.server.ipc_path
        assert os.path.dirname(served) == os.path.dirname(os.environ[SECRET_FILE_ENV])  # beside the secret
        assert os.stat(os.path.dirname(served)).st_mode & 0o777 == 0o700
        os.environ[SHM_QUEUE_ENV] = "1"  # as FastDeploy's default: the CTMs must find the socket
        for rank in range(2):
            engine.launch_like_fastdeploy(rank)  # --cache_queue_port <port>, nothing else about the queue
        engine.wait_ready([0, 1], 60)
        assert engine.queue.server.local_ranks() == {0, 1}
        # FastDeploy's PrefixCacheManager: a handle on the same path, in the engine's process
        handle = EngineCacheQueue(address=requested, is_server=False, num_client=2, client_id=0)
        round_trip(engine, handle, "via-handle")
        round_trip(engine, engine.queue, "via-server")
        assert not os.path.lexists(requested), "something was created at the world-writable path"
        with pytest.raises(RuntimeError, match="has no port"):
            engine.queue.get_server_port()
        with pytest.raises(RuntimeError, match="already serves a queue there"):
            EngineCacheQueue(address=requested, is_server=True, num_client=2)
        handle.close()  # lets go only
        round_trip(engine, engine.queue, "after-handle-closed")
    finally:
        leftovers = engine.close()
    assert leftovers == [] and not os.path.exists(os.path.dirname(served))


@needs_root
def test_a_socket_another_user_planted_at_the_path_is_never_used(caplog, restore_env):
    port = free_port()
    path = fastdeploy_queue_path(port)
    squatter = Squatter(path)
    engine = None
    try:
        assert os.lstat(path).st_uid == NOBODY
        with caplog.at_level(logging.WARNING, logger="cache_manager.queue.unix_address"):
            engine = FastDeployEngine(tp=2, unix_socket=True, fastdeploy_signals=True, cache_queue_port=port)
        assert any(path in r.getMessage() and f"uid {NOBODY}" in r.getMessage() and "never" in r.getMessage()
                   for r in caplog.records)
        os.environ[SHM_QUEUE_ENV] = "1"
        for rank in range(2):
            engine.launch_like_fastdeploy(rank)
        engine.wait_ready([0, 1], 60)
        round_trip(engine, engine.queue, "squatted")
    finally:
        if engine is not None:
            engine.close()
        accepted = squatter.stop()
        if os.path.lexists(path):
            os.unlink(path)
    assert accepted == 0, f"the squatter's socket got {accepted} connection(s)"


def test_bad_addresses_are_refused_naming_them():
    for bad, match in ((("127.0.0.1", "x"), "must be \\(host, port\\) or a Unix-socket path"),
                       ("/dev/shm/my_queue.sock", "must end in fd_task_queue_<port>.sock"),
                       ("fd_task_queue_8000.sock", "must be an absolute path"),
                       ("/dev/shm/fd_task_queue_70000.sock", "fd_task_queue_<port>.sock")):
        with pytest.raises(ValueError, match=match):
            EngineCacheQueue(address=bad, is_server=True, num_client=1)
    with pytest.raises(RuntimeError, match="at /dev/shm/fd_task_queue_9.sock: no server"):
        EngineCacheQueue(address="/dev/shm/fd_task_queue_9.sock", is_server=False, num_client=1, client_id=0)


def test_a_ctm_maps_its_cache_queue_port_as_fastdeploy_does(tmp_path):
    private = tmp_path / "ctm-queue-x"
    private.mkdir(mode=0o700)
    env = {SECRET_FILE_ENV: str(private / "secret")}
    assert ctm_queue_endpoint("10.0.0.1", 8600, env) == "tcp://10.0.0.1:8600"  # no socket: TCP
    with pytest.raises(FileNotFoundError, match="fd_task_queue_8600.sock is not to be found"):
        ctm_queue_endpoint("10.0.0.1", 8600, {**env, SHM_QUEUE_ENV: "1"})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(private / "fd_task_queue_8600.sock"))
        assert ctm_queue_endpoint("10.0.0.1", 8600, env) == f"ipc://{private}/fd_task_queue_8600.sock"
        assert ctm_queue_endpoint("10.0.0.1", 8600, {**env, SHM_QUEUE_ENV: "0"}) == "tcp://10.0.0.1:8600"
        private.chmod(0o755)  # a directory others can reach into is not the queue's
        with pytest.raises(FileNotFoundError, match="mode 755"):
            ctm_queue_endpoint("10.0.0.1", 8600, {**env, SHM_QUEUE_ENV: "1"})
    finally:
        listener.close()
    with pytest.raises(ValueError, match="FD_ENGINE_TASK_QUEUE_WITH_SHM='yes' must be 0 or 1"):
        ctm_queue_endpoint("10.0.0.1", 8600, {SHM_QUEUE_ENV: "yes"})
