import itertools
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from ops.cpu import CpuPlatform
from ops.shm import unlink_segments

_instances = itertools.count()


@pytest.fixture(autouse=True, scope="session")
def _ctm_logs(tmp_path_factory):
    """CTM logs of the whole run in one pytest temp dir, not in the checkout's ./log."""
    os.environ.setdefault("CTM_LOG_DIR", str(tmp_path_factory.mktemp("ctm-logs")))
    yield


@pytest.fixture
def cpu():
    """A CPU platform with a unique instance id; fails the test if it leaves a segment behind."""
    platform = CpuPlatform(instance=f"t{os.getpid()}i{next(_instances)}", copy_threads=2)
    yield platform
    for ptr in list(platform._device):
        alloc = platform._device.pop(ptr)
        if alloc.owned:
            alloc.segment.unlink()
        alloc.segment.close()
    for ptr in platform._hosts:
        platform.host_free(ptr)
    leftovers = unlink_segments(platform.segment_prefix)
    assert not leftovers, f"segments left in /dev/shm: {leftovers}"


SMALL_FS_BYTES = 2 << 20  # the small tmpfs: 512 pages of 4 KiB


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for the test (a filesystem the test can really fill); needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS_BYTES},mode=0755", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {mnt}: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)   # still busy: detach it anyway


# The long scenarios, marked ``slow``: ``make test`` leaves them out to stay within ~15 minutes on a
# 2-core machine, ``make test-slow`` runs them (before a release, and after changing what they cover).
# Each repeats at length what a default test checks once: the two-host bed's fault scenarios (the
# bit-exact transfer across the veth stays in ``make test``), a Mooncake master stopped under late
# writes, replays of several instances, a replay's end by signal, a thousand random P/D transfers,
# every preset over P/D, the real-scale engine; and replays whose transport, instance count, metrics,
# Mooncake master or model a faster default test covers already (the replay over P/D on the same-host
# path and each layout kind stay; the Transfer Engine, TP pairs and presets over P/D are in
# tests/engine_hooks/pd and test_cache_layout_paths.py).  Matched on "file.py" or a prefix of
# "file.py::test".
SLOW_TESTS = (
    "test_pd_two_hosts.py::test_a_pull_from_a_sigkilled", "test_pd_two_hosts.py::test_a_blackholed",
    "test_pd_two_hosts.py::test_two_hosts_left", "test_pd_two_hosts.py::test_a_decode_host_whose_clock",
    "test_pd_two_hosts.py::test_pulls_timing_out", "test_pd_two_hosts.py::test_a_pull_that_cannot_start",
    "test_pd_two_hosts.py::test_a_prefill_instance_that_never_answers",
    "test_mooncake_faults.py::test_stopped_master_late_write", "test_multi_instance.py",
    "test_replay.py::test_the_temporary_store_root_goes", "test_replay.py::test_write_policies",
    "test_pd_random.py", "test_real_scale.py",
    "test_cache_layout_paths.py::test_each_preset_pulls_and_pushes_bit_exact_over_both_transports[deepseek-v3]",
    "test_cache_layout_paths.py::test_each_preset_pulls_and_pushes_bit_exact_over_both_transports[deepseek-v4]",
    "test_cache_layout_paths.py::test_each_preset_pulls_and_pushes_bit_exact_over_both_transports[qwen3-235b]",
    "test_cache_layout_paths.py::test_heads_replicated_over_more_ranks",
    "test_replay_pd.py::test_every_block_reaches_decode_bit_exact_at_the_ceiling[pull-mooncake]",
    "test_replay_pd.py::test_every_block_reaches_decode_bit_exact_at_the_ceiling[push-mooncake]",
    "test_replay_pd.py::test_instances_of_different_tp_sizes_hand_over_every_block_bit_exact[2-1-pull-mooncake]",
    "test_replay_pd.py::test_two_prefill_instances_share_one_decode_instance",
    "test_replay.py::test_metrics_scraped_during_a_replay", "test_replay.py::test_replay_with_mooncake_starts",
    "test_bench_layouts.py", "test_rl_update.py::test_clear_and_restore_never_serve_kv_of_the_old_weights[mooncake]",
    "test_replay_models.py::test_a_model_replays_bit_exact_and_reports_its_bytes_against_the_naive_layout[qwen3-next]",
    "test_replay_models.py::test_a_model_over_pd_reaches_decode_bit_exact[deepseek-v4-push]",
)

# Tests of uid, ownership and file-mode behaviour, marked ``permissions``: ``make test`` runs them a
# second time as uid 65534 (tests/run_unprivileged.sh), where root's bypass of permission checks
# cannot hide a bug.  Matched on "file.py" or a prefix of "file.py::test_name".
PERMISSION_TESTS = (
    "test_file_store_trust.py", "test_queue_secret_file.py", "test_facade_secret.py",
    "test_file_store_directories.py", "test_ipc_names.py", "test_permissions_unprivileged.py",
    "test_ipc.py::test_attach_refuses_a_segment_owned_by_another_user",
    "test_shutdown_faults.py::test_orphan_cleanup", "test_shutdown_faults.py::test_refused_start",
    "test_shutdown_faults.py::test_logs_are_private", "test_shutdown_faults.py::test_rank_logger",
    "test_local_link.py::test_a_process_of_another_user", "test_local_link.py::test_the_socket_has_no_file",
    "test_queue_flood.py::test_a_connect_flood_from_another_user",
)
# Permission tests that need root without saying so: as another user they skip, saying why.
ROOT_ONLY = {"test_ipc.py::test_attach_refuses_a_segment_owned_by_another_user":
             "chowns a segment to uid 65534, which only root can"}


def pytest_addoption(parser):
    parser.addoption("--fastdeploy-version", action="append", default=None,
                     help="the FastDeploy version(s) whose engine side the FastDeploy tests model "
                          "(tests/fastdeploy_engine_side.py VERSIONS); default: every one")


def pytest_generate_tests(metafunc):
    """``fastdeploy_version``: every chosen FastDeploy version (where what is tested differs between
    them); ``one_fastdeploy_version``: the first chosen (release/2.6 by default, where it does not)."""
    names = [n for n in ("fastdeploy_version", "one_fastdeploy_version") if n in metafunc.fixturenames]
    if names:
        from tests.fastdeploy_engine_side import VERSIONS
        chosen = metafunc.config.getoption("fastdeploy_version") or list(VERSIONS)
        unknown = [v for v in chosen if v not in VERSIONS]
        if unknown:
            raise pytest.UsageError(f"--fastdeploy-version {unknown}: known are {', '.join(VERSIONS)}")
        chosen = chosen if names[0] == "fastdeploy_version" else chosen[:1]
        metafunc.parametrize(names[0], [VERSIONS[v] for v in chosen], ids=chosen)


def pytest_configure(config):
    config.addinivalue_line("markers", "permissions: uid, ownership and file-mode behaviour (also run as uid 65534)")
    config.addinivalue_line("markers", "slow: long scenarios left out of `make test`, run by `make test-slow`")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.nodeid.rsplit("/", 1)[-1]
        if name.startswith(PERMISSION_TESTS):
            item.add_marker(pytest.mark.permissions)
        if name.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
        why = next((why for test, why in ROOT_ONLY.items() if name.startswith(test)), None)
        if why and os.geteuid() != 0:
            item.add_marker(pytest.mark.skip(reason=why))
