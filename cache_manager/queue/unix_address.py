"""FastDeploy's Unix-socket queue address, ``/dev/shm/fd_task_queue_<port>.sock``, made safe.

FastDeploy (``FD_ENGINE_TASK_QUEUE_WITH_SHM=1``) gives the engine's cache queue that path, and its
CTMs derive it from ``--cache_queue_port``.  ``/dev/shm`` is writable by every local user (DESIGN
§4: they are untrusted): one can create the name first (the engine then cannot bind it) or, after
the engine's socket went, put a listener of their own there for the CTMs to talk to.  A symlink
from there to a private place would not help: its target can only be checked, then followed, and
a name in a sticky directory belongs to whoever made it first.

So the requested path is only a **name**: nothing is created at it, nothing there is ever opened
or connected to.  The queue listens in its own private directory (0700, ours, fresh from
``mkdtemp``: the one that holds its secret file, ``CTM_QUEUE_SECRET_FILE``), on a socket named as
the requested path's last component.  Handles in the engine's process find the server by the name
(``engine_hooks.fastdeploy.queue``); a CTM maps ``--cache_queue_port N`` to
``fd_task_queue_N.sock`` as FastDeploy does and looks for it in the directory of the secret file it
was handed, which it checks is a private directory of its own uid (``ctm_queue_endpoint``).
"""
from __future__ import annotations

import logging
import os
import re
import stat
from typing import Mapping

from cache_manager.queue.wire import SECRET_ENV, SECRET_FILE_ENV  # the file's directory holds the socket

logger = logging.getLogger(__name__)

SHM_QUEUE_ENV = "FD_ENGINE_TASK_QUEUE_WITH_SHM"  # FastDeploy's switch: "0" TCP, "1" the Unix socket
FD_SOCKET_NAME = "fd_task_queue_{port}.sock"
FD_SOCKET_DIR = "/dev/shm"
_FD_NAME_RE = re.compile(r"^fd_task_queue_([0-9]{1,5})\.sock$")
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL


def fastdeploy_queue_path(port: int) -> str:
    """The address FastDeploy gives a queue on ``port`` when ``FD_ENGINE_TASK_QUEUE_WITH_SHM`` is on."""
    return os.path.join(FD_SOCKET_DIR, FD_SOCKET_NAME.format(port=int(port)))


def socket_name(address: str) -> str:
    """The last component of a Unix-socket queue ``address``; ``ValueError`` unless it is FastDeploy's
    ``fd_task_queue_<port>.sock`` (CTMs find the socket from ``--cache_queue_port`` by that name)."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"Unix-socket queue address {address!r} must be a non-empty path")
    name = os.path.basename(address)
    match = _FD_NAME_RE.match(name)
    if match is None or not 0 < int(match.group(1)) < 65536:
        raise ValueError(f"Unix-socket queue address {address!r} must end in fd_task_queue_<port>.sock, as "
                         "FastDeploy names it, so that CTMs launched with --cache_queue_port <port> find it")
    return name


def private_dir_problem(path: str) -> str | None:
    """Why ``path`` is not a private directory of ours (a real directory, not a symlink, of this
    process's effective uid, with no access for group or others), or None if it is."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"{path!r} cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path!r} is not a directory (mode {info.st_mode:o})"
    if info.st_uid != os.geteuid():
        return f"{path!r} belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}"
    if info.st_mode & 0o077:
        return f"{path!r} has mode {stat.S_IMODE(info.st_mode):o}: others can reach into it (0700 is needed)"
    return None


def private_socket_path(address: str, directory: str) -> str:
    """Where the queue asked for at ``address`` listens: ``<directory>/<its last component>``, with
    ``directory`` private and ours (else ``PermissionError`` saying why)."""
    name = socket_name(address)
    problem = private_dir_problem(directory)
    if problem:
        raise PermissionError(f"the queue's socket directory {problem}")
    path = os.path.join(directory, name)
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"Unix socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes: set TMPDIR (or "
                         "XDG_RUNTIME_DIR) to a shorter directory")
    return path


def note_requested_path(address: str) -> None:
    """Log what is at the requested path, which is never used: a squatter is worth an operator's look."""
    try:
        info = os.lstat(address)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.warning("queue address %s cannot be inspected (%s); it is not used either way", address, exc.strerror)
        return
    who = "this user" if info.st_uid == os.geteuid() else f"uid {info.st_uid}, another user"
    logger.warning("queue address %s already exists (mode %o, owned by %s); it is never opened or connected to: "
                   "the queue listens in a private directory instead", address, info.st_mode, who)


def ctm_queue_endpoint(pod_ip: str, port: int, environ: Mapping[str, str] | None = None) -> str:
    """The zmq endpoint a CTM launched with ``--pod_ip`` and ``--cache_queue_port`` joins.

    As FastDeploy's CTM: with ``FD_ENGINE_TASK_QUEUE_WITH_SHM=0`` the TCP port; otherwise the engine's
    Unix socket ``fd_task_queue_<port>.sock`` where this project's façade puts it, beside the secret
    file (a private directory of ours).  ``=1`` requires that socket (``FileNotFoundError`` naming
    where it was looked for); unset, a CTM without one joins the TCP port (this project's own
    engines, whose queues are TCP).  FastDeploy's ``/dev/shm`` path itself is never used."""
    env = os.environ if environ is None else environ
    tcp = f"tcp://{pod_ip}:{int(port)}"
    mode = env.get(SHM_QUEUE_ENV, "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"{SHM_QUEUE_ENV}={mode!r} must be 0 or 1")
    if mode == "0":
        return tcp
    name = FD_SOCKET_NAME.format(port=int(port))
    secret_file = None if env.get(SECRET_ENV) else env.get(SECRET_FILE_ENV)  # the secret this CTM will use
    where = os.path.dirname(os.path.abspath(secret_file)) if secret_file else None
    problem = private_dir_problem(where) if where else f"the secret is not read from a file ({SECRET_FILE_ENV}), " \
                                                        "whose directory would hold the queue's socket"
    path = os.path.join(where, name) if where else name
    if problem is None:
        try:
            info = os.lstat(path)
            if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
                problem = f"{path!r} is not a socket of uid {os.geteuid()} (mode {info.st_mode:o}, uid {info.st_uid})"
        except FileNotFoundError:
            problem = f"there is no {path!r}"
    if problem is None:
        return f"ipc://{path}"
    if mode == "1":
        raise FileNotFoundError(f"{SHM_QUEUE_ENV}=1 but the engine's queue socket {name} is not to be found: "
                                f"{problem}.  The engine's EngineCacheQueue (engine_hooks.fastdeploy_queue) "
                                f"serves it beside the secret file it hands its CTMs; {fastdeploy_queue_path(port)} "
                                "is never used")
    return tcp
