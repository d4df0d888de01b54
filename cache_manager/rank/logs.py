"""A CTM rank's log: ``<log_dir>/cache_transfer_manager_rank<r>.log``, private (DESIGN §4: logs are 0600
in a 0700 directory), which the library modules log through too."""
from __future__ import annotations

import logging
import os
import sys

from ops.procs import open_private, private_dir


class PrivateFileHandler(logging.FileHandler):
    """A log file created 0600 whatever the umask, never through a symlink (``ops.procs.open_private``)."""

    def _open(self):  # FileHandler's hook for opening its file
        return os.fdopen(open_private(self.baseFilename), "a", encoding=self.encoding, errors=self.errors)


def rank_logger(rank: int, log_dir: str) -> logging.Logger:
    """The rank's logger: ``<log_dir>/cache_transfer_manager_rank<r>.log`` (0600; ``log_dir`` 0700 and
    ours, else ``PermissionError``), warnings also to stderr."""
    log = logging.getLogger(f"ctm.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s rank" + str(rank) + " %(threadName)s: %(message)s")
    handler = PrivateFileHandler(os.path.join(private_dir(log_dir), f"cache_transfer_manager_rank{rank}.log"))
    handler.setFormatter(fmt)
    log.addHandler(handler)
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    err.setFormatter(fmt)
    log.addHandler(err)
    for name in ("cache_manager", "ops", "transfer_factory"):  # library modules log through the rank's handlers
        lib = logging.getLogger(name)
        lib.setLevel(logging.INFO)
        lib.handlers = log.handlers
    return log
