"""The replay's P/D mode with digests on (``replay_trace.py --pd 1:1 --pd-digests``): the prefill
ranks digest every exposed block, the decode ranks check every pulled block; a healthy replay counts
0 mismatches, every block bit-exact, nothing left behind (the digest tables included)."""
import argparse

import pytest

from tests.scripts.test_replay_pd import assert_nothing_left, replay_pd, run_pd


def test_a_replay_with_digests_on_counts_no_mismatch_and_every_block_bit_exact(tmp_path):
    r, seen, ports = run_pd(tmp_path, "--pd", "1:1", "--pd-digests", "--pd-transport", "mooncake")
    assert r["pd_digests"] is True and r["pd_transport"] == "mooncake"
    assert r["pd_digest_mismatches"] == 0 and r["pd_failed_transfers"] == 0
    assert r["pd_corrupt_blocks"] == 0 and r["pd_blocks"] == r["blocks"] > 0 and r["pd_requests"] == r["requests"]
    assert_nothing_left(seen, ports, instances=2)


def test_digests_on_a_push_replay_are_refused():
    parser = argparse.ArgumentParser()
    replay_pd.add_arguments(parser)
    args = parser.parse_args(["--pd", "1:1", "--pd-mode", "push", "--pd-digests"])
    args.instances, args.kill_instance_at, args.metrics_port, args.model = 1, None, None, None
    with pytest.raises(SystemExit):
        replay_pd.check_arguments(parser, args)
