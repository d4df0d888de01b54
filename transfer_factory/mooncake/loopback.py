"""Keep the Mooncake client's listening sockets on the address it is configured with: loopback when
it is configured for one host, its ``local_hostname`` when that is an address of this host.

Why this exists: Mooncake 0.3.13's transfer engine binds its listeners to the wildcard address
whatever ``local_hostname`` says.  The P2P handshake socket is bound to ``INADDR_ANY``
(``findAvailableTcpPort`` in ``transfer_metadata_plugin.cpp``) and the TCP transport's data
acceptor to ``[::]`` dual-stack (``TcpContext`` in ``tcp_transport_session_impl.h``); no flag or
variable changes either (``MC_TCP_BIND_ADDRESS`` only changes the address *advertised* in the
metadata, and only outside P2P mode).  The data port serves reads and writes of the registered
memory (the staging buffers, the mounted segment) to whoever connects, so on a single host it
must not face the network.

How: while a client runs ``setup`` (every listener is created inside it, on the calling thread,
which holds the GIL the replacement needs), ``loopback_binds(host)`` points the ``bind`` entry of
the import table (GOT) of every loaded Mooncake library at a function that turns a wildcard
address into ``host``; any other address passes unchanged, and a bind the function cannot
handle is refused (EADDRNOTAVAIL), never widened.  An IPv6 wildcard becomes ``::ffff:<host>`` for an IPv4 host, so a dual-stack
socket still accepts the IPv4 connections peers make to ``local_hostname``, or ``::1`` for an
IPv6 one.  The table is restored when ``setup`` returns.  Nothing else in the process is
touched: other libraries have their own import tables.

If the table cannot be patched (not Linux ELF64, an unknown architecture, a library without a
``bind`` import), ``loopback_binds`` logs a warning and Mooncake binds as it always does; the test
``tests/transfer_factory/mooncake/test_mooncake_faults.py::test_everything_listens_on_loopback_only``
reads ``/proc/net/tcp*`` and fails in that case.

A routable ``local_hostname`` (a multi-host pool): ``bind_address(host)`` is that address when it
is one of this host's (a test bind to it succeeds), and the same hook then turns the wildcard binds
into binds to it, so the client's handshake and data ports face only the network its peers reach
it on, not every interface (``test_mooncake_two_hosts.py`` reads the listeners on the two-host bed).
When the address is not this host's (a NAT or floating address advertised to peers), or a name that
does not resolve, nothing is rewritten and Mooncake binds every interface, with a warning.  What the
hook cannot change: the master's embedded HTTP metadata server (``--http-metadata``) binds 0.0.0.0,
and Mooncake picks its ports itself (no range to firewall by port: allow the peers' addresses).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import mmap
import os
import socket
import struct
import sys
import threading
from typing import Iterator

log = logging.getLogger(__name__)

# Relocation types that fill a GOT slot with a symbol's address: JUMP_SLOT, GLOB_DAT.
_GOT_RELOCS = {62: (7, 6), 183: (1026, 1025)}     # e_machine: x86_64, aarch64
_SHT_RELA = 4
_RTLD_DI_LINKMAP = 2
_PROT = {"r": mmap.PROT_READ, "w": mmap.PROT_WRITE, "x": mmap.PROT_EXEC}

_BIND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)


class _Guard:
    """The process-wide patch: how many setups hold it, the host, and the slots it replaced."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.host: str | None = None
        self.slots: list[tuple[int, int]] = []       # (GOT slot address, the pointer it held)


_guard = _Guard()


def loopback_address(host: str) -> str | None:
    """The loopback IP a client with this ``local_hostname`` should listen on, or None when the
    host is not loopback (then Mooncake binds as it always does: every interface)."""
    name = host.strip().strip("[]")
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        try:        # a name such as "localhost": the address its peers will reach it at
            addr = ipaddress.ip_address(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, ValueError, IndexError):
            return None
    return str(addr) if addr.is_loopback else None


def bind_address(host: str) -> str | None:
    """The address a client with this ``local_hostname`` should listen on: its loopback address
    (``loopback_address``), else the address it names when that is one of this host's; None when
    it names none of them (then Mooncake binds as it always does: every interface)."""
    lo = loopback_address(host)
    if lo is not None:
        return lo
    name = host.strip().strip("[]")
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, ValueError, IndexError):
            return None
    if addr.is_unspecified or addr.is_multicast:
        return None
    try:
        with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((str(addr), 0))
    except OSError:
        return None         # not an address of this host
    return str(addr)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


_offsets_cache: dict[tuple[str, str], list[int]] = {}


def _got_offsets(path: str, symbol: str) -> list[int]:
    """File-relative addresses (r_offset) of the GOT slots that hold ``symbol`` in an ELF64 object."""
    if (path, symbol) not in _offsets_cache:
        _offsets_cache[(path, symbol)] = _read_got_offsets(path, symbol)
    return _offsets_cache[(path, symbol)]


def _read_got_offsets(path: str, symbol: str) -> list[int]:
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 object")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in _GOT_RELOCS:
        raise ValueError(f"unsupported architecture {machine}")
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    wanted = _GOT_RELOCS[machine]
    out = []
    for _name, sh_type, _fl, _addr, off, size, link, _info, _al, entsize in sections:
        if sh_type != _SHT_RELA or not entsize:
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]]
        for r in range(off, off + size, entsize):
            r_offset, r_info, _addend = struct.unpack_from("<QQq", data, r)
            if r_info & 0xffffffff not in wanted:
                continue
            sym = symtab[4] + (r_info >> 32) * symtab[9]
            name_at = strtab[4] + struct.unpack_from("<I", data, sym)[0]
            if data[name_at:data.index(b"\0", name_at)].decode() == symbol:
                out.append(r_offset)
    return out


def _load_bias(path: str) -> int:
    """Where the dynamic loader put an already loaded object (its ``link_map.l_addr``)."""
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    lm = ctypes.c_void_p()
    if _libc().dlinfo(ctypes.c_void_p(handle), _RTLD_DI_LINKMAP, ctypes.byref(lm)) != 0:
        raise OSError("dlinfo failed")
    return ctypes.c_size_t.from_address(lm.value).value


def _mooncake_libraries() -> list[str]:
    """Loaded shared objects of the mooncake package (and its bundled .libs) that may bind."""
    spec_dirs = []
    mod = sys.modules.get("mooncake")
    for d in getattr(mod, "__path__", []) or []:
        spec_dirs.append(os.path.realpath(d))
        spec_dirs.append(os.path.realpath(d) + "_")   # e.g. mooncake_transfer_engine_non_cuda.libs
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                path = os.path.realpath(parts[5].strip())
                if any(path.startswith(d) for d in spec_dirs) and ".so" in os.path.basename(path):
                    paths.add(path)
    return sorted(paths)


def _page_perms(addr: int) -> int:
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split(None, 2)[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return sum(bit for ch, bit in _PROT.items() if ch in perms)
    raise OSError(f"address {addr:#x} is not mapped")


def _write_slot(addr: int, value: int) -> None:
    libc = _libc()
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = addr & ~(mmap.PAGESIZE - 1)
    perms = _page_perms(addr)
    if not perms & mmap.PROT_WRITE:
        if libc.mprotect(page, mmap.PAGESIZE, perms | mmap.PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
    ctypes.c_size_t.from_address(addr).value = value
    if not perms & mmap.PROT_WRITE:
        libc.mprotect(page, mmap.PAGESIZE, perms)


def _make_hook() -> tuple[object, int]:
    libc = _libc()
    real_bind = libc.bind
    real_bind.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)
    real_bind.restype = ctypes.c_int
    errno_location = libc.__errno_location
    errno_location.restype = ctypes.POINTER(ctypes.c_int)

    def hook(fd: int, addr: int, length: int) -> int:
        try:
            replaced = _loopback_sockaddr(addr, length)
        except Exception:       # never unwind into C, and never fall back to a wildcard bind
            log.exception("loopback bind hook: refusing the bind")
            errno_location()[0] = errno.EADDRNOTAVAIL
            return -1
        if replaced is not None:
            buf = ctypes.create_string_buffer(replaced, len(replaced))
            rc = real_bind(fd, ctypes.addressof(buf), len(replaced))
        else:
            rc = real_bind(fd, addr, length)
        if rc != 0:
            errno_location()[0] = ctypes.get_errno()   # the caller reads errno
        return rc

    callback = _BIND(hook)
    return callback, ctypes.cast(callback, ctypes.c_void_p).value


def _loopback_sockaddr(addr: int, length: int) -> bytes | None:
    """The sockaddr with a wildcard address replaced by the guarded host; None to keep it."""
    host = _guard.host
    if not addr or host is None or length < 8:
        return None
    raw = ctypes.string_at(addr, length)
    family = struct.unpack_from("=H", raw)[0]
    target = ipaddress.ip_address(host)
    if family == socket.AF_INET and length >= 16 and raw[4:8] == b"\0\0\0\0":
        if target.version != 4 and not target.is_loopback:
            raise ValueError(f"an IPv4 wildcard bind cannot go to {target}")   # refused, never widened
        v4 = target if target.version == 4 else ipaddress.ip_address("127.0.0.1")
        return raw[:4] + v4.packed + raw[8:]
    if family == socket.AF_INET6 and length >= 28 and raw[8:24] == b"\0" * 16:
        v6 = ipaddress.ip_address(f"::ffff:{target}") if target.version == 4 else target
        return raw[:8] + v6.packed + raw[24:]
    return None


_hook: tuple[object, int] | None = None     # kept for the life of the process: C may hold the pointer


@contextlib.contextmanager
def loopback_binds(host: str) -> Iterator[bool]:
    """While active, wildcard binds in Mooncake's libraries go to ``host`` (an IP, from
    ``loopback_address`` or ``bind_address``).  Yields whether the guard is in place.  Nested or
    concurrent uses share one patch, removed when the last one ends."""
    addr = str(ipaddress.ip_address(host.strip("[]")))
    with _guard.lock:
        if _guard.depth:
            if _guard.host != addr:
                log.warning("mooncake loopback binds: %s already guarded, not %s", _guard.host, addr)
        else:
            _guard.host = addr
            _install()
        _guard.depth += 1
        installed = bool(_guard.slots)
    try:
        yield installed
    finally:
        with _guard.lock:
            _guard.depth -= 1
            if not _guard.depth:
                _restore()
                _guard.host = None


def _install() -> None:
    global _hook
    try:
        if _hook is None:
            _hook = _make_hook()
        for path in _mooncake_libraries():
            offsets = _got_offsets(path, "bind")
            if not offsets:
                continue
            bias = _load_bias(path)
            for off in offsets:
                slot = bias + off
                old = ctypes.c_size_t.from_address(slot).value
                _write_slot(slot, _hook[1])
                _guard.slots.append((slot, old))
    except (OSError, ValueError, AttributeError) as e:
        log.warning("mooncake loopback binds unavailable (%s): its listeners bind all interfaces", e)
        _restore()
    if not _guard.slots:
        log.warning("mooncake loopback binds: no bind import patched in the mooncake libraries")


def _restore() -> None:
    for slot, old in reversed(_guard.slots):
        _write_slot(slot, old)
    _guard.slots = []
