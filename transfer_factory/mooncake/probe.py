"""Is the Mooncake master there?  Two probes of its address, each bounded by a timeout.

``master_answers``: its kernel accepts a TCP connection (refused at once on a live host with no
master).  ``master_alive``: its process serves too, which a SIGSTOPped master's kernel cannot
fake: it still accepts connections but leaves them unanswered.
"""
from __future__ import annotations

import socket

from transfer_factory.mooncake.config import MooncakeConfig

# Not a coro_rpc header (bad magic): a master whose I/O threads run closes the connection at once;
# a stopped or hung one leaves it unanswered while its kernel still accepts connections.
_LIVENESS_PROBE = b"\0" * 64


def master_answers(config: MooncakeConfig, timeout: float) -> tuple[bool, str]:
    """Whether the master's address accepts a TCP connection within ``timeout`` (and why not)."""
    hp = config.master_host_port()
    if hp is None:
        return True, ""
    try:
        with socket.create_connection(hp, timeout=timeout):
            return True, ""
    except OSError as e:
        return False, str(e) or type(e).__name__


def master_alive(config: MooncakeConfig, timeout: float) -> tuple[bool, str]:
    """Whether the master's process serves, not only whether its kernel accepts connections (a
    SIGSTOPped master does).  Asked before what holds the GIL for as long as the master takes
    to answer (``setup``, ``close``), so a hung master never freezes every thread here."""
    hp = config.master_host_port()
    if hp is None:
        return True, ""
    try:
        conn = socket.create_connection(hp, timeout=timeout)
    except OSError as e:
        return False, str(e) or type(e).__name__
    with conn:
        try:
            conn.sendall(_LIVENESS_PROBE)
            conn.recv(1)            # EOF (or any answer): its I/O threads run
        except ConnectionResetError:
            pass                    # so does a reset
        except OSError as e:
            return False, f"connected but no answer within {timeout:g}s ({e or type(e).__name__})"
    return True, ""
