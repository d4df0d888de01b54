"""A storage plugin for fault tests: a real FileStore whose ``batch_set`` stalls before doing its work.

Loaded by the CTM processes (``CTM_STORAGE_PLUGINS=slowcommit=tests.slow_commit_store:SlowCommitStore``)
and steered through files in ``stall_dir`` (option), since the calls run in other processes:

* ``<stall_dir>/batch_set`` holding a number S: every ``batch_set`` sleeps S seconds first (the fault
  "a storage call stalls past the task's deadline", before the store's commit point);
* the call announces itself with ``batch_set.entered.<rank>`` and, once the real store returned,
  writes its per-key codes (JSON) to ``batch_set.done.<rank>``.

It is a FileStore subclass, so it honours the CTM's commit lease like the file backend does.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Mapping, Sequence

from transfer_factory.file.store import FileStore

logger = logging.getLogger(__name__)


class SlowCommitStore(FileStore):
    name = "slowcommit"

    def __init__(self, *, namespace: str, rank: int, options: Mapping[str, Any] | None = None) -> None:
        options = dict(options or {})
        self.stall_dir = options.pop("stall_dir")
        super().__init__(namespace, rank, options)

    def batch_set(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        try:
            with open(os.path.join(self.stall_dir, "batch_set")) as f:
                stall = float(f.read().strip() or 0)
        except FileNotFoundError:
            return super().batch_set(keys, ptrs, sizes)
        open(os.path.join(self.stall_dir, f"batch_set.entered.{self.rank}"), "w").close()
        logger.warning("slowcommit: batch_set of %d keys stalls %.1fs", len(keys), stall)
        time.sleep(stall)
        out = super().batch_set(keys, ptrs, sizes)
        with open(os.path.join(self.stall_dir, f"batch_set.done.{self.rank}"), "w") as f:
            json.dump(out, f)
        return out
