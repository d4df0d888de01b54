"""Two tenants replaying the same trace (DESIGN §4.2, ``replay_trace.py --tenants 2``): the prefix
cache gets the same block hashes for both and only the salt keeps them apart; each tenant's blocks
hold bytes of its own, so a block served across tenants is seen by its bytes.  With salts: 0
cross-tenant hits in device, host and storage (and P/D), and each tenant reaches the trace's ceiling
as if alone.  The control run drops the salt where it enters a block's identity and must see the
cross-tenant hits the salts prevent, so the check can fail."""
import json
import os
import subprocess
import sys

from tests.scripts.test_replay import REPLAY, REPO, private_env, run_replay

SMALL_TIERS = ["--max-requests", "30", "--tenants", "2", "--device-blocks", "48", "--host-blocks", "64"]


def test_two_tenants_never_hit_each_others_blocks_and_each_reaches_the_ceiling(tmp_path):
    result, proc = run_replay(tmp_path, *SMALL_TIERS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["cross_tenant_hits"] == {"device": 0, "host": 0, "storage": 0, "pd": 0}
    # every tier served hits, so every tier was tried across tenants
    assert result["device_hit_ratio"] > 0 and result["host_hit_ratio"] > 0 and result["storage_hit_ratio"] > 0
    assert result["corrupt_blocks"] == 0
    assert result["tenant_hit_ratios"] == result["tenant_ceilings"]
    assert result["tenant_ceilings"][0] == result["tenant_ceilings"][1] > 0.3


def test_without_the_salt_the_tenants_serve_each_other_and_the_replay_sees_it(tmp_path):
    unsalted = ("import runpy, sys; sys.path.insert(0, 'scripts'); import transfer_factory.keys as keys; "
                "keys.salted_hashes = lambda hashes, salt: list(hashes); "
                f"sys.argv = {['replay_trace.py', '--json', '--no-progress', *SMALL_TIERS]!r}; "
                "runpy.run_path('scripts/replay_trace.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", unsalted], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=private_env(tmp_path))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert proc.returncode == 1  # the wrong blocks were found, counted and recomputed
    assert result["cross_tenant_hits"]["device"] > 0 and result["cross_tenant_hits"]["host"] > 0
    assert 0 < sum(result["cross_tenant_hits"].values()) <= result["corrupt_blocks"]


def test_tenants_are_refused_with_several_instances(tmp_path):
    proc = subprocess.run([*REPLAY, "--tenants", "2", "--instances", "2", "--storage", "mooncake"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=private_env(tmp_path))
    assert proc.returncode == 2 and "--tenants" in proc.stderr
    assert os.path.isdir(REPO)


def test_two_tenants_over_prefill_decode_push_every_block_to_their_own_request(tmp_path):
    """Over --pd the salt travels with each hand-off (the push reservation is the tenant's): every
    request of both tenants is decoded from its own tenant's bytes."""
    result, proc = run_replay(tmp_path, "--max-requests", "12", "--tenants", "2", "--pd", "1:1", "--pd-mode", "push")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["cross_tenant_hits"] == {"device": 0, "host": 0, "storage": 0, "pd": 0}
    assert result["pd_requests"] == result["requests"] == 24 and result["pd_failed_transfers"] == 0
    assert result["tenant_hit_ratios"] == result["tenant_ceilings"]
