"""Permission checks met as an ordinary user (``make test`` runs these as uid 65534 through
tests/run_unprivileged.sh): the other user is root, whose files exist on every host, and a refused
open is a real EACCES, which root never sees.  As root they skip: root's files are its own."""
import os
import re

import pytest

from cache_manager.queue import wire

pytestmark = pytest.mark.skipif(os.geteuid() == 0, reason="as root, uid 0's files are the user's own "
                                                           "(make test runs these as uid 65534)")
ROOTS_FILE = "/etc/passwd"  # root's, on every host


def test_runs_unprivileged():
    assert os.geteuid() != 0 and os.getegid() != 0 and 0 not in os.getgroups()


def test_a_secret_file_of_root_is_refused():
    assert os.stat(ROOTS_FILE).st_uid == 0
    with pytest.raises(ValueError, match=re.escape(f"owned by uid 0, not by the current user (uid {os.geteuid()})")):
        wire.read_private_file(ROOTS_FILE)


def test_our_symlink_to_a_file_of_root_is_refused(tmp_path):
    link = tmp_path / "secret"
    link.symlink_to(ROOTS_FILE)
    with pytest.raises(ValueError, match=re.escape(f"{link}: owned by uid 0")):
        wire.read_private_file(str(link))


def test_a_private_secret_file_of_ours_is_read_and_an_unreadable_one_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text("ab" * 16)
    path.chmod(0o600)
    assert wire.read_private_file(str(path)) == "ab" * 16
    path.chmod(0o000)  # root would read it anyway; we get EACCES, refused with the reason
    with pytest.raises(ValueError, match="cannot open it: Permission denied"):
        wire.read_private_file(str(path))
