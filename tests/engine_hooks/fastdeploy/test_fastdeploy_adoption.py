"""The README's adoption list ("From FastDeploy") is every line an adopter changes, and it works.

The list is parsed from README.md: each numbered change must be one this test checks (a change
added without a check, or a check without its change, fails), and each is checked against what
runs here: FastDeploy's own CTM launch line (``tests.fastdeploy_pd_engine``) with the changes
applied, the engine that ``tests/fastdeploy_engine.py`` models, and the engine side of each
FastDeploy version that ``tests/fastdeploy_engine_side.py`` models (which changes apply to which
version, as the README says; the versions' own tests run there with the README's imports).
"""
from __future__ import annotations

import ast
import os
import re
import time

import numpy as np
import pytest

from cache_manager.cache_data import CACHE_TRANSFER_INITED_SIGNAL, SWAP_SPACE_READY_SIGNAL
from cache_manager.ctm_flags import parse_args
from cache_manager.queue.wire import SECRET_FILE_ENV
from engine_hooks.fastdeploy.fmq import ControlResponseQueue
from engine_hooks.core.launcher import REPO_ROOT
from tests.fastdeploy_pd_engine import CREATE_CACHE_TENSOR, CTM_MODULE, FD_SCRIPT, FastDeployPDEngine, adopt, pd_storage_keys
from tests.fastdeploy_engine_side import VERSIONS
from tests.fastdeploy_types import FDCacheStatus, FDReadStorageTask, FDWriteStorageTask

README = os.path.join(REPO_ROOT, "README.md")
DOC = os.path.join(REPO_ROOT, "docs", "fastdeploy.md")
MODEL_ENGINE = os.path.join(REPO_ROOT, "tests", "fastdeploy_engine.py")
MODEL_ENGINE_SIDE = os.path.join(REPO_ROOT, "tests", "fastdeploy_engine_side.py")


def readme_changes() -> list[str]:
    """The numbered items of the README's "From FastDeploy" list, each as one line of text."""
    text = open(README).read()
    start = text.index("**From FastDeploy**")
    items: list[str] = []
    for line in text[start:].splitlines()[1:]:
        if re.match(r"\d+\. ", line):
            items.append(line)
        elif items and line.startswith("   "):
            items[-1] += " " + line.strip()
        elif items and not line.strip():
            break
    return items


def spans(item: str) -> list[str]:
    return re.findall(r"`([^`]+)`", item)


def model_engine_imports(path: str = MODEL_ENGINE) -> set[tuple[str, str]]:
    tree = ast.parse(open(path).read())
    return {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for alias in node.names}


def check_imports(item: str, _first: list[str]) -> None:
    lines = [s for s in spans(item) if s.startswith("from engine_hooks.")]
    if not lines:  # "the same two imports": the lines of the change before
        assert "the same two imports" in item, item
        lines = _first
    assert sorted(line.split()[-1] for line in lines) == ["EngineCacheQueue", "IPCSignal"], lines
    taken = model_engine_imports()
    stock = [s for s in spans(item) if s.startswith("from fastdeploy.inter_communicator import ") and "(" not in s]
    for line in stock:  # what the README's lines replace: the same names, FastDeploy's module
        assert {n.strip() for n in line.split(" import ")[1].split(",")} >= {"EngineCacheQueue", "IPCSignal"}, line
    for line in lines:
        _, module, _, name = line.split()
        namespace: dict = {}
        exec(line, namespace)  # the line as the README prints it imports
        assert (module, name) in taken, f"tests/fastdeploy_engine.py does not take {line!r}"
    _first[:] = lines


def check_module(item: str, _: list[str]) -> None:
    assert CTM_MODULE in item and FD_SCRIPT in item  # what adopt() replaces, as the README says


def check_create_flag(item: str, _: list[str]) -> None:
    assert CREATE_CACHE_TENSOR in spans(item) and "status 2" in item
    assert CREATE_CACHE_TENSOR not in adopt(f"python {FD_SCRIPT} --kvcache_storage_backend file{CREATE_CACHE_TENSOR}")


def check_worker(item: str, _: list[str]) -> None:
    assert "#8046" in item and any(s.startswith("create_cache_tensor = profile or not (") for s in spans(item))


def check_control(item: str, _: list[str]) -> None:
    stock, ours = (s for s in spans(item) if s.endswith("import FMQ"))
    assert stock == "from fastdeploy.inter_communicator.fmq import FMQ", stock
    namespace: dict = {}
    exec(ours, namespace)  # the line as the README prints it imports
    _, module, _, name = ours.split()
    assert (module, name) in model_engine_imports(MODEL_ENGINE_SIDE), f"the modelled engine side does not take {ours!r}"
    assert isinstance(namespace["FMQ"]().queue("ctrl_c2e_rank3_8123", "consumer"), ControlResponseQueue)


def check_platform(item: str, _: list[str]) -> None:
    assert "CTM_PLATFORM=npu" in spans(item)


CHECKS = {"prefix_cache_manager.py`, the import": check_imports, "common_engine.py`, its `from": check_imports,
          CTM_MODULE.split()[-1]: check_module, "--create_cache_tensor": check_create_flag,
          "kvcache_storage_backend or": check_worker, "fastdeploy_fmq": check_control,
          "CTM_PLATFORM": check_platform}


def test_the_readme_lists_each_change_once_and_each_is_what_the_modelled_engine_does():
    items = readme_changes()
    assert [int(i.split(".")[0]) for i in items] == list(range(1, len(CHECKS) + 1)), items
    first: list[str] = []
    for item in items:
        markers = [m for m in CHECKS if m in item]
        assert len(markers) == 1, f"README change matches {markers}, not one check: {item}"
        CHECKS[markers[0]](item, first)
    doc = open(DOC).read()
    for site in ("`from fastdeploy.inter_communicator import EngineCacheQueue, IPCSignal, PrefixTreeStatus`",
                 "`from fastdeploy.inter_communicator.fmq import FMQ`", "--create_cache_tensor"):
        assert site in doc, f"docs/fastdeploy.md does not explain {site}"


def test_the_readme_says_which_changes_apply_to_each_modelled_version():
    text = " ".join(open(README).read().split("**From FastDeploy**")[1].split("1. ")[0].split())
    said = {"release/2.6": "release/2.6 (2026-06-01) and `develop` of 2026-05, all seven",
            "develop-2026-05": "release/2.6 (2026-06-01) and `develop` of 2026-05, all seven",
            "develop-8046": "`develop` after #8046 (2026-06), 1, 2, 3, 6 and 7"}
    assert set(said) == set(VERSIONS)
    for name, version in VERSIONS.items():
        assert said[name] in text, f"the README does not say which changes apply to {name}"
        listed = tuple(range(1, 8)) if "all seven" in said[name] else (1, 2, 3, 6, 7)
        assert version.changes == listed, name
        # changes 4 and 5 exist for the versions whose launch line adds --create_cache_tensor
        assert (4 in version.changes) == (5 in version.changes) == version.create_cache_tensor, name


def test_create_cache_tensor_is_refused_at_parse_and_0_is_accepted(monkeypatch, capsys):
    base = ["--key_cache_shape", "16,2,4,8", "--cache_queue_port", "8600", "--engine_worker_queue_port", "8700"]
    with pytest.raises(SystemExit) as exc:
        parse_args(base + ["--create_cache_tensor"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --create_cache_tensor" in err and "#8046" in err and "drop --create_cache_tensor" in err
    assert parse_args(base + ["--create_cache_tensor", "0"]).create_cache_tensor is False
    monkeypatch.setenv("CTM_PLATFORM", "npu")  # change 7: the platform FastDeploy's line leaves to the default
    assert parse_args(base).platform == "npu"


@pytest.fixture
def mixed(tmp_path):
    saved = os.environ.get(SECRET_FILE_ENV)
    model = tmp_path / "model"
    model.mkdir()
    engine = FastDeployPDEngine("mixed", storage_backend="file", model_path=str(model),
                                env={"FILE_BACKEND_STORAGE_DIR": str(tmp_path / "kv")})
    try:
        yield engine
    finally:
        leftovers = engine.close()
        if saved is None:
            os.environ.pop(SECRET_FILE_ENV, None)
        else:
            os.environ[SECRET_FILE_ENV] = saved
    assert leftovers == []


def test_fastdeploys_own_launch_line_is_refused_with_create_cache_tensor_and_serves_without(mixed):
    # change 3 only: FastDeploy's line for a mixed instance with a storage backend, --create_cache_tensor in it
    stock = mixed.line(0, adopted=False)
    assert CREATE_CACHE_TENSOR in stock and CTM_MODULE in stock
    ours = lambda: {n for n in os.listdir("/dev/shm") if str(mixed.port) in n}  # noqa: E731  (this engine's)
    shm_before = ours()
    shell = mixed.launch_line(0, stock)
    started = time.monotonic()
    assert shell.wait(30) == 2, mixed.launch_log(0)
    assert time.monotonic() - started < 15
    log = mixed.launch_log(0)
    assert "argument --create_cache_tensor" in log and "drop --create_cache_tensor" in log, log
    assert ours() == shm_before, "the refused CTM created something"
    for name in (SWAP_SPACE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL):
        assert mixed.signals[name].value[0] == 0, f"the refused CTM set {name}"
    mixed.shells.remove(shell)

    # changes 3 and 4: the same line without the flag; the engine (its worker) made the caches
    for rank in range(mixed.tp):
        line = mixed.line(rank)  # adopt(): the README's changes to FastDeploy's line, nothing else
        assert CREATE_CACHE_TENSOR not in line and CTM_MODULE in line and "--kvcache_storage_backend file" in line
        mixed.launch_line(rank, line)
    mixed.wait_ready([0, 1], 30)
    mixed.fill(7)
    tokens = list(range(3 * 4 + 2))
    keys = pd_storage_keys(tokens, 4)
    src, dst = [1, 5, 9, 13], [2, 6, 10, 14]
    mixed.queue.put_transfer_task((FDCacheStatus.GPU2STORAGE, FDWriteStorageTask(
        task_id="w", keys=keys, token_ids=tokens, gpu_block_ids=src)))
    assert mixed.signals_for(2) == [(FDCacheStatus.GPU2STORAGE, "w", keys, src)] * 2  # one per rank
    mixed.queue.put_transfer_task((FDCacheStatus.STORAGE2GPU, FDReadStorageTask(
        task_id="r", keys=keys, token_ids=tokens, gpu_block_ids=dst, start_read_block_idx=0)))
    assert [s[3] for s in mixed.signals_for(2)] == [dst, dst]
    for key, view in mixed.views().items():
        assert np.array_equal(view[dst], view[src]), f"rank/kind/layer {key} differs"
