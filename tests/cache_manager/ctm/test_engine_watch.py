"""A CTM's watch on its engine: gone means the engine *process* is gone (a pidfd, not a pid number);
a heartbeat that stops is logged once and never makes the CTM leave a paused engine's caches."""
import logging
import subprocess
import sys
import time

import numpy as np
import pytest

from cache_manager.engine_watch import EXIT_TIMEOUT_ENV, EngineGone, EngineWatch


class Heartbeat:
    def __init__(self):
        self.value = np.zeros(1, np.int32)


def test_an_engine_that_exited_is_gone_and_named():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    watch = EngineWatch(child.pid, logging.getLogger("test"))
    assert watch.engine_exited()
    with pytest.raises(EngineGone, match=f"engine process {child.pid} is gone"):
        watch.check(Heartbeat())


def test_the_pidfd_keeps_naming_the_process_it_opened():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch = EngineWatch(child.pid, logging.getLogger("test"))
        assert not watch.engine_exited()  # opens the pidfd on the live process
        watch.check(Heartbeat())
    finally:
        child.kill()
        child.wait(timeout=30)
    assert watch.engine_exited()  # the pid may be reused from here on; the pidfd still says gone


def test_a_stalled_heartbeat_is_logged_once_and_its_return_too(monkeypatch, caplog):
    monkeypatch.setenv(EXIT_TIMEOUT_ENV, "0.05")
    log = logging.getLogger("test-engine-watch")
    watch = EngineWatch(None, log)  # the parent: this test process's, alive throughout
    beat = Heartbeat()
    with caplog.at_level(logging.WARNING, logger="test-engine-watch"):
        watch.check(beat)
        time.sleep(0.1)
        for _ in range(3):
            watch.check(beat)  # stalled: a paused engine is not a gone one
        stalled = [r for r in caplog.records if "has not changed" in r.getMessage()]
        assert len(stalled) == 1 and "keeping its caches" in stalled[0].getMessage()
        beat.value[0] = 7
        watch.check(beat)
        assert any("moves again" in r.getMessage() for r in caplog.records)
