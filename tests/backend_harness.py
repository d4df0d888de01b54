"""One harness per storage backend for the conformance suite: how to start a service on it, how
to make it fail for real, how to make one rank lose a block, how to damage an object.

* ``file``: a real FileStore directory;
* ``mooncake``: a real ``mooncake_master`` on loopback and the real store client;
* ``attention_store`` and ``ems``: the vendor SDKs' contract stand-ins under ``tests/standins``,
  put on the CTMs' path through ``PYTHONPATH`` only here.

A row a backend cannot honour is listed in ``cannot`` with the reason; the suite reports it as a
skip carrying that reason, never silently.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from engine_hooks import CacheSpec, CacheTransferService
from tests.service_helpers import start_service
from transfer_factory.keys import storage_key

STANDINS = str(Path(__file__).resolve().parent / "standins")
FP8 = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8, cache_dtype="block_wise_fp8",
                num_extra_layers=1, extra_block_ratio=1.5)
BF16 = CacheSpec(num_layers=2, num_blocks=16, kv_heads=2, block_size=4, head_dim=8, num_extra_layers=1,
                 extra_block_ratio=1.5)
KINDS = ("k", "v", "k_scale", "v_scale")


class Harness:
    name = "abstract"
    spec = FP8
    cannot: dict[str, str] = {}
    # While failing, a late call still holds the task's device blocks (two-phase completion):
    # true where the SDK moves device blocks itself and hangs in that move.
    late_call_holds_blocks = False

    def __init__(self, root: Path):
        self.root = root

    def options(self) -> dict[str, Any]:
        return {}

    def env(self) -> dict[str, str]:
        return {}

    def start(self, spec: CacheSpec | None = None, tp: int = 2, model_id: str = "conf/model-a") -> CacheTransferService:
        return start_service(spec or self.spec, tp=tp, storage_backend=self.name, storage_options=self.options(),
                             extra_env=self.env(), model_id=model_id)

    @contextmanager
    def failing(self) -> Iterator[None]:
        """While inside, every storage call of the backend fails or hangs past a task's timeout."""
        raise NotImplementedError

    def drop(self, svc: CacheTransferService, keys: list[str], tokens: list[int], block: int, rank: int) -> None:
        """Remove block ``block`` of the prefix from rank ``rank``'s share of the store."""
        raise NotImplementedError

    def damage(self, svc: CacheTransferService, keys: list[str], tokens: list[int], block: int, rank: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class FileHarness(Harness):
    name = "file"

    def options(self) -> dict[str, Any]:
        return {"root": str(self.root), "fsync": False}

    def _rank_store(self, svc: CacheTransferService, rank: int):
        from transfer_factory.file.store import FileStore

        return FileStore(namespace=str(svc.namespace()), rank=rank, options=self.options())

    @contextmanager
    def failing(self) -> Iterator[None]:
        """The store's directory replaced by a plain file: every open and create fails (ENOTDIR)."""
        aside = self.root.with_name(self.root.name + ".aside")
        self.root.rename(aside)
        self.root.write_bytes(b"not a directory")
        try:
            yield
        finally:
            self.root.unlink()
            aside.rename(self.root)

    def drop(self, svc, keys, tokens, block, rank) -> None:
        with self._rank_store(svc, rank) as store:
            store.delete([storage_key(svc.namespace(), keys[block], rank, k) for k in KINDS])

    def damage(self, svc, keys, tokens, block, rank) -> None:
        with self._rank_store(svc, rank) as store:
            where = store.object_location(storage_key(svc.namespace(), keys[block], rank, "v"))
        last_byte = where.offset + where.length - 1  # the record's last payload byte, in its segment file
        with open(where.path, "r+b") as f:  # one payload bit flipped under an intact header
            f.seek(last_byte)
            last = f.read(1)
            f.seek(last_byte)
            f.write(bytes([last[0] ^ 1]))


class MooncakeHarness(Harness):
    name = "mooncake"
    cannot = {}

    def __init__(self, root: Path):
        from scripts.local_mooncake_master import LocalMooncakeMaster

        super().__init__(root)
        self.master = LocalMooncakeMaster(log_dir=str(root)).start()

    def options(self) -> dict[str, Any]:
        return {**self.master.config(), "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
                "retry_interval": 0.2}

    @contextmanager
    def failing(self) -> Iterator[None]:
        """The master SIGSTOPped: every call hangs until its RPC timeout."""
        os.kill(self.master.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.master.pid, signal.SIGCONT)

    def _client(self, svc, rank):
        from transfer_factory.mooncake.store import MooncakeStore

        return MooncakeStore(namespace=str(svc.namespace()), rank=rank, options=self.options())

    def _replace(self, svc, key: str, rank: int, payload: bytes | None) -> None:
        import numpy as np

        store = self._client(svc, rank)
        try:
            deadline = time.monotonic() + 30
            while store.delete([key]) != [0] and time.monotonic() < deadline:
                time.sleep(0.2)  # a read lease may still be held
            assert store.exists([key]) == [0], f"could not remove {key}"
            if payload is not None:
                buf = np.frombuffer(payload, dtype=np.uint8).copy()
                store.register_buffer(buf.ctypes.data, buf.nbytes)
                assert store.batch_set([key], [buf.ctypes.data], [buf.nbytes]) == [0]
        finally:
            store.close()

    def drop(self, svc, keys, tokens, block, rank) -> None:
        self._replace(svc, storage_key(svc.namespace(), keys[block], rank, "v"), rank, None)

    def damage(self, svc, keys, tokens, block, rank) -> None:
        """A truncated object under the right key (Mooncake keeps no checksum we could break)."""
        self._replace(svc, storage_key(svc.namespace(), keys[block], rank, "v"), rank, b"\x01" * 7)

    def close(self) -> None:
        self.master.stop()


class StandinHarness(Harness):
    """Shared by the two vendor SDK stand-ins: data in a directory, faults in ``faults.json``."""

    dir_env = ""
    hang_calls: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (STANDINS, os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, self.dir_env: str(self.root)}

    def set_faults(self, faults: dict) -> None:
        tmp = self.root / "faults.json.tmp"
        tmp.write_text(json.dumps(faults))
        tmp.replace(self.root / "faults.json")

    late_call_holds_blocks = True

    @contextmanager
    def failing(self) -> Iterator[None]:
        """Every block move hangs 4 s, ignoring its own timeout (a hung SDK)."""
        self.set_faults({"sleep_s": {call: 4.0 for call in self.hang_calls}})
        try:
            yield
        finally:
            (self.root / "faults.json").unlink()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


NO_DAMAGE = ("the SDK documents no integrity check and the objects live inside the vendor's service; this "
             "backend has no object it could verify")


class EmsHarness(StandinHarness):
    name = "ems"
    spec = BF16
    dir_env = "EMS_STANDIN_DIR"
    hang_calls = ("save", "load")
    cannot = {
        "fp8": "ContextCaching V1 registers [K, V] per layer and nothing else: block_wise_fp8 scale caches have no "
               "place, so the CTM refuses them at start (checked in this row); the round trip runs on bf16 caches",
        "damage": NO_DAMAGE,
    }

    def _block_file(self, svc, keys, block, rank) -> Path:
        from transfer_factory.ems_store import block_hash_int

        h = block_hash_int(str(svc.namespace()), keys[block])
        return self.root / "data" / str(svc.namespace()) / f"tp{svc.tp}" / f"rank{rank}" / f"{h & (2**64 - 1):016x}"

    def drop(self, svc, keys, tokens, block, rank) -> None:
        path = self._block_file(svc, keys, block, rank)
        assert path.exists(), f"the stand-in holds no {path}"
        path.unlink()


class AttentionStoreHarness(StandinHarness):
    name = "attention_store"
    dir_env = "ATTENTIONSTORE_STANDIN_DIR"
    hang_calls = ("read", "write")
    cannot = {"damage": NO_DAMAGE}

    def drop(self, svc, keys, tokens, block, rank) -> None:
        sys.path.insert(0, STANDINS)  # only for this import: the other stand-ins (acl) stay off the path
        try:
            import attentionstore_sdk.sdk as sdk  # the stand-in, whose files this test removes
        finally:
            sys.path.remove(STANDINS)

        removed = sdk.remove_block_for_tests(str(self.root), rank, svc.tp, tokens, svc.spec.block_size, block)
        assert removed, "the stand-in held no such block"


HARNESSES = {h.name: h for h in (FileHarness, MooncakeHarness, AttentionStoreHarness, EmsHarness)}
