"""The repo's own code runs on a host of the two-host bed (tests/two_hosts.py) and sees that host: its
boot id, its clock.  cache_manager/queue/clocks.py decides from those whether a rank reads the engine's
CLOCK_MONOTONIC; here the engine is this process and the ranks are bed hosts.  Needs root.
"""
from __future__ import annotations

import json
import os
import sys

from cache_manager.queue.clocks import engine_clock
from tests import two_hosts as bed_lib

two_hosts, host_bed_factory = bed_lib.two_hosts, bed_lib.host_bed_factory  # the shared fixtures
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO}
SHARES = ("import json, sys; from cache_manager.queue.clocks import shares_engine_clock; "
          "print(shares_engine_clock(json.loads(sys.argv[1])))")


def test_the_repos_code_imports_and_reads_the_hosts_boot_id(two_hosts: bed_lib.Bed) -> None:
    code = "import ops, cache_manager; from cache_manager.queue.clocks import boot_id; print(boot_id())"
    for host in two_hosts.hosts:
        out = host.run([sys.executable, "-c", code], timeout=30, check=True, cwd=REPO, env=ENV).stdout
        assert out.strip() == host.boot_id


def test_only_a_host_on_this_kernel_and_clock_shares_the_engines_clock(host_bed_factory) -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        machine = f.read().strip()
    # a: this kernel's boot id and clock (a container); b: this boot id, clock 5 h ahead; c: another host
    bed = host_bed_factory(3, boot_ids={"a": machine, "b": machine}, clock_offsets={"b": 5 * 3600})
    stamp = json.dumps(engine_clock())
    answers = [h.run([sys.executable, "-c", SHARES, stamp], timeout=30, check=True, cwd=REPO, env=ENV).stdout.strip()
               for h in bed.hosts]
    assert answers == ["True", "False", "False"]
