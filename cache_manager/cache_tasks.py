"""Tasks the engine sends to every rank, and the results each rank sends back.

On the wire every task and result is a plain dict of ints, strings and lists
(msgpack), never a pickled object.  ``task_from_wire`` checks the shape of what
arrives; a malformed task becomes an error result, not a crash.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ops.layout import plain_int_list

from cache_manager.cache_data import CacheStatus
from cache_manager.layer_progress import LayerwiseRef

SWAP_EVENTS = (CacheStatus.SWAP2CPU, CacheStatus.SWAP2GPU)
_STATUS_OF = {int(s): s for s in CacheStatus}


# The longest time budget a task may carry (about 11.6 days): a larger one is a bug or a
# corrupted number, and would mean "never times out".
MAX_TASK_BUDGET_S = 1e6


class TaskFormatError(ValueError):
    """A task dict that does not have the fields its event type needs."""


@dataclass
class SwapTask:
    """Swap blocks between device and host: ``(event_type, task_id, swap_node_ids, gpu_block_ids, cpu_block_ids)``."""

    event_type: int
    task_id: str
    swap_node_ids: list[int]
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    layerwise: LayerwiseRef | None = None  # publish per-layer progress (DESIGN §3.8)
    state_slots: tuple[int, int] | None = None  # (device slot, host state slot) of the layout's state groups

    def result(self) -> tuple:
        return (self.event_type, self.task_id, self.swap_node_ids, self.gpu_block_ids, self.cpu_block_ids)


@dataclass
class ReadStorageTask:
    task_id: str
    keys: list[str]
    token_ids: list[int]
    gpu_block_ids: list[int]
    start_read_block_idx: int = 0
    timeout: float = 30.0
    event_type: int = int(CacheStatus.STORAGE2GPU)
    layerwise: LayerwiseRef | None = None
    state_slot: int | None = None  # the request's slot of the layout's state groups, loaded at the run's end


@dataclass
class WriteStorageTask:
    task_id: str
    keys: list[str]
    token_ids: list[int]
    gpu_block_ids: list[int]
    timeout: float = 30.0
    event_type: int = int(CacheStatus.GPU2STORAGE)
    layerwise: LayerwiseRef | None = None
    state_slot: int | None = None  # the request's slot of the layout's state groups, stored at the write's end


@dataclass
class ControlTask:
    """Engine-to-CTM control (e.g. ``ping``), answered by every rank."""

    task_id: str
    command: str
    args: dict = field(default_factory=dict)
    event_type: int = int(CacheStatus.CTRL)


@dataclass
class PullTask:
    """Read blocks of a linked prefill instance (``peer``) exposed under ``handle`` into this
    instance's device blocks or host swap slots (DESIGN §3.11)."""

    task_id: str
    peer: str
    handle: dict  # transfer_factory.peer.handles.TransferHandle's wire form, checked by the rank
    src_block_ids: list[int]
    dst_block_ids: list[int]
    placement: str = "device"  # or "host": the destination is the rank's swap space
    layers: tuple[int, int] | None = None  # [first, stop); None: every layer
    event_type: int = int(CacheStatus.PEER_PULL)
    state_slots: tuple[int, int] | None = None  # (the peer's slot, this rank's) of the state groups
    digests: bool = False  # check the received blocks against the digests the peer published


@dataclass
class PushTask:
    """Write this rank's ``src_block_ids`` into the ``dst_block_ids`` a linked decode instance
    (``peer``) reserved, layer by layer, publishing each layer on the peer's layer board at
    ``target`` ({slot, seq}); with ``layerwise.await_compute``, layer ``l`` waits until the engine
    says it is computed (DESIGN §3.11, LLM-DataDist's ``push_cache``)."""

    task_id: str
    peer: str
    target: LayerwiseRef  # the slot and seq the decode engine drew on its own board
    src_block_ids: list[int]
    dst_block_ids: list[int]
    layerwise: LayerwiseRef | None = None  # this engine's compute progress, for a layer-wise push
    event_type: int = int(CacheStatus.PEER_PUSH)
    state_slots: tuple[int, int] | None = None  # (this rank's slot, the peer's) of the state groups
    salt_tag: str = ""  # the pushing request's tenant salt tag: part of the reservation it must match


PLACEMENTS = ("device", "host")


Task = SwapTask | ReadStorageTask | WriteStorageTask | ControlTask | PullTask | PushTask


def _layerwise(d: dict) -> LayerwiseRef | None:
    value = d.get("layerwise")
    if value is None:
        return None
    try:
        return LayerwiseRef.from_wire(value)
    except ValueError as exc:
        raise TaskFormatError(str(exc)) from None


def _int_list(d: dict, key: str) -> list[int]:
    value = d.get(key)
    if plain_int_list(value):
        return value  # what msgpack decodes
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TaskFormatError(f"task field {key!r} must be a list of integers, got {value!r:.80}")
    return value


def _str(d: dict, key: str) -> str:
    value = d.get(key)
    if not isinstance(value, str):
        raise TaskFormatError(f"task field {key!r} must be a string, got {value!r:.80}")
    return value


def task_deadline(d: dict, shared_clock: bool, received: float) -> float | None:
    """The task's deadline on this host's ``time.monotonic()``, or None for a task sent without
    a budget.

    The engine sends the task's time budget (``budget_s``) and its own clock when it stamped the
    task (``sent_at``).  A rank on another host counts the budget from ``received``, when the task
    arrived: the two monotonic clocks are unrelated (DESIGN §3.8).  A rank that reads the engine's
    clock (``shared_clock``, settled at the handshake: ``queue.clocks``) counts it from
    ``sent_at``, the engine's own deadline, so a rank stopped with tasks queued drops them on
    waking rather than running what the engine gave up on.  An absolute ``deadline`` (what the
    engine sent before budgets) is refused, never silently ignored."""
    if "deadline" in d:
        raise TaskFormatError("task field 'deadline' (a time on the sender's clock) is not accepted: "
                              "a task carries its time budget in 'budget_s'")
    budget = d.get("budget_s")
    if budget is None:
        return None
    if not _seconds(budget) or not 0 <= budget <= MAX_TASK_BUDGET_S:
        raise TaskFormatError(f"task budget_s {budget!r:.80} must be a number of seconds in [0, {MAX_TASK_BUDGET_S:g}]")
    deadline = received + budget
    sent_at = d.get("sent_at")
    if shared_clock and sent_at is not None:
        if not _seconds(sent_at):
            raise TaskFormatError(f"task sent_at {sent_at!r:.80} must be a finite number of seconds")
        deadline = min(deadline, sent_at + budget)  # never later than counting from receipt
    return deadline


def _seconds(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def task_from_wire(d: Any) -> Task:
    """Rebuild a task from its wire dict; raises ``TaskFormatError`` naming the bad field."""
    if not isinstance(d, dict):
        raise TaskFormatError(f"a task must be a map, got {type(d).__name__}")
    event = d.get("event_type")
    if not isinstance(event, int) or isinstance(event, bool):
        raise TaskFormatError(f"event_type {event!r} must be an integer")
    status = _STATUS_OF.get(event)  # CacheStatus(event) costs an enum lookup in Python on every task
    if status is None:
        raise TaskFormatError(f"unknown event type {event}")
    task_id = _str(d, "task_id")
    if status in SWAP_EVENTS:
        return SwapTask(event, task_id, _int_list(d, "swap_node_ids"), _int_list(d, "gpu_block_ids"),
                        _int_list(d, "cpu_block_ids"), _layerwise(d), _state_slots(d))
    if status == CacheStatus.CTRL:
        args = d.get("args", {})
        if not isinstance(args, dict):
            raise TaskFormatError("control task field 'args' must be a map")
        return ControlTask(task_id, _str(d, "command"), args)
    if status == CacheStatus.PEER_PULL:
        return _pull_task(task_id, d)
    if status == CacheStatus.PEER_PUSH:
        src, dst = _int_list(d, "src_block_ids"), _int_list(d, "dst_block_ids")
        if len(src) != len(dst):
            raise TaskFormatError(f"push has {len(src)} source blocks but {len(dst)} destination blocks")
        try:
            target = LayerwiseRef.from_wire(d.get("target"))
        except ValueError as exc:
            raise TaskFormatError(f"push target: {exc}") from None
        tag = d.get("salt_tag", "")
        if not isinstance(tag, str) or len(tag) > 64:
            raise TaskFormatError(f"push salt_tag {tag!r:.80} must be a string of at most 64 characters")
        return PushTask(task_id, _str(d, "peer"), target, src, dst, _layerwise(d), state_slots=_state_slots(d),
                        salt_tag=tag)
    keys = d.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TaskFormatError("task field 'keys' must be a list of strings")
    timeout = d.get("timeout", 30.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < 1e9:
        raise TaskFormatError(f"task timeout {timeout!r} must be a positive number")
    if status == CacheStatus.STORAGE2GPU:
        start = d.get("start_read_block_idx", 0)
        if not isinstance(start, int) or start < 0:
            raise TaskFormatError(f"start_read_block_idx {start!r} must be a non-negative integer")
        return ReadStorageTask(task_id, keys, _int_list(d, "token_ids"), _int_list(d, "gpu_block_ids"), start,
                               float(timeout), layerwise=_layerwise(d), state_slot=_state_slot(d))
    if status == CacheStatus.GPU2STORAGE:
        return WriteStorageTask(task_id, keys, _int_list(d, "token_ids"), _int_list(d, "gpu_block_ids"),
                                float(timeout), layerwise=_layerwise(d), state_slot=_state_slot(d))
    raise TaskFormatError(f"event type {status.name} ({event}) is not a task the CTM runs")


def _pull_task(task_id: str, d: dict) -> PullTask:
    placement, layers, handle = d.get("placement", "device"), d.get("layers"), d.get("handle")
    if placement not in PLACEMENTS:
        raise TaskFormatError(f"pull placement {placement!r:.40} must be one of {PLACEMENTS}")
    if layers is not None:
        if not (isinstance(layers, list) and len(layers) == 2 and all(type(v) is int for v in layers)
                and 0 <= layers[0] < layers[1]):
            raise TaskFormatError(f"pull layers {layers!r:.80} must be [first, stop) with 0 <= first < stop")
        layers = (layers[0], layers[1])
    if not isinstance(handle, dict):
        raise TaskFormatError("pull task field 'handle' must be a map")
    src, dst = _int_list(d, "src_block_ids"), _int_list(d, "dst_block_ids")
    if len(src) != len(dst):
        raise TaskFormatError(f"pull has {len(src)} source blocks but {len(dst)} destination blocks")
    state = _state_slots(d)
    if state is not None and placement != "device":
        raise TaskFormatError("a pull into host swap slots cannot carry state slots (state lives on the device)")
    digests = d.get("digests", False)
    if type(digests) is not bool:
        raise TaskFormatError(f"pull field 'digests' {digests!r:.40} must be a bool")
    return PullTask(task_id, _str(d, "peer"), handle, src, dst, placement, layers, state_slots=state, digests=digests)


def _state_slot(d: dict) -> int | None:
    slot = d.get("state_slot")
    if slot is not None and (type(slot) is not int or slot < 0):
        raise TaskFormatError(f"task field 'state_slot' {slot!r:.40} must be a non-negative integer")
    return slot


def _state_slots(d: dict) -> tuple[int, int] | None:
    slots = d.get("state_slots")
    if slots is None:
        return None
    if not (isinstance(slots, list) and len(slots) == 2 and all(type(v) is int and v >= 0 for v in slots)):
        raise TaskFormatError(f"task field 'state_slots' {slots!r:.80} must be [source slot, destination slot]")
    return slots[0], slots[1]


@dataclass
class RankResult:
    """One rank's answer to one task.  ``error`` is set exactly when ``ok`` is false."""

    task_id: str
    rank: int
    ok: bool
    value: Any = None  # per kind: None for swaps, loaded/written block ids for storage, anything for CTRL
    error: str | None = None
    recv_seq: int = -1  # the order in which this rank received the task
    elapsed_ms: float = 0.0
    bytes_moved: int = 0  # bytes this rank actually copied or transferred for the task
    # False when an I/O of this task still touches its blocks after the answer left (an answer in
    # time, a release later); a later result of the same task with released=True is that release.
    released: bool = True
    storage_calls: int = 0  # backend calls this rank made for the task
    storage_failures: int = 0  # of those, calls that raised, timed out or never started
    digest_mismatches: int = 0  # P/D pull: blocks whose bytes differed from the source's digests (not counted)


_RESULT_DEFAULTS = {f.name: f.default for f in fields(RankResult) if f.default is not MISSING}


def result_body(result: RankResult) -> dict:
    """A result's wire body: every field that differs from its default, since the receiver
    (``queue_checks.rank_result_from_body``) fills the defaults back in and checks each field it
    gets.  Every rank answers every task, and the engine takes the answers one after another."""
    defaults = _RESULT_DEFAULTS
    body = {k: v for k, v in vars(result).items()
            if k not in defaults or type(v) is not type(defaults[k]) or v != defaults[k]}
    body["type"] = "result"
    return body


@dataclass
class Outcome:
    """What a rank's task body returns: its value, the bytes it moved, and the futures of I/O
    that outlived the deadline.  ``still_running``: an I/O that still touches the task's blocks;
    the rank answers now (``released=False``) and reports the release once it is done.
    ``still_storing``: a staged storage write that touches none of the task's blocks (it reads
    its own snapshot) but may still store objects; the answer releases the blocks at once, and
    the rank counts the task in flight (a drain or an RL clear waits) until the call returns.
    ``error``: the task failed, and says why, while ``still_running`` holds its blocks (a transfer
    cut mid-way: it fails in time, its blocks are released once no byte can land)."""

    value: Any = None
    bytes_moved: int = 0
    still_running: Any = None  # concurrent.futures.Future | None
    storage_calls: int = 0
    storage_failures: int = 0
    still_storing: Any = None  # concurrent.futures.Future | None
    error: str | None = None  # the task failed (why), though ``still_running`` may still touch its blocks
    digest_mismatches: int = 0  # P/D pull: blocks whose bytes differed from the source's digests (not counted)
