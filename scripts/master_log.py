"""The log file a local ``mooncake_master`` appends its output to (see ``local_mooncake_master.py``).

``<log_dir>/mooncake_master.log``; ``log_dir`` defaults to ``$CTM_LOG_DIR``, else ``./log`` (where
the CTMs log), so nothing is written to the system's temp directory.  Each start appends a header
line; a file over 64 MiB is rotated to ``mooncake_master.log.1`` at the next start.  Several
masters with one ``log_dir`` share the file (their lines interleave), so a tail is read from
where this start's output begins.
"""
from __future__ import annotations

import os
import time
from typing import BinaryIO

LOG_NAME = "mooncake_master.log"
LOG_ROTATE_BYTES = 64 << 20


def default_log_dir() -> str:
    """``$CTM_LOG_DIR``, else ``./log``: the CTMs' default, as FastDeploy's ``log/``."""
    return os.path.abspath(os.environ.get("CTM_LOG_DIR") or "log")


class MasterLog:
    """One master's view of the shared log file: the file open for its current start, and its tail."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = os.path.abspath(log_dir) if log_dir else default_log_dir()
        self.path = os.path.join(self.log_dir, LOG_NAME)
        self._start = 0             # where this start's output begins in the shared log
        self._file: BinaryIO | None = None

    def open(self, command: list[str]) -> BinaryIO:
        """Open for a new start (rotating a big file first), headed by the ``command`` it runs."""
        self.close()
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            if os.path.getsize(self.path) > LOG_ROTATE_BYTES:
                os.replace(self.path, self.path + ".1")
        except OSError:
            pass
        self._file = open(self.path, "ab")
        self._start = self._file.tell()
        header = f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} owner pid {os.getpid()}: {' '.join(command)}\n"
        self._file.write(header.encode())
        self._file.flush()
        return self._file

    def tail(self, max_bytes: int = 4000) -> str:
        """The end of this start's output (other masters sharing the file may interleave)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                end = f.tell()
                f.seek(max(self._start if self._start <= end else 0, end - max_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
