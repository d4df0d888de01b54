"""Process helpers shared by the layers above (liveness of an engine, of a file's writer)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True
