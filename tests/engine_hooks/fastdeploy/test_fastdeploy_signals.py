"""FastDeploy's IPC signal names and create/attach semantics (``engine_hooks.fastdeploy.signals``):
its PrefixCacheManager and our CTMs attach ``<name>.<port>``; a restart on the same port replaces what
a killed engine left; another user's segment under the name is never removed or used."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest

from cache_manager.ipc_signal import IPCSignal as CtmSignal
from cache_manager.ipc_signal import unlink_if_same
from engine_hooks.fastdeploy.signals import PREFIX_CACHE_ATTACHES, PREFIX_CACHE_CREATES, IPCSignal
from engine_hooks.core.launcher import REPO_ROOT, free_port
from ops.shm import SHM_DIR

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")
NAMES = PREFIX_CACHE_ATTACHES + PREFIX_CACHE_CREATES

# An engine that creates FastDeploy's signals on a port, marks them, says so and waits to be killed.
ENGINE = textwrap.dedent("""
    import sys, time, numpy as np
    from engine_hooks.fastdeploy.signals import IPCSignal
    port, names = int(sys.argv[1]), sys.argv[2:]
    signals = [IPCSignal(n, np.full(2, 7, np.int32), np.int32, suffix=port, create=True) for n in names]
    print("created", flush=True)
    time.sleep(60)
""")


def attach_like_fastdeploy(name: str) -> SharedMemory:
    """What FastDeploy's IPCSignal(create=False) does: ``SharedMemory(name=...)`` by the exact name."""
    shm = SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # it would unlink the engine's segment at our exit
    return shm


def test_fastdeploy_and_our_ctm_attach_the_signals_by_fastdeploys_exact_names():
    port = free_port()
    created = {n: IPCSignal(n, np.zeros(2, np.int32), np.int32, suffix=port, create=True) for n in NAMES}
    try:
        for name, sig in created.items():
            assert sig.name == f"{name}.{port}" and os.path.exists(os.path.join(SHM_DIR, f"{name}.{port}"))
            assert os.stat(os.path.join(SHM_DIR, sig.name)).st_mode & 0o777 == 0o600
            sig.value[:] = [3, 4]
            shm = attach_like_fastdeploy(f"{name}.{port}")
            try:
                assert list(np.ndarray((2,), np.int32, buffer=shm.buf)) == [3, 4]
            finally:
                shm.close()
        # our CTM, launched without an engine token, takes FastDeploy's name before its own
        ctm = CtmSignal("cache_ready_signal", np.zeros(2, np.int32), suffix=str(port))
        assert ctm.segment_name == f"cache_ready_signal.{port}" and list(ctm.value) == [3, 4]
        ctm.clear()  # an attached process only detaches
        attached = IPCSignal("prefix_tree_status", np.zeros(2, np.int32), np.int32, suffix=port, create=False)
        assert list(attached.value) == [3, 4]
        attached.clear()
        assert all(os.path.exists(os.path.join(SHM_DIR, s.name)) for s in created.values())
        with pytest.raises(ValueError, match="holds 8 bytes; 16 are needed"):
            IPCSignal("cache_task_inflight", np.zeros(4, np.int32), np.int32, suffix=port, create=False)
    finally:
        for sig in created.values():
            sig.clear()
    assert not any(n.endswith(f".{port}") for n in os.listdir(SHM_DIR))


def test_a_stale_segment_from_a_killed_engine_is_replaced_on_restart(caplog):
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(port), *NAMES], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT}, cwd=REPO_ROOT)
    try:
        assert engine.stdout.readline().strip() == "created"
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
    left = sorted(n for n in os.listdir(SHM_DIR) if n.endswith(f".{port}"))
    assert left == sorted(f"{n}.{port}" for n in NAMES), "the killed engine's segments should be there to replace"
    restarted = {}
    try:
        with caplog.at_level(logging.WARNING, logger="engine_hooks.fastdeploy.signals"):
            for name in NAMES:  # a leftover of ours is replaced, as FastDeploy's own create does
                restarted[name] = IPCSignal(name, np.zeros(2, np.int32), np.int32, suffix=port, create=True)
        assert all(list(s.value) == [0, 0] for s in restarted.values()), "the dead engine's values survived"
        replaced = [r.getMessage() for r in caplog.records if "already exists" in r.getMessage()]
        assert len(replaced) == len(NAMES)
    finally:
        for sig in restarted.values():
            sig.clear()
    assert not any(n.endswith(f".{port}") for n in os.listdir(SHM_DIR))


@needs_root
def test_another_users_segment_under_the_name_is_refused_and_left_alone():
    port = free_port()
    name = f"cache_ready_signal.{port}"
    path = os.path.join(SHM_DIR, name)
    pid = os.fork()
    if pid == 0:  # another local user creates the name first (only syscalls, then _exit)
        code = 0
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
            os.write(fd, b"theirs\0\0")
            os.close(fd)
        except BaseException:
            code = 1
        os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    try:
        with pytest.raises(PermissionError, match=rf"{path} belongs to uid {NOBODY}.*never removed or used"):
            IPCSignal("cache_ready_signal", np.zeros(2, np.int32), np.int32, suffix=port, create=True)
        with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
            IPCSignal("cache_ready_signal", np.zeros(2, np.int32), np.int32, suffix=port, create=False)
        with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):  # nor does a CTM attach it
            CtmSignal("cache_ready_signal", np.zeros(2, np.int32), suffix=str(port))
        assert os.lstat(path).st_uid == NOBODY and open(path, "rb").read() == b"theirs\0\0"
    finally:
        os.unlink(path)


def test_a_dead_engines_ctm_removes_only_the_segment_it_knew_not_a_restarted_engines():
    port = free_port()
    old = IPCSignal("cache_ready_signal", np.zeros(2, np.int32), np.int32, suffix=port, create=True)
    seen_by_ctm = CtmSignal("cache_ready_signal", np.zeros(2, np.int32), suffix=str(port))  # the old engine's
    old.close()  # the old engine dies without unlinking; a new one on the port replaces the name
    new = IPCSignal("cache_ready_signal", np.full(2, 5, np.int32), np.int32, suffix=port, create=True)
    try:
        assert not unlink_if_same(seen_by_ctm.segment_name, seen_by_ctm.identity)  # the old CTM's clean-up
        assert list(new.value) == [5, 5] and os.path.exists(os.path.join(SHM_DIR, new.name))
        assert unlink_if_same(new.name, new.identity)
    finally:
        seen_by_ctm.close()
        new.close()
    assert not os.path.exists(os.path.join(SHM_DIR, new.name))
