"""Connections handed to the least busy worker: ``orchestrator.serve``'s accept path.

With one listening socket shared by K workers the kernel wakes every worker for each new
connection and the first to run takes all that are queued (asyncio accepts up to the backlog
per wakeup): a burst of connections lands on two or three workers, whose event loops and
codec threads then carry several times the share of the others.  Here the master accepts
every connection itself and hands it, over a Unix ``SOCK_SEQPACKET`` pair per worker
(``SCM_RIGHTS``), to the serving worker that holds the fewest live connections:

- ``Dispatcher`` (the master, one thread): listens, accepts, and counts each worker's live
  connections exactly: +1 for each connection handed over, -1 for each ``c`` the worker sends
  back when one ends.  A worker is handed connections once it says ``r`` (its application
  started); a worker whose channel ends (it exited, or is shutting down) is handed no more,
  and a replacement starts with a fresh channel and a count of 0.  While no worker is
  serving, connections wait in the listen backlog.
- ``serve_worker`` (each worker): hypercorn's ASGI lifespan and its per-connection
  ``TCPServer`` (HTTP/1.1, HTTP/2 over ALPN, websockets), fed by the channel instead of an
  ``accept``.  It also holds a copy of every listening socket and never accepts on it: the
  application reads its bind addresses from those (``frontend/listeners.py``), and closing
  them when shutdown begins is what starts its drain, as with hypercorn's own worker.

TLS is done by the worker (``connect_accepted_socket(ssl=...)``), so certificates and
handshakes stay where they were.  QUIC (``--quic-bind``) is not handed over: serve.py keeps
hypercorn's shared-socket workers for it.  hypercorn internals used (written against 0.18;
pyproject allows >= 0.16, whose signatures have not been checked):
``asyncio.tcp_server.TCPServer``, ``asyncio.lifespan.Lifespan``,
``asyncio.worker_context.WorkerContext``, ``asyncio.statsd.StatsdLogger``,
``utils.load_application``.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import random
import selectors
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("orchestrator.serve")

READY = b"r"  # worker -> master: the application has started; hand me connections
TAKEN = b"t"  # worker -> master, once per connection received (in order)
CLOSED = b"c"  # worker -> master, once per connection that ended
SECURE = b"s"  # master -> worker with one fd: accepted on a TLS listener
PLAIN = b"p"  # master -> worker with one fd: accepted on a plain listener
ACCEPT_BATCH = 64  # connections accepted per wakeup before the workers' messages are read
SHUTDOWN_POLL_S = 0.1
PENDING_RETRY_S = 0.01  # how soon the master tries again to hand connections kept back
# A record on a channel: the worker sends at most this many bytes of TAKEN/CLOSED at once and
# the master reads up to it (a SEQPACKET read shorter than the record drops the rest).
MAX_RECORD_BYTES = 4096
READ_LIMIT = 2**16  # the StreamReader's buffer limit, as asyncio.start_server's default


class _Slot:
    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.live = 0
        self.ready = False
        # Handed over and not yet taken: the master keeps its copy until the worker says
        # TAKEN, and hands them to another worker if this one's channel ends first (a worker
        # killed with connections still in its channel).  Untaken, nothing has read them.
        self.untaken: collections.deque[tuple[socket.socket, bool]] = collections.deque()


class Dispatcher:
    """The master's accept loop (a thread).  ``listeners``: (socket, is TLS) pairs, bound;
    they are listened on at once, so that a client that comes before the first worker is
    serving waits in the backlog."""

    def __init__(self, listeners: list[tuple[socket.socket, bool]], backlog: int) -> None:
        self._listeners = listeners
        for sock, _ in listeners:
            sock.listen(backlog)
            sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._accepting = False
        self._stopped = False
        self._turn = 0  # rotates the choice between equally loaded workers
        # Accepted connections no worker could take yet (every channel full, or no worker
        # serving): accepting pauses while any wait, so new clients wait in the backlog.
        self._pending: collections.deque[tuple[socket.socket, bool]] = collections.deque()
        self.handed = 0
        self.failed = False  # the accept thread raised: the master stops the server
        self._thread = threading.Thread(target=self._run, name="orchestrator-handoff", daemon=True)

    # The master's main thread ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def attach(self, slot: int) -> socket.socket:
        """A fresh channel for the worker about to start in ``slot``; the returned end is the
        worker's (close it here once the process has started)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self._call(lambda: self._attach(slot, ours))
        return theirs

    def detach(self, slot: int) -> None:
        """The worker of ``slot`` has exited: the connections it had not taken yet go to the
        others."""
        self._call(lambda: self._gone(slot))

    def stop_accepting(self) -> None:
        """Stop handing out connections (shutdown); safe from a signal handler."""
        self._stopped = True
        self._wake()

    def join(self, timeout: float = 5.0) -> None:
        self.stop_accepting()
        self._thread.join(timeout)

    def live(self) -> dict[int, int]:
        return {slot: s.live for slot, s in self._slots.items()}

    def _call(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or stopped

    # The dispatcher thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                # While connections wait for a worker's channel to drain, look again soon.
                for key, _ in self._selector.select(PENDING_RETRY_S if self._pending else None):
                    if key.data is None:
                        self._run_commands()
                    elif key.data[0] == "listener":
                        self._accept(key.fileobj, key.data[1])  # type: ignore[arg-type]
                    else:
                        self._from_worker(key.data[1])
                    if self._stopped:
                        break
                self._hand_pending()
        except Exception:  # noqa: BLE001 - the server cannot accept any more: say so, loudly
            log.exception("the accept thread failed; stopping the server")
            self.failed = True
        finally:
            self._stopped = True
            self._set_accepting(False)
            for slot in list(self._slots):
                self._gone(slot)
            while self._pending:
                self._pending.popleft()[0].close()
            for sock, _ in self._listeners:
                sock.close()  # with the workers' copies closed at shutdown, new clients are refused

    def _run_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            commands, self._commands = self._commands, []
        for command in commands:
            command()

    def _attach(self, slot: int, channel: socket.socket) -> None:
        self._gone(slot)
        self._slots[slot] = _Slot(channel)
        self._selector.register(channel, selectors.EVENT_READ, ("worker", slot))

    def _gone(self, slot: int) -> None:
        state = self._slots.pop(slot, None)
        if state is None:
            return
        self._selector.unregister(state.channel)
        state.channel.close()
        self._update_accepting()
        for conn, secure in state.untaken:
            if self._stopped:
                conn.close()
            else:
                self._hand(conn, secure)

    def _from_worker(self, slot: int) -> None:
        state = self._slots.get(slot)
        if state is None:
            return
        while True:
            try:
                message = state.channel.recv(MAX_RECORD_BYTES)
            except BlockingIOError:
                return
            except OSError:
                message = b""
            if not message:  # the worker closed its end: it is shutting down or gone
                self._gone(slot)
                return
            state.live -= message.count(CLOSED)
            for _ in range(message.count(TAKEN)):
                if state.untaken:
                    state.untaken.popleft()[0].close()
            if READY in message and not state.ready:
                state.ready = True
                self._update_accepting()

    def _update_accepting(self) -> None:
        self._set_accepting(not self._stopped and not self._pending and any(s.ready for s in self._slots.values()))

    def _set_accepting(self, on: bool) -> None:
        if on == self._accepting:
            return
        self._accepting = on
        for sock, secure in self._listeners:
            if on:
                self._selector.register(sock, selectors.EVENT_READ, ("listener", secure))
            else:
                self._selector.unregister(sock)

    def _accept(self, listener: socket.socket, secure: bool) -> None:
        for _ in range(ACCEPT_BATCH):
            if not self._accepting:
                return
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:  # EMFILE and the like: leave it queued, try again shortly
                log.error("accept failed: %s", exc)
                self._selector.select(0.05)
                return
            self._hand(conn, secure)

    def _hand(self, conn: socket.socket, secure: bool) -> None:
        """Hand ``conn`` to the least busy worker that can take it now; if none can (every
        channel full, or no worker serving), keep it until one can and stop accepting."""
        if self._pending or not self._try_hand(conn, secure):
            self._pending.append((conn, secure))
            self._set_accepting(False)

    def _hand_pending(self) -> None:
        """The connections kept back, in order, as far as the workers take them."""
        while self._pending and not self._stopped:
            conn, secure = self._pending[0]
            if not self._try_hand(conn, secure):
                return
            self._pending.popleft()
        self._update_accepting()

    def _try_hand(self, conn: socket.socket, secure: bool) -> bool:
        tried: set[int] = set()
        while True:
            slot = self._choose(tried)
            if slot is None:
                return False
            state = self._slots[slot]
            try:
                socket.send_fds(state.channel, [SECURE if secure else PLAIN], [conn.fileno()], socket.MSG_DONTWAIT)
            except BlockingIOError:  # the worker's channel is full: it is not reading now
                tried.add(slot)
                continue
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ECONNREFUSED):
                    log.error("handing a connection to worker slot %d failed: %s", slot, exc)
                tried.add(slot)
                self._gone(slot)
                continue
            state.live += 1
            state.untaken.append((conn, secure))
            self.handed += 1
            return True

    def _choose(self, exclude: set[int]) -> int | None:
        """The serving worker with the fewest live connections (ties: in turn)."""
        candidates = [slot for slot, s in self._slots.items() if s.ready and slot not in exclude]
        if not candidates:
            return None
        self._turn += 1
        n = max(self._slots) + 1
        return min(candidates, key=lambda slot: (self._slots[slot].live, (slot - self._turn) % n))


# The worker ---------------------------------------------------------------------------------


def serve_worker(config: Any, sockets: Any, shutdown_event: Any, channel: socket.socket,
                 worker_class: str = "asyncio") -> None:
    """A worker process (``multiprocessing`` target): serve the connections handed over
    ``channel`` until ``shutdown_event`` is set, the master goes away (the channel ends), or
    ``--max-requests`` is reached."""
    from hypercorn.utils import load_application

    app = load_application(config.application_path, config.wsgi_max_body_size)
    loop_factory = None
    if worker_class == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(debug=config.debug, loop_factory=loop_factory) as runner:
        runner.get_loop().set_exception_handler(_quiet_tls_failures)
        runner.run(_serve(app, config, sockets, shutdown_event, channel))


def _quiet_tls_failures(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if isinstance(context.get("exception"), ssl.SSLError):
        return  # a client's failed handshake
    loop.default_exception_handler(context)


def _address(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_INET6:
        return f"[{name[0]}]:{name[1]}"
    if sock.family == socket.AF_INET:
        return f"{name[0]}:{name[1]}"
    return f"unix:{name}"


async def _serve(app: Any, config: Any, sockets: Any, shutdown_event: Any, channel: socket.socket) -> None:
    from hypercorn.asyncio.lifespan import Lifespan
    from hypercorn.asyncio.statsd import StatsdLogger
    from hypercorn.asyncio.tcp_server import TCPServer
    from hypercorn.asyncio.worker_context import WorkerContext

    config.set_statsd_logger_class(StatsdLogger)
    loop = asyncio.get_running_loop()
    state: dict[str, Any] = {}
    lifespan = Lifespan(app, config, loop, state)
    lifespan_task = loop.create_task(lifespan.handle_lifespan())
    await lifespan.wait_for_startup()
    if lifespan_task.done() and lifespan_task.exception() is not None:
        raise lifespan_task.exception()  # type: ignore[misc]

    ssl_context = config.create_ssl_context() if config.ssl_enabled else None
    max_requests = None
    if config.max_requests is not None:
        max_requests = config.max_requests + random.randint(0, config.max_requests_jitter)
    context = WorkerContext(max_requests)
    connections: set[asyncio.Task] = set()
    master_gone = asyncio.Event()
    unsent = bytearray()  # TAKEN and CLOSED the master has not been told yet

    def tell_master(what: bytes = b"") -> None:
        unsent.extend(what)
        while unsent and channel.fileno() >= 0:
            try:
                sent = channel.send(bytes(unsent[:MAX_RECORD_BYTES]), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return  # sent with the next one (or by the poll below)
            except OSError:
                master_gone.set()
                return
            del unsent[:sent]

    async def handle(sock: socket.socket, secure: bool) -> None:
        try:
            reader = asyncio.StreamReader(limit=READ_LIMIT, loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            if secure:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, sock, ssl=ssl_context, ssl_handshake_timeout=config.ssl_handshake_timeout)
            else:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await TCPServer(app, loop, config, context, state, reader, writer)
        except (OSError, ssl.SSLError, asyncio.TimeoutError):
            sock.close()  # a failed TLS handshake, a client already gone
        finally:
            tell_master(CLOSED)

    def on_channel() -> None:
        taken = 0
        try:
            while True:
                try:
                    message, fds, _, _ = socket.recv_fds(channel, 16, 4)
                except BlockingIOError:
                    return
                except OSError:
                    message, fds = b"", []
                if not message and not fds:
                    loop.remove_reader(channel.fileno())
                    master_gone.set()
                    return
                # One record per connection handed over: TAKEN for each, fd or not (a record
                # whose fd did not arrive, say at the process's file limit, is a connection
                # lost here: the master is told it both taken and ended, so that neither its
                # copy nor its count of this worker's connections stays behind).
                taken += 1
                if not fds:
                    log.error("a connection handed to this worker did not arrive (no file descriptor: is the "
                              "process's open-file limit reached?)")
                    tell_master(CLOSED)
                for fd in fds:
                    sock = socket.socket(fileno=fd)
                    task = loop.create_task(handle(sock, message[:1] == SECURE))
                    connections.add(task)
                    task.add_done_callback(connections.discard)
        finally:
            # Said before any task reads from its socket: the master drops its copies.
            tell_master(TAKEN * taken)

    secure_listeners = list(sockets.secure_sockets)
    plain_listeners = list(sockets.insecure_sockets)
    for sock in secure_listeners:
        await config.log.info(f"Running on https://{_address(sock)} (CTRL + C to quit)")
    for sock in plain_listeners:
        await config.log.info(f"Running on http://{_address(sock)} (CTRL + C to quit)")
    channel.setblocking(False)
    loop.add_reader(channel.fileno(), on_channel)
    try:
        channel.send(READY)
    except OSError:
        master_gone.set()

    try:
        while not (shutdown_event.is_set() or master_gone.is_set() or context.terminate.is_set()):
            await asyncio.sleep(SHUTDOWN_POLL_S)
            tell_master()
    finally:
        await context.terminated.set()
        # No more connections: the master sees the channel end.  Then close the listener
        # copies: the application starts its drain when they go (frontend/listeners.py).
        if not master_gone.is_set():
            loop.remove_reader(channel.fileno())
            # Every TAKEN out before the channel ends: the master hands a connection it thinks
            # untaken to another worker when this one's channel ends.
            channel.settimeout(1.0)
            try:
                while unsent:
                    del unsent[:channel.send(bytes(unsent[:MAX_RECORD_BYTES]))]
            except OSError:
                pass  # the master is gone, or not reading: it stops the server either way
        channel.close()
        for sock in [*secure_listeners, *plain_listeners]:
            sock.close()
        if connections:
            _, pending = await asyncio.wait(set(connections), timeout=config.graceful_timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        await lifespan.wait_for_shutdown()
        lifespan_task.cancel()
        try:
            await lifespan_task
        except asyncio.CancelledError:
            pass
