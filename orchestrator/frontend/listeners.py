"""The server's own listening sockets: where it is bound, and when it stops listening.

An ASGI app is not told its bind address, and under ``hypercorn`` it is not told about a
SIGTERM either (the signal goes to hypercorn's parent process, whose worker closes its
listeners, waits ``--graceful-timeout`` for open connections, cancels them, and only then
runs the app's shutdown hooks).  Both facts can be read from the process itself: by the
time the app's startup hook runs, hypercorn has created (or inherited) its listening
sockets, so

- ``find_listeners()`` lists the bound, unconnected stream sockets of this process (the
  server's listeners; hypercorn binds them before the startup hook and calls ``listen`` right
  after it), with their addresses: the bind address, whatever way it was given (``--bind``,
  a config file, socket activation);
- ``ListenerWatch.closed()`` says whether those sockets are gone: the first step of every
  graceful shutdown, and the moment to start draining sessions, while hypercorn still
  waits for them.

Linux (``/proc/self/fd``) and other systems with ``/dev/fd``; elsewhere nothing is found and
callers fall back to the ``PERSONAPLEX_BIND`` setting.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listener:
    fd: int
    inode: int  # identifies the socket behind ``fd`` (a reused fd number has another one)
    family: int
    address: str  # host of an AF_INET/AF_INET6 socket, or the path of an AF_UNIX one
    port: int | None

    @property
    def local(self) -> bool:
        return self.family == socket.AF_UNIX or is_loopback(self.address)

    def __str__(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.address}"
        host = f"[{self.address}]" if self.family == socket.AF_INET6 else self.address
        return f"{host}:{self.port}"


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost``; wildcards (0.0.0.0, ::) are public."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bind_host(bind: str) -> str:
    """The host part of a hypercorn-style bind (``host:port``, ``[v6]:port``, ``unix:path``)."""
    if bind.startswith("unix:"):
        return "localhost"  # a Unix socket is reachable only from this machine
    if bind.startswith("fd://"):
        return ""  # unknown: the socket is inspected instead
    if bind.startswith("["):
        return bind[1:].split("]")[0]
    host, sep, port = bind.rpartition(":")
    return host if sep and port.isdigit() else bind


def _fd_dir() -> str | None:
    for path in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(path):
            return path
    return None


def find_listeners() -> list[Listener]:
    """The bound, unconnected TCP and Unix stream sockets of this process: its listeners
    (empty if none can be seen)."""
    fd_dir = _fd_dir()
    if fd_dir is None:
        return []
    found = []
    for name in os.listdir(fd_dir):
        if not name.isdigit():
            continue
        listener = _inspect(int(name))
        if listener is not None:
            found.append(listener)
    return sorted(found, key=lambda item: item.fd)


def _inspect(fd: int) -> Listener | None:
    try:
        stat = os.fstat(fd)
    except OSError:
        return None
    if stat.st_mode & 0o170000 != 0o140000:  # not S_IFSOCK
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            return None
        if sock.type != socket.SOCK_STREAM or _connected(sock):
            return None
        name = sock.getsockname()
        if sock.family == socket.AF_UNIX:
            address = name if isinstance(name, str) else name.decode("utf-8", "replace")
            return Listener(fd, stat.st_ino, sock.family, address, None) if address else None
        return Listener(fd, stat.st_ino, sock.family, name[0], name[1]) if name[1] else None
    except OSError:
        return None
    finally:
        sock.detach()  # the fd belongs to the server: never close it here


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


class ListenerWatch:
    """Remembers the listeners seen at start-up; ``closed()`` once any of them is gone."""

    def __init__(self, listeners: list[Listener]) -> None:
        self.listeners = listeners

    def closed(self) -> bool:
        for listener in self.listeners:
            try:
                if os.fstat(listener.fd).st_ino != listener.inode:
                    return True
            except OSError:
                return True
        return False
