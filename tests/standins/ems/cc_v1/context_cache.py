"""``ContextCache_v1`` of the EMS contract stand-in (tests only; not the Huawei SDK).

Obtained from ``Ems.get_cc()`` after ``Ems.init``.  Hash semantics, as documented:

* ``register_kvcache(kvcache)`` once (again: ``EMS_INVALID_ARGUMENT``); see ``kv_memory``;
* ``save``/``load(slot_mapping, hashes, offsets, option)``: block ``i`` is ``hashes[i]`` and covers
  ``slot_mapping[sum(offsets[:i]):sum(offsets[:i + 1])]``.  ``save`` stores block after block and
  stops at the first it cannot store; ``load`` stops at the first hash missing (or stored with
  another token count or size) and writes nothing after it.  Both return ``CcResult(success,
  total)``, ``success`` the leading consecutive blocks done; a partial save does not raise;
* ``exists(hashes, option)``: ``success`` the leading consecutive hashes stored;
* ``async_save``/``async_load``: same arguments, checked at call time; the work (fault knobs
  included) runs on a daemon thread; ``is_ready(future)``, ``get_result(future)`` (blocks,
  re-raises the operation's exception).

Before ``register_kvcache`` every transfer and ``exists`` raise ``EMS_NOT_REGISTERED``; after
``Ems._reset()`` an old object raises ``EMS_NOT_INITIALIZED``.  Argument checks: ``validate``;
fault knobs and ``calls.log``: ``ems.faults``; files: ``block_files``.
"""
from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import EmsErrorCode, EmsException, invalid
from ..faults import FaultInjector, FaultPlan
from ..options import CcResult
from .block_files import BlockFiles, model_dir_name
from .cc_config import CcConfig_v1
from .kv_memory import RegisteredCaches
from .validate import check_hashes, check_option, check_transfer

Blocks = list[tuple[int, list[int]]]


class CcFuture:
    """The opaque handle of an async save/load."""

    __slots__ = ("what", "_done", "_result", "_error")

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._result: Optional[CcResult] = None
        self._error: Optional[BaseException] = None

    def _run(self, work: Callable[[], CcResult]) -> None:
        try:
            self._result = work()
        except BaseException as exc:  # handed to get_result
            self._error = exc
        finally:
            self._done.set()

    def __repr__(self) -> str:
        return f"<CcFuture {self.what} {'done' if self._done.is_set() else 'running'}>"


def data_dir(root: Path, config: CcConfig_v1) -> Path:
    """Where the blocks of ``config``'s rank live under ``EMS_STANDIN_DIR``."""
    d = root / "data" / model_dir_name(config.model_id) / f"tp{config.tp_world_size}"
    if config.pp_world_size > 1:
        d = d / f"pp{config.rank_in_pp_group}"
    return d / f"rank{config.rank_in_tp_group}"


class ContextCache_v1:  # noqa: N801 -- the SDK's spelling
    """One rank's ContextCaching V1 handle (made by ``Ems.init``, never by callers)."""

    def __init__(self, config: CcConfig_v1, root: Path, faults: FaultInjector) -> None:
        self._config = copy.copy(config)  # later changes to the caller's object do not count
        self._files = BlockFiles(data_dir(root, self._config))
        self._faults = faults
        self._caches: Optional[RegisteredCaches] = None
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def register_kvcache(self, kvcache: Any) -> None:
        """Register ``[[K, V] per layer]`` (MHA) or ``[[K] per layer]`` (MLA), once."""
        with self._lock:
            self._check_open()
            if self._caches is not None:
                raise invalid("register_kvcache: the KV caches are already registered")
            self._caches = RegisteredCaches(kvcache, self._config.kvcache_type)

    # ------------------------------------------------------------------ calls
    def save(self, slot_mapping: Any, hashes: Any, offsets: Any, option: Any) -> CcResult:
        plan, blocks = self._begin("save", "save", slot_mapping, hashes, offsets, option)
        plan.apply(option.timeout)
        return self._save(blocks, plan.save_first_k)

    def load(self, slot_mapping: Any, hashes: Any, offsets: Any, option: Any) -> CcResult:
        plan, blocks = self._begin("load", "load", slot_mapping, hashes, offsets, option)
        plan.apply(option.timeout)
        return self._load(blocks)

    def exists(self, hashes: Any, option: Any) -> CcResult:
        plan = self._faults.begin("exists", "exists")
        self._registered()
        checked = check_hashes(hashes)
        check_option(option)
        plan.apply(option.timeout)
        done = 0
        for h in checked:
            if not self._files.exists(h):
                break
            done += 1
        return CcResult(done, len(checked))

    def async_save(self, slot_mapping: Any, hashes: Any, offsets: Any, option: Any) -> CcFuture:
        plan, blocks = self._begin("save", "async_save", slot_mapping, hashes, offsets, option)
        return self._spawn("async_save", plan, option.timeout, lambda: self._save(blocks, plan.save_first_k))

    def async_load(self, slot_mapping: Any, hashes: Any, offsets: Any, option: Any) -> CcFuture:
        plan, blocks = self._begin("load", "async_load", slot_mapping, hashes, offsets, option)
        return self._spawn("async_load", plan, option.timeout, lambda: self._load(blocks))

    def is_ready(self, future: Any) -> bool:
        return self._future(future)._done.is_set()

    def get_result(self, future: Any) -> CcResult:
        """Wait for an async call; its result, or its exception raised here."""
        fut = self._future(future)
        fut._done.wait()
        if fut._error is not None:
            raise fut._error
        assert fut._result is not None
        return fut._result

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED, "EMS was reset; call Ems.init and Ems.get_cc again")

    def _registered(self) -> RegisteredCaches:
        self._check_open()
        caches = self._caches
        if caches is None:
            raise EmsException(EmsErrorCode.EMS_NOT_REGISTERED, "register_kvcache was not called")
        return caches

    def _begin(self, method: str, called_as: str, slot_mapping: Any, hashes: Any, offsets: Any,
               option: Any) -> tuple[FaultPlan, Blocks]:
        plan = self._faults.begin(method, called_as)
        caches = self._registered()
        blocks = check_transfer(slot_mapping, hashes, offsets, option, caches.block_size, caches.num_slots)
        return plan, blocks

    @staticmethod
    def _future(future: Any) -> CcFuture:
        if not isinstance(future, CcFuture):
            raise invalid(f"future must come from async_save/async_load, got {type(future).__name__}")
        return future

    @staticmethod
    def _spawn(what: str, plan: FaultPlan, timeout_ms: int, work: Callable[[], CcResult]) -> CcFuture:
        fut = CcFuture(what)

        def run() -> CcResult:
            plan.apply(timeout_ms)
            return work()

        threading.Thread(target=fut._run, args=(run,), name=f"ems-standin-{what}", daemon=True).start()
        return fut

    def _save(self, blocks: Blocks, first_k: Optional[int]) -> CcResult:
        caches = self._registered()
        limit = len(blocks) if first_k is None else min(first_k, len(blocks))
        done = 0
        for h, slots in blocks[:limit]:
            if not self._files.write(h, len(slots), caches.gather(slots)):
                break
            done += 1
        return CcResult(done, len(blocks))

    def _load(self, blocks: Blocks) -> CcResult:
        caches = self._registered()
        done = 0
        for h, slots in blocks:
            payload = self._files.read(h, len(slots), len(slots) * caches.token_bytes)
            if payload is None:
                break
            caches.scatter(slots, payload)
            done += 1
        return CcResult(done, len(blocks))

    def _close(self) -> None:
        """Orphan this handle (``Ems._reset``): later calls raise ``EMS_NOT_INITIALIZED``."""
        self._closed = True
