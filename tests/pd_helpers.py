"""Engine instances for the prefill/decode tests: one in this process (``local_instance``), two
linked in this process (``instance_pair``), and one in a child process for tests that kill or stop
it for real (``PeerInstance``, ``child_instance``).

``npu_instance_pair`` is ``instance_pair`` on ``--platform npu`` over the pyACL and LLM-DataDist
stand-ins; ``fill_any``/``blocks_any`` fill and read caches on either platform.

The child starts a ``CacheTransferService`` and its ``PrefillDecode`` side, fills its caches with
seeded random bytes, and answers JSON commands on stdin, one per line: ``descriptor``, ``link``,
``expose``, ``retract``, ``receive_push`` and ``push_state`` (decode side), ``push`` and
``computed`` (prefill side: a layer-wise push and its computed layers), ``digest`` (SHA-256 of
blocks per rank, kind and layer), ``bytes`` (the blocks themselves, hex), ``quit``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from typing import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import hashlib, json, sys
    sys.path.insert(0, {repo!r})
    from cache_manager.cache_spec import CacheSpec
    from engine_hooks.pd import PrefillDecode
    from transfer_factory.peer.handles import TransferHandle
    from tests.service_helpers import fill_distinct, start_service, views
    from tests.pd_helpers import digests
    spec = CacheSpec(**{spec!r})
    svc = start_service(spec, tp={tp}, num_cpu_blocks=8)
    side = PrefillDecode(svc, {instance!r})
    fill_distinct(svc, seed={seed})
    def answer(value):
        print(json.dumps(value), flush=True)
    targets = {{}}
    pushes = {{}}
    answer({{"pids": list(svc.pids().values())}})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "descriptor":
                answer(side.descriptor(cmd.get("offer", ["ipc"])))
            elif op == "link":
                answer(side.link(cmd["peer"], transport=cmd.get("transport", "auto")))
            elif op == "expose":
                answer(side.expose(cmd["req_id"]).to_wire())
            elif op == "retract":
                answer(side.retract(TransferHandle.from_wire(cmd["handle"])))
            elif op == "receive_push":
                targets[cmd["peer"]] = side.receive_push(cmd["peer"], cmd["dst"], timeout=cmd.get("timeout", 30))
                answer(targets[cmd["peer"]].ticket)
            elif op == "push_state":
                target = targets[cmd["peer"]]
                answer({{"released": target.released, "words": target._words()}})
            elif op == "push":
                pushes[cmd["peer"]] = side.push_blocks(cmd["peer"], cmd["ticket"], cmd["src"], layerwise=True,
                                                       timeout=cmd.get("timeout", 30))
                answer("ok")
            elif op == "computed":
                pushes[cmd["peer"]].layer_computed(cmd["layers"])
                answer("ok")
            elif op == "digest":
                answer(digests(views(svc), cmd["ids"]))
            elif op == "bytes":
                answer({{f"{{r}}/{{k}}/{{l}}": v[cmd["ids"]].tobytes().hex() for (r, k, l), v in views(svc).items()}})
            elif op == "quit":
                break
        except Exception as exc:
            answer({{"error": f"{{type(exc).__name__}}: {{exc}}"}})
    side.close()
    svc.shutdown()
""")


def digests(views: dict, ids: list[int]) -> dict:
    """"rank/kind/layer" -> SHA-256 of those blocks' bytes, in order."""
    return {f"{r}/{k}/{l}": hashlib.sha256(v[list(ids)].tobytes()).hexdigest() for (r, k, l), v in views.items()}


class PeerInstance:
    """A child process running one engine instance; ``call`` sends a command and waits for its answer."""

    def __init__(self, instance: str, spec: dict, tp: int = 2, seed: int = 1):
        self.tp = tp
        code = CHILD.format(repo=REPO, spec=spec, tp=tp, instance=instance, seed=seed)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=REPO)
        self.instance = instance
        self.pid = self.proc.pid
        self.rank_pids = self._read(timeout=60)["pids"]

    def _read(self, timeout: float) -> object:

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"instance {self.instance} did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"instance {self.instance} exited (rc {self.proc.poll()})")
        value = json.loads(line)
        if isinstance(value, dict) and "error" in value:
            raise RuntimeError(value["error"])
        return value

    def call(self, op: str, timeout: float = 60.0, **args) -> object:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def local_digests(svc, ids: list[int]) -> dict:
    from tests.service_helpers import views

    return digests(views(svc), ids)


@contextlib.contextmanager
def local_instance(spec, instance: str, **service_args) -> Iterator[tuple]:
    """(service, its PrefillDecode side) in this process; both closed afterwards."""
    from engine_hooks.pd import PrefillDecode
    from tests.service_helpers import start_service

    svc = start_service(spec, **service_args)
    try:
        side = PrefillDecode(svc, instance)
    except BaseException:
        svc.shutdown()
        raise
    try:
        yield svc, side
    finally:
        side.close()
        svc.shutdown()


@contextlib.contextmanager
def instance_pair(spec, **service_args) -> Iterator[tuple]:
    """(prefill service, decode service, their sides "prefill-0" and "decode-0"), not yet linked."""
    with local_instance(spec, "prefill-0", **service_args) as (p_svc, p), \
            local_instance(spec, "decode-0", **service_args) as (d_svc, d):
        yield p_svc, d_svc, p, d


def pair_fixtures(spec, **service_args) -> tuple:
    """Module-scoped fixtures ``pair`` (CPU) and ``npu_pair`` (``npu_instance_pair``) of ``spec``:
    ``pair, npu_pair = pair_fixtures(SPEC)`` in a test module; ``pair_for`` picks one."""
    import pytest

    @pytest.fixture(scope="module")
    def pair():
        with instance_pair(spec, **service_args) as instances:
            yield instances

    @pytest.fixture(scope="module")
    def npu_pair(tmp_path_factory):
        with npu_instance_pair(spec, tmp_path_factory.mktemp("acl"), **service_args) as instances:
            yield instances

    return pair, npu_pair


def pair_for(request, transport: str) -> tuple:
    """The CPU pair, or the NPU pair for LLM-DataDist (the transport NPU ranks offer)."""
    return request.getfixturevalue("npu_pair" if transport == "datadist" else "pair")


def link_both(p, d, transport: str, chosen: str | None = None) -> None:
    """Link a prefill side and a decode side of this process both ways, offering what
    ``transport`` needs and asking for ``chosen`` (default: ``transport`` itself)."""
    from engine_hooks.pd import offer_for

    for side, peer in ((p, d), (d, p)):
        assert side.link(peer.descriptor(offer_for(transport)), transport=chosen or transport) == transport


def link_child(side, child: "PeerInstance", transport: str) -> str:
    """Link ``side`` and a child instance both ways over ``transport``; the transport ``side`` chose."""
    from engine_hooks.pd import offer_for

    offer = offer_for(transport)
    child.call("link", peer=side.descriptor(offer), transport=transport)
    return side.link(child.call("descriptor", offer=offer), transport=transport)


@contextlib.contextmanager
def npu_instance_pair(spec, tmp_dir, **service_args) -> Iterator[tuple]:
    """``instance_pair`` on ``--platform npu`` over the pyACL and LLM-DataDist stand-ins (importable
    here and in the CTMs, sharing ``tmp_dir`` as $ACL_STANDIN_DIR): the ranks offer ``datadist``."""
    import pytest

    from tests.npu_helpers import STANDINS, forget_standin_modules

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(STANDINS)
        mp.setenv("ACL_STANDIN_DIR", str(tmp_dir))
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (STANDINS, os.environ.get("PYTHONPATH")) if p))
        try:
            with instance_pair(spec, platform="npu", **service_args) as instances:
                yield instances
        finally:
            forget_standin_modules()


def fill_any(svc, seed: int) -> None:
    """Random bytes in every cache, on either platform (NPU device memory only by copy)."""
    if svc.platform.name == "npu":
        from tests.npu_helpers import fill

        fill(svc, seed)
    else:
        from tests.service_helpers import fill_distinct

        fill_distinct(svc, seed)


def blocks_any(svc, ids) -> dict:
    """(rank, kind, layer) -> a copy of blocks ``ids``, on either platform."""
    if svc.platform.name == "npu":
        from tests.npu_helpers import blocks

        return blocks(svc, ids)
    from tests.service_helpers import block_bytes

    return block_bytes(svc, ids)


@contextlib.contextmanager
def child_instance(instance: str, spec: dict, seed: int, tp: int = 2) -> Iterator[PeerInstance]:
    """A ``PeerInstance``; afterwards every process of it is continued (a test may have stopped
    some) and the instance closed."""
    peer = PeerInstance(instance, spec, tp=tp, seed=seed)
    try:
        yield peer
    finally:
        for pid in [peer.pid] + peer.rank_pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        peer.close()
