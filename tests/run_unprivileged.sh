#!/usr/bin/env bash
# `make test`'s second run: the tests marked `permissions` (tests/conftest.py) as uid/gid 65534
# (nobody), no supplementary groups, a fresh world-writable TMPDIR and HOME.  As root, ownership
# and mode checks are easy to get wrong unseen (root reads a 0600 file of anyone); as nobody the
# checks meet a real other user (root) and real EACCES.  Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN_AS=${RUN_AS:-65534}
if [ "$(id -u)" != 0 ]; then
    echo "run_unprivileged: not root (uid $(id -u)): the permission tests already ran unprivileged"
    exit 0
fi
tmp=$(mktemp -d /tmp/ctm-unprivileged.XXXXXX)
chmod 1777 "$tmp"
trap 'rm -rf "$tmp"' EXIT
drop=(setpriv --reuid="$RUN_AS" --regid="$RUN_AS" --clear-groups
      env -i PATH="$PATH" HOME="$tmp" TMPDIR="$tmp" LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1)
pytest=("$PY" -m pytest -q -m permissions -p no:cacheprovider "$@")
if "${drop[@]}" "$PY" -c pass 2>/dev/null; then
    exec "${drop[@]}" "${pytest[@]}"
fi
# The interpreter lies under a directory that uid $RUN_AS cannot enter (a pyenv under /root, mode
# 0700).  In a private mount namespace (this run only; nothing on the host changes), lay a 0755
# tmpfs over that directory and bind the interpreter's prefix back into it.
prefix=$("$PY" -c 'import os, sys; print(os.path.realpath(sys.base_prefix))')
blocked=""
dir=""
IFS=/ read -ra parts <<< "${prefix#/}"
for part in "${parts[@]}"; do
    dir="$dir/$part"
    if ! setpriv --reuid="$RUN_AS" --regid="$RUN_AS" --clear-groups test -x "$dir"; then
        blocked=$dir
        break
    fi
done
if [ -z "$blocked" ]; then
    echo "run_unprivileged: uid $RUN_AS cannot run $PY, and no directory on $prefix is the reason" >&2
    exit 1
fi
export prefix blocked tmp
exec unshare --mount --propagation private bash -c '
    set -e
    mkdir -p "$tmp/.python"
    mount --bind "$prefix" "$tmp/.python"
    mount -t tmpfs -o mode=0755 tmpfs "$blocked"
    mkdir -p "$prefix"
    mount --bind "$tmp/.python" "$prefix"
    exec "$@"' unprivileged "${drop[@]}" "${pytest[@]}"
