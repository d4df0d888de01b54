import itertools
import os

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
