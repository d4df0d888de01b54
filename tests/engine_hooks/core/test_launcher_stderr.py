"""A restarted CTM keeps what its crashed predecessor wrote to stderr (native crash output, a
traceback): the rank's stderr file is appended to, each launch headed by a line saying when."""
from __future__ import annotations

from engine_hooks.core.launcher import launch


def test_a_relaunched_rank_appends_to_its_stderr_file(tmp_path):
    flags = {"key_cache_shape": "16,2,4,8", "cache_queue_port": 8600, "engine_worker_queue_port": 8700,
             "num_layers": "not-a-number"}  # exits with status 2, naming the flag on stderr
    first = launch(0, flags, str(tmp_path), {})
    assert first.popen.wait(30) == 2
    second = launch(0, {**flags, "num_layers": "still-not"}, str(tmp_path), {})
    assert second.popen.wait(30) == 2
    text = open(second.stderr_path).read()
    assert text.count("--- rank 0 launched at ") == 2, text
    assert "'not-a-number'" in text and "'still-not'" in text, text  # the first process's words survive
