"""Links between the LLM-DataDist stand-in's clusters (tests only): ``link_clusters`` /
``unlink_clusters`` (one-sided, client to a listening server) and ``link`` / ``unlink`` /
``query_register_mem_status`` (a communication domain every member joins).

What it enforces, from the documents (LLMDataDist.md, LLMStatusCode.md, LLMClusterInfo.md):

* ``link_clusters(clusters, timeout=3000)``: a list or tuple of ``LLMClusterInfo`` (``TypeError``),
  1 to 16 of them (more: ``LLM_CLUSTER_NUM_EXCEED_LIMIT``), ``timeout`` a positive int of ms; each
  info names ``remote_cluster_id`` (not this cluster) and exactly one remote and one local ip info
  (``llm.LocalCommRes`` is not modelled, so the local one is required): ``ValueError``.  It returns
  ``(ret, rets)``; per cluster ``LLM_SUCCESS``, ``LLM_ALREADY_LINK``, or ``LLM_LINK_FAILED`` when no
  live cluster of that id listens at that address (at once, as a refused connection), when the
  ``link_down`` knob names it (at once) or the ``unreachable`` knob names it (after ``timeout``).
  ``ret`` is the first failure, else ``LLM_SUCCESS``.  At most 512 links per cluster.
* The client moves the bytes: a transfer needs a link from the caller to the cluster that owns the
  remote cache (``LLM_NOT_YET_LINK``).  A transfer that timed out breaks its link until it is
  unlinked and linked again ("该链路不可恢复，需重新建链"); a server that died, restarted, or tore the
  link down (``unlink_clusters(force=True)`` on its side) fails every transfer with ``LLM_LINK_FAILED``.
* ``unlink_clusters(clusters, timeout=3000, force=False)``: the client's non-forced unlink tells
  the server (``LLM_UNLINK_FAILED`` if the server is gone: unlink with ``force=True`` then); a
  server may only force (non-forced: ``LLM_UNLINK_FAILED``); a link with a transfer running is
  ``LLM_LINK_BUSY``; no link is ``LLM_NOT_YET_LINK``.
* ``link(comm_name, cluster_rank_info, rank_table) -> comm_id``: every member calls it (the stand-in
  waits up to ``$HCCL_CONNECT_TIMEOUT`` seconds, default 120, then ``LLM_LINK_FAILED``); at most 4
  members, this cluster among them, ranks 0..n-1, a JSON rank table (``ValueError``).  Transfers
  over it need ``query_register_mem_status(comm_id)`` to have answered ``OK`` first
  (``LLM_NOT_YET_LINK``); the ``mem_status`` / ``preparing_queries`` knobs make it answer
  ``PREPARING`` or ``FAILED``.  An unknown ``comm_id``: ``LLMException`` (``LLM_PARAM_INVALID``).
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from . import _registry
from ._pd_types import LLMClusterInfo, RegisterMemStatus
from ._state import counted, knobs
from ._types import LLMException, LLMStatusCode, check_type, is_int

MAX_CLUSTERS_PER_CALL = 16
MAX_LINKS = 512
MAX_COMM_MEMBERS = 4
MAX_COMM_NAME = 127
S = LLMStatusCode


@dataclass
class LinkRec:
    """This process's side of one link it can move bytes over."""

    remote: int
    server_pid: int
    seq: int
    mode: str  # "clusters" (this side is the client) or "comm"
    comm_id: int = 0
    broken: str = ""
    mem_ok: bool = True
    busy: int = 0


class LinkTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.links: Dict[int, LinkRec] = {}
        self.comms: Dict[int, Tuple[str, List[int]]] = {}
        self.queries: Dict[int, int] = {}
        self.next_comm = 1


def _infos(clusters: Any, timeout: Any, what: str) -> List[LLMClusterInfo]:
    check_type("clusters", clusters, (list, tuple))
    for i, info in enumerate(clusters):
        if not isinstance(info, LLMClusterInfo):
            raise TypeError(f"clusters[{i}] must be LLMClusterInfo, got {type(info).__name__}")
        if info.remote_cluster_id is None:
            raise ValueError(f"clusters[{i}].remote_cluster_id is not set")
    if not clusters:
        raise ValueError(f"{what}: clusters can not be empty")
    check_type("timeout", timeout, int)
    if timeout <= 0:
        raise ValueError(f"timeout {timeout} ms must be positive")
    return list(clusters)


def _status(rets: List[LLMStatusCode]) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
    return next((r for r in rets if r != S.LLM_SUCCESS), S.LLM_SUCCESS), rets


def _in_knob(name: str, cluster: int) -> bool:
    value = knobs().get(name, [])
    return value is True or cluster in value


def link_clusters(dd: Any, clusters: Union[List[LLMClusterInfo], Tuple[LLMClusterInfo]],
                  timeout: int = 3000) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
    with counted("link_clusters"):
        dd._check_ready("link_clusters")
        infos = _infos(clusters, timeout, "link_clusters")
        for i, info in enumerate(infos):
            if info.remote_cluster_id == dd.cluster_id:
                raise ValueError(f"clusters[{i}].remote_cluster_id {dd.cluster_id} is this cluster")
            if len(info.remote_ip_infos) != 1 or len(info.local_ip_infos) != 1:
                raise ValueError(f"clusters[{i}] needs exactly one remote and one local ip_info "
                                 f"(got {len(info.remote_ip_infos)} and {len(info.local_ip_infos)})")
        if len(infos) > MAX_CLUSTERS_PER_CALL:
            return _status([S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(infos))
        deadline = time.monotonic() + timeout / 1000
        return _status([_link_one(dd, info, deadline) for info in infos])


def _link_one(dd: Any, info: LLMClusterInfo, deadline: float) -> LLMStatusCode:
    rid = info.remote_cluster_id
    table: LinkTable = dd._link_table
    with table.lock:
        if rid in table.links:
            return S.LLM_ALREADY_LINK
        if len(table.links) >= MAX_LINKS:
            return S.LLM_LINK_FAILED
    if _in_knob("unreachable", rid):  # no answer: the attempt runs into its timeout
        time.sleep(max(0.0, deadline - time.monotonic()))
        return S.LLM_LINK_FAILED
    if _in_knob("link_down", rid):
        return S.LLM_LINK_FAILED
    address = "{}:{}".format(*info.remote_ip_infos[0])
    server = next((s for s in _registry.read()["servers"].values() if s["listen"] == address), None)
    if server is None or server["cluster"] != rid or not _registry.pid_alive(server["pid"]):
        return S.LLM_LINK_FAILED  # nobody listens there, or another cluster does
    seq = _registry.now()
    with _registry.update() as reg:
        reg["links"][f"{dd.cluster_id}>{rid}"] = {"client_pid": os.getpid(), "server_pid": server["pid"],
                                                  "seq": seq, "mode": "clusters"}
    with table.lock:
        table.links[rid] = LinkRec(rid, server["pid"], seq, "clusters")
    return S.LLM_SUCCESS


def unlink_clusters(dd: Any, clusters: Union[List[LLMClusterInfo], Tuple[LLMClusterInfo]], timeout: int = 3000,
                    force: bool = False) -> Tuple[LLMStatusCode, List[LLMStatusCode]]:
    with counted("unlink_clusters"):
        dd._check_ready("unlink_clusters")
        infos = _infos(clusters, timeout, "unlink_clusters")
        check_type("force", force, bool)
        if len(infos) > MAX_CLUSTERS_PER_CALL:
            return _status([S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(infos))
        return _status([_unlink_one(dd, info.remote_cluster_id, force) for info in infos])


def _unlink_one(dd: Any, rid: int, force: bool) -> LLMStatusCode:
    table: LinkTable = dd._link_table
    with table.lock:
        rec = table.links.get(rid)
        if rec is not None:
            if rec.mode != "clusters":
                return S.LLM_UNLINK_FAILED  # made by link(): unlink(comm_id)
            if rec.busy:
                return S.LLM_LINK_BUSY
            if not force and not _registry.pid_alive(rec.server_pid):
                return S.LLM_UNLINK_FAILED  # the server cannot be told: force it
            del table.links[rid]
    with _registry.update() as reg:
        if rec is not None:
            reg["links"].pop(f"{dd.cluster_id}>{rid}", None)
            return S.LLM_SUCCESS
        key = f"{rid}>{dd.cluster_id}"
        if key not in reg["links"]:
            return S.LLM_NOT_YET_LINK
        if not force:
            return S.LLM_UNLINK_FAILED  # a non-forced unlink is the client's to make
        del reg["links"][key]
        return S.LLM_SUCCESS


def link(dd: Any, comm_name: str, cluster_rank_info: Dict[int, int], rank_table: str) -> int:
    with counted("link"):
        dd._check_ready("link")
        check_type("comm_name", comm_name, str)
        if not 0 < len(comm_name) <= MAX_COMM_NAME:
            raise ValueError(f"comm_name must have 1 to {MAX_COMM_NAME} characters, got {len(comm_name)}")
        check_type("cluster_rank_info", cluster_rank_info, dict)
        for k, v in cluster_rank_info.items():
            if not is_int(k) or not is_int(v):
                raise TypeError(f"cluster_rank_info must map int to int, got {k!r}: {v!r}")
        if not 2 <= len(cluster_rank_info) <= MAX_COMM_MEMBERS:
            raise ValueError(f"a communication domain has 2 to {MAX_COMM_MEMBERS} clusters, got {len(cluster_rank_info)}")
        if dd.cluster_id not in cluster_rank_info:
            raise ValueError(f"cluster_rank_info does not name this cluster {dd.cluster_id}")
        if sorted(cluster_rank_info.values()) != list(range(len(cluster_rank_info))):
            raise ValueError(f"ranks {sorted(cluster_rank_info.values())} must be 0..{len(cluster_rank_info) - 1}")
        check_type("rank_table", rank_table, str)
        try:
            json.loads(rank_table)
        except json.JSONDecodeError as exc:
            raise ValueError(f"rank_table is not JSON: {exc}") from None
        dd._publish()
        members = {str(c): r for c, r in cluster_rank_info.items()}
        with _registry.update() as reg:
            comm = reg["comms"].setdefault(comm_name, {"members": members, "joined": {}})
            if comm["members"] != members:
                raise LLMException(f"[link] communication domain {comm_name!r} has members {comm['members']}, "
                                   f"not {members}", S.LLM_PARAM_INVALID)
            comm["joined"][str(dd.cluster_id)] = os.getpid()
        wait = float(os.environ.get("HCCL_CONNECT_TIMEOUT", "120"))
        deadline = time.monotonic() + wait
        while True:
            joined = _registry.read()["comms"].get(comm_name, {}).get("joined", {})
            if set(joined) >= set(members):
                break
            if time.monotonic() >= deadline:
                raise LLMException(f"[link] {comm_name!r}: clusters {sorted(set(members) - set(joined))} did not join "
                                   f"within {wait:g} s (HCCL_CONNECT_TIMEOUT)", S.LLM_LINK_FAILED)
            time.sleep(0.005)
        seq = _registry.now()
        table: LinkTable = dd._link_table
        others = [int(c) for c in members if int(c) != dd.cluster_id]
        with _registry.update() as reg, table.lock:
            comm_id = table.next_comm
            table.next_comm += 1
            table.comms[comm_id] = (comm_name, others)
            for other in others:
                pid = joined[str(other)]
                reg["links"][f"{dd.cluster_id}>{other}"] = {"client_pid": os.getpid(), "server_pid": pid, "seq": seq,
                                                            "mode": "comm"}
                table.links[other] = LinkRec(other, pid, seq, "comm", comm_id, mem_ok=False)
        return comm_id


def _comm(dd: Any, comm_id: Any, call: str) -> Tuple[str, List[int]]:
    check_type("comm_id", comm_id, int)
    comm = dd._link_table.comms.get(comm_id)
    if comm is None:
        raise LLMException(f"[{call}] comm_id {comm_id} was not returned by link", S.LLM_PARAM_INVALID)
    return comm


def unlink(dd: Any, comm_id: int) -> None:
    with counted("unlink"):
        dd._check_ready("unlink")
        name, others = _comm(dd, comm_id, "unlink")
        table: LinkTable = dd._link_table
        with _registry.update() as reg, table.lock:
            del table.comms[comm_id]
            for other in others:
                table.links.pop(other, None)
                reg["links"].pop(f"{dd.cluster_id}>{other}", None)
            comm = reg["comms"].get(name)
            if comm is not None:
                comm["joined"].pop(str(dd.cluster_id), None)


def query_register_mem_status(dd: Any, comm_id: int) -> RegisterMemStatus:
    with counted("query_register_mem_status"):
        dd._check_ready("query_register_mem_status")
        _, others = _comm(dd, comm_id, "query_register_mem_status")
        table: LinkTable = dd._link_table
        k = knobs()
        with table.lock:
            table.queries[comm_id] = n = table.queries.get(comm_id, 0) + 1
            status = RegisterMemStatus[k.get("mem_status", "OK")]
            if status == RegisterMemStatus.OK and n <= k.get("preparing_queries", 0):
                status = RegisterMemStatus.PREPARING
            if status == RegisterMemStatus.OK:
                for other in others:
                    if other in table.links:
                        table.links[other].mem_ok = True
        return status


@contextmanager
def using(dd: Any, remote: int, call: str) -> Iterator[LinkRec]:
    """The link a transfer to or from ``remote`` runs over, counted busy while it runs."""
    table: LinkTable = dd._link_table
    with table.lock:
        rec = table.links.get(remote)
        if rec is None:
            raise LLMException(f"[{call}] cluster {dd.cluster_id} has no link to cluster {remote}: link_clusters first",
                               S.LLM_NOT_YET_LINK)
        rec.busy += 1
    try:
        check_link(dd, rec, call)
        yield rec
    finally:
        with table.lock:
            rec.busy -= 1


def check_link(dd: Any, rec: LinkRec, call: str) -> None:
    """Refuse a transfer over a link that is broken, down, torn down, or whose peer is gone."""
    name = f"[{call}] link {dd.cluster_id}->{rec.remote}"
    if rec.broken:
        raise LLMException(f"{name} {rec.broken}: unlink and link again", S.LLM_LINK_FAILED)
    if not rec.mem_ok:
        raise LLMException(f"{name}: registered memory not ready; poll query_register_mem_status until OK",
                           S.LLM_NOT_YET_LINK)
    if _in_knob("link_down", rec.remote) or _in_knob("link_down", dd.cluster_id):
        raise LLMException(f"{name} is down", S.LLM_LINK_FAILED)
    if not _registry.pid_alive(rec.server_pid):
        raise LLMException(f"{name}: peer cluster {rec.remote} (pid {rec.server_pid}) is gone", S.LLM_LINK_FAILED)
    if rec.mode == "clusters":
        entry = _registry.read()["links"].get(f"{dd.cluster_id}>{rec.remote}")
        if entry is None or entry["server_pid"] != rec.server_pid:
            raise LLMException(f"{name} was torn down by the peer", S.LLM_LINK_FAILED)


def peer_mem_pool(remote: int) -> Optional[int]:
    server = _registry.read()["servers"].get(str(remote))
    return None if server is None else server["mem_pool"]
