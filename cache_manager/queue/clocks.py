"""Whether a rank reads the engine's monotonic clock, decided once per session at the handshake.

A task carries its time budget (``budget_s``) and the engine's ``time.monotonic()`` when it was
stamped (``sent_at``), DESIGN §3.8.  A rank on another host, or in a container with its own time
namespace, has a CLOCK_MONOTONIC unrelated to the engine's (other uptime, or an offset), so it
counts the budget from when the task arrives.  A rank that reads the same clock counts it from
``sent_at``: a rank stopped (SIGSTOP, swapped out) with tasks queued in its socket still drops
them at the engine's deadline when it runs again, instead of starting a swap the engine has
already given up on.

The welcome carries the engine's boot id and its clock.  The clocks are one when the boot ids
match (one kernel) and the rank's clock, read as the welcome arrives, is at or just past the
engine's (a time namespace with an offset fails this; so does a welcome that took longer than
``SAME_CLOCK_SLACK_S`` to arrive, which only costs the stricter bound).
"""
from __future__ import annotations

import time
from typing import Any

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# How late a welcome may arrive and still prove the clocks are one.  It bounds the offset of a time
# namespace that passes for the engine's clock, so it is small: a welcome arrives within milliseconds,
# and a later one only means the rank counts budgets from arrival.  (It was 30 s: a container 20 s
# behind would have started tasks 20 s past the engine's deadline.)
SAME_CLOCK_SLACK_S = 2.0


def boot_id() -> str:
    """This kernel's boot id ("" where the kernel does not say: the clocks are then never shared)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def engine_clock() -> dict[str, Any]:
    """What the engine's welcome says about its clock."""
    return {"boot_id": boot_id(), "monotonic": time.monotonic()}


def shares_engine_clock(stamp: Any, now: float | None = None) -> bool:
    """Whether the engine that sent ``stamp`` (a welcome's ``clock``) reads this process's
    CLOCK_MONOTONIC.  Anything malformed or missing means no."""
    if not isinstance(stamp, dict):
        return False
    engine_boot, engine_now = stamp.get("boot_id"), stamp.get("monotonic")
    if type(engine_boot) is not str or not engine_boot or type(engine_now) is not float:
        return False
    now = time.monotonic() if now is None else now
    return engine_boot == boot_id() and 0.0 <= now - engine_now <= SAME_CLOCK_SLACK_S
