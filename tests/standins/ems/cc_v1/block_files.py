"""On-disk blocks of the EMS contract stand-in (tests only; not the Huawei SDK).

One file per hash, ``<dir>/<h & (2**64-1) as 16 hex digits>``, where ``<dir>`` is
``$EMS_STANDIN_DIR/data/<model_id>/tp<tp_world_size>/rank<rank_in_tp_group>`` (with
``pp<rank_in_pp_group>/`` before ``rank..`` when ``pp_world_size > 1``; a ``model_id`` that is
not one safe path component is percent-encoded).  A file is a 20-byte header (magic ``EMSSTD01``,
uint32 token count, uint64 payload length, little-endian) and the payload, written to a temp
file and ``os.replace``-d into place, so readers never see half a block.  A read asking for
another token count or size than stored is a miss.
"""
from __future__ import annotations

import itertools
import os
import struct
import threading
from pathlib import Path
from typing import Optional
from urllib.parse import quote

HEADER = struct.Struct("<8sIQ")
MAGIC = b"EMSSTD01"
HASH_MASK = (1 << 64) - 1
_temp_names = itertools.count()


def hash_name(h: int) -> str:
    """The file name of hash ``h``: its low 64 bits as 16 hex digits."""
    return f"{h & HASH_MASK:016x}"


def model_dir_name(model_id: str) -> str:
    """``model_id`` as one path component: itself when safe, else percent-encoded."""
    name = quote(model_id, safe="")
    return name.replace(".", "%2E") if name in (".", "..") else name


class BlockFiles:
    """The block files of one (model, TP layout, rank)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, h: int) -> Path:
        return self.directory / hash_name(h)

    def write(self, h: int, tokens: int, payload: bytes) -> bool:
        """Store (or overwrite) one block atomically; False when the filesystem refuses."""
        target = self.path(h)
        temp = self.directory / f".{target.name}.{os.getpid()}.{threading.get_ident()}.{next(_temp_names)}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(temp, "wb") as f:
                f.write(HEADER.pack(MAGIC, tokens, len(payload)))
                f.write(payload)
            os.replace(temp, target)
            return True
        except OSError:
            try:
                os.unlink(temp)
            except OSError:
                pass
            return False

    def read(self, h: int, tokens: int, size: int) -> Optional[bytes]:
        """The payload of ``h`` if stored with exactly ``tokens`` tokens and ``size`` bytes, else None."""
        try:
            with open(self.path(h), "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) < HEADER.size:
            return None
        magic, stored_tokens, length = HEADER.unpack_from(data)
        if magic != MAGIC or stored_tokens != tokens or length != size or len(data) != HEADER.size + size:
            return None
        return data[HEADER.size:]

    def exists(self, h: int) -> bool:
        return self.path(h).is_file()
