"""The CPU actor's side of the channel: one thread answers every client on one ZeroMQ ROUTER socket.

A single loop, no threads: it serves posted shared-memory slots first, spins a bounded while on them,
then sleeps in one ``zmq.poll`` on the socket and every client's doorbell pipe. Any request it refuses
gets an error reply and the loop goes on; only a ``Shutdown`` message (or ``close``) ends it. Where the
server has the shard's kernels as C functions (``kernels``), compiled code answers the slots' requests
and spins on them (``answer``); Python takes whatever that code leaves to it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq

from splitspec.config import ChannelConfig
from splitspec.protocol.answer import KERNEL, PYTHON, SlotAnswers
from splitspec.protocol.answer import warm as warm_answers
from splitspec.protocol.curve import Gatekeeper
from splitspec.protocol.messages import (
    Bye,
    Compute,
    Error,
    ErrorCode,
    GroupShard,
    Hello,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Result,
    ShardInfo,
    Shutdown,
    Welcome,
    decode,
    encode,
    request_tokens,
    shards_from_wire,
    shards_to_wire,
)
from splitspec.protocol.records import pack_reply, unpack_compute
from splitspec.protocol.shm import (
    HEADER_BYTES,
    ORDERED_STORES,
    REQUEST,
    RESULT,
    ShmEndpoint,
    SlotLayout,
    host_id,
)
from splitspec.protocol.sockets import make_socket

ComputeFn = Callable[[int, str, np.ndarray, np.ndarray], None]
"""``compute(layer, group, x[n, d_in], out[n, rows])`` writes this actor's rows of R·x into ``out``."""

_IDLE_POLL_MS = 1000
_SOCKET_CHECK_S = 50e-6
_NOTHING, _SLOTS, _SOCKET = 0, 1, 2
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_MAX_ERROR_TEXT = 400


@dataclass
class _Session:
    hello: Hello
    shm: ShmEndpoint | None
    answers: SlotAnswers | None = None  # a shared-memory session's: its served count, its compiled answers


@dataclass
class _Stats:
    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    errors: int = 0
    compute_s: float = 0.0
    compiled: list[int | float] = field(default_factory=lambda: [0, 0.0, 0])  # closed sessions' compiled answers


class Server:
    """Bind ``endpoint`` (``tcp://host:0`` picks a free port; read it back from ``.endpoint``) and serve.

    ``kernels``: int64 [layers, groups in ``info.shards`` order, ``answer.KERNEL``], the C function per (layer,
    group) that compiled code calls to answer a slot's request (``ResidualShard.slot_kernels``); a zero row,
    or None for all, leaves those requests to ``compute`` in Python."""

    def __init__(
        self,
        info: ShardInfo,
        compute: ComputeFn,
        config: ChannelConfig | None = None,
        endpoint: str | None = None,
        kernels: np.ndarray | None = None,
    ) -> None:
        self._info = info
        self._compute = compute
        shape = (info.num_layers, len(info.shards), KERNEL)
        if kernels is not None and (kernels.shape != shape or kernels.dtype != np.int64):
            raise ValueError(f"kernels must be int64 {list(shape)}, got {kernels.dtype} {list(kernels.shape)}")
        self._kernels = kernels if kernels is not None else np.zeros(shape, np.int64)
        warm_answers()
        self._config = config or ChannelConfig()
        self._spin_s = self._config.spin_us * 1e-6 if ORDERED_STORES else 0.0
        self._host_id = host_id()
        self._context = zmq.Context()
        keys = self._config.curve
        self._gatekeeper = Gatekeeper(self._context, keys) if keys is not None else None
        self._socket = make_socket(self._context, zmq.ROUTER, self._config)
        try:
            self._socket.bind(endpoint or self._config.endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(
                f"cannot bind {endpoint or self._config.endpoint}: {exc}; is another CPU actor running there?"
            ) from exc
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        if self._gatekeeper is not None:
            self._poller.register(self._gatekeeper.socket, zmq.POLLIN)
        self._sessions: dict[bytes, _Session] = {}
        self._slot_sessions: list[tuple[bytes, _Session]] = []  # the ones on shared memory, for the hot loop
        self._attaching: dict[bytes, float] = {}  # shared-memory sessions not yet seen attached: their deadlines
        self._by_fd: dict[int, bytes] = {}
        self._stats = _Stats()
        self._running = False

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve_forever(self) -> None:
        """Answer requests until a client sends ``Shutdown``."""
        self._running = True
        while self._running:
            if self._attaching:
                self._drop_unattached()
            if self._serve_slots():
                continue
            woken = self._spin()
            if woken == _SLOTS:
                continue
            for target, _ in self._poller.poll(0 if woken == _SOCKET else _IDLE_POLL_MS):
                if target is self._socket:
                    self._serve_socket()
                elif self._gatekeeper is not None and target is self._gatekeeper.socket:
                    self._gatekeeper.answer()
                elif target in self._by_fd and self._sessions[self._by_fd[target]].shm.request_bell.drain():
                    self._drop(self._by_fd[target])  # the client is gone: its pipe hung up

    def close(self) -> None:
        for identity in list(self._sessions):
            self._drop(identity)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._socket.close()
        if self._gatekeeper is not None:
            self._gatekeeper.close()
        self._context.term()

    def _drop_unattached(self) -> None:
        """A client deletes its slots' directory once it has attached them (``ShmEndpoint``). Slots whose
        directory outlives the connect timeout have no client that will attach them (it gave up before the
        welcome came, or connected again under a new identity), and nothing else would end them: their
        doorbell reports a hang-up only after a writer came and went. The directory is looked at only once
        the deadline has passed: until then the loop pays a clock read a turn."""
        now = time.monotonic()
        for identity, deadline in list(self._attaching.items()):
            if now < deadline:
                continue
            if os.path.isdir(self._sessions[identity].shm.directory):
                self._drop(identity)
            else:
                del self._attaching[identity]

    def _spin(self) -> int:
        """Watch the slots' counters a bounded while, cheaper than a wake-up when requests come in a burst,
        answering in compiled code what it can (a request answered starts the while anew); says which has
        work left. The socket is looked at every ``_SOCKET_CHECK_S`` only (asking ZeroMQ costs ~4 µs here,
        ten times a slot check), so a tcp or control client waits that long at most. With one session,
        compiled code spins up to each socket check; with more, each turn only answers what is posted."""
        sessions = self._slot_sessions
        if not sessions or not self._spin_s:
            return _NOTHING
        spin_ns, check_ns = int(self._spin_s * 1e9), int(_SOCKET_CHECK_S * 1e9)
        now = time.perf_counter_ns()  # CLOCK_MONOTONIC, as the compiled spin reads it
        spin_until, check_socket = now + spin_ns, now + check_ns
        while now < spin_until:
            for _, session in sessions:
                answers = session.answers
                before = answers.served
                if answers.serve(min(check_socket, spin_until) if len(sessions) == 1 else 0) == PYTHON:
                    return _SLOTS
                if answers.served != before:
                    spin_until = time.perf_counter_ns() + spin_ns
            now = time.perf_counter_ns()
            if now >= check_socket:
                if self._socket.getsockopt(_EVENTS) & _POLLIN:
                    return _SOCKET
                check_socket = now + check_ns
            if len(sessions) > 1:
                os.sched_yield()  # a thread sharing this core (ZeroMQ's I/O thread, a peer) runs at once
                now = time.perf_counter_ns()
        return _NOTHING

    def _serve_slots(self) -> bool:
        served = False
        for identity, session in self._slot_sessions:
            arena, answers = session.shm.arena, session.answers
            start = answers.served
            while answers.serve(0) == PYTHON:  # compiled code answers what it can, Python the next one
                slots = arena.layout.slots
                ahead, slot = int(arena.posted[0]) - answers.served, int(arena.ring[answers.served % slots])
                # a client's ``posted`` further ahead than its slots would have their stale entries answered for ever
                if ahead > slots or slot >= slots:
                    problem = (
                        f"posted runs {ahead} ahead of {slots} slots" if ahead > slots else f"ring names slot {slot}"
                    )
                    self._send(identity, Error(None, ErrorCode.INVALID, f"{problem}; session dropped"))
                    self._drop(identity)
                    break
                offset = arena.header_offset(slot, RESULT)
                length = pack_reply(arena.buffer, offset, self._answer_slot(session, slot), HEADER_BYTES)
                arena.set_header_length(slot, RESULT, length)
                answers.served += 1
                arena.done[slot] = answers.served  # hands the slot back: the client's flag
                session.shm.done_bell.ring()
            served = served or answers.served != start
        return served

    def _answer_slot(self, session: _Session, slot: int) -> Result | Error:
        arena = session.shm.arena
        try:
            offset = arena.header_offset(slot, REQUEST)
            message = unpack_compute(arena.buffer, offset, arena.header_length(slot, REQUEST))
            if message.slot != slot:
                raise ProtocolError(
                    ErrorCode.INVALID, f"slot {slot} holds a request naming slot {message.slot}", message.id
                )
            shard = self._check_compute(message, session)
            out = arena.y(slot, message.n, shard.rows)
            self._run(message, arena.x(slot, message.n, shard.d_in), out)
            return Result(message.id, message.dtype, [message.n, shard.rows], slot)
        except ProtocolError as exc:
            return self._error(exc)

    def _serve_socket(self) -> None:
        while self._running:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            try:
                reply, payload = self._answer_frames(identity, frames[1:])
            except ProtocolError as exc:
                reply, payload = self._error(exc), None
            self._send(identity, reply, payload)

    def _send(self, identity: bytes, reply: Message, payload: np.ndarray | None = None) -> None:
        frames: list[object] = [identity, encode(reply)]
        if payload is not None:
            frames.append(payload)
        self._socket.send_multipart(frames, copy=False)

    def _answer_frames(self, identity: bytes, frames: list[zmq.Frame]) -> tuple[Message, np.ndarray | None]:
        if not 1 <= len(frames) <= 2:
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"a request is a header and at most one payload, got {len(frames)} frames",
            )
        message = decode(frames[0].buffer, self._config.max_header_bytes)
        payload = frames[1] if len(frames) == 2 else None
        if payload is not None and not isinstance(message, Compute):
            raise ProtocolError(ErrorCode.INVALID, f"{message.OP} carries no payload", message.id)
        if isinstance(message, Hello):
            return self._handshake(identity, message), None
        if isinstance(message, Compute):
            return self._compute_inline(identity, message, payload)
        if isinstance(message, Ping):
            return Pong(message.id, self._stats_now()), None
        if isinstance(message, Shutdown):
            self._running = False
            return Bye(message.id), None
        raise ProtocolError(
            ErrorCode.INVALID,
            f"{message.OP} is a reply; a server takes hello, compute, ping, shutdown",
            message.id,
        )

    def _handshake(self, identity: bytes, hello: Hello) -> Welcome:
        info = self._info
        mismatch = []
        if hello.model_hash != info.model_hash:
            mismatch.append(f"model hash {hello.model_hash!r} != served {info.model_hash!r}")
        if hello.dtype != info.dtype:
            mismatch.append(f"dtype {hello.dtype} != served {info.dtype}")
        if hello.shards is not None and shards_from_wire(hello.shards) != info.shards:
            mismatch.append(f"shards {hello.shards} != served {shards_to_wire(info.shards)}")
        if mismatch:
            raise ProtocolError(
                ErrorCode.MISMATCH,
                "; ".join(mismatch) + ": point the GPU actor at a CPU actor loaded from the same plan and model",
                hello.id,
            )
        self._drop(identity)  # a second hello from one client restarts its session
        shm = answers = None
        if hello.host_id == self._host_id:
            shm = ShmEndpoint.create(SlotLayout.for_shards(hello.slots, hello.max_tokens, info.shards))
            answers = SlotAnswers(
                shm.arena, shm.done_bell.fd, info.num_layers, info.shards, info.dtype, hello.max_tokens, self._kernels
            )
            self._poller.register(shm.request_bell.fd, zmq.POLLIN)
            self._by_fd[shm.request_bell.fd] = identity
            self._attaching[identity] = time.monotonic() + self._config.connect_timeout_s
        self._sessions[identity] = _Session(hello, shm, answers)
        self._index_slot_sessions()
        return Welcome(
            hello.id,
            info.model_hash,
            info.num_layers,
            info.dtype,
            shards_to_wire(info.shards),
            shm.directory if shm else None,
            info.base_share,
        )

    def _compute_inline(
        self, identity: bytes, message: Compute, payload: zmq.Frame | None
    ) -> tuple[Message, np.ndarray]:
        session = self._sessions.get(identity)
        if session is None:
            raise ProtocolError(ErrorCode.NO_SESSION, "compute before hello: handshake first", message.id)
        shard = self._check_compute(message, session)
        expected = message.n * shard.d_in * 4
        if message.slot is not None or payload is None or len(payload) != expected:
            got = "a slot" if message.slot is not None else f"{0 if payload is None else len(payload)} bytes"
            raise ProtocolError(
                ErrorCode.INVALID,
                f"inline compute needs a payload frame of {expected} bytes, got {got}",
                message.id,
            )
        x = np.frombuffer(payload.buffer, np.float32).reshape(message.n, shard.d_in)
        out = np.empty((message.n, shard.rows), np.float32)
        self._run(message, x, out)
        return Result(message.id, message.dtype, [message.n, shard.rows], None), out

    def _check_compute(self, message: Compute, session: _Session) -> GroupShard:
        shard = self._info.shards.get(message.group)
        problem = None
        if shard is None:
            problem = f"this CPU actor holds no rows of group {message.group!r}"
        elif message.shape[1] != shard.d_in:
            problem = f"group {message.group!r} takes d_in={shard.d_in}, got {message.shape[1]}"
        elif message.layer >= self._info.num_layers:
            problem = f"layer {message.layer} >= num_layers {self._info.num_layers}"
        elif message.n > (limit := request_tokens(message.group, session.hello.max_tokens)):
            problem = f"n={message.n} exceeds the {limit} rows a {message.group} request may carry"
        elif message.dtype != self._info.dtype:
            problem = f"dtype {message.dtype} != served {self._info.dtype}"
        if problem:
            raise ProtocolError(ErrorCode.INVALID, problem, message.id)
        return shard

    def _run(self, message: Compute, x: np.ndarray, out: np.ndarray) -> None:
        start = time.perf_counter()
        try:
            self._compute(message.layer, message.group, x, out)
        except Exception as exc:  # the kernel's failure is the client's answer, not the server's death
            raise ProtocolError(ErrorCode.COMPUTE_FAILED, f"{type(exc).__name__}: {exc}", message.id) from exc
        finally:
            self._stats.compute_s += time.perf_counter() - start
        self._stats.requests += 1

    def _error(self, exc: ProtocolError) -> Error:
        self._stats.errors += 1
        return Error(exc.request_id, exc.code, exc.text[:_MAX_ERROR_TEXT])

    def compiled_counters(self) -> tuple[int, float, int]:
        """(requests, kernel seconds, bytes read) of the requests compiled code answered, over every session."""
        counts = list(self._stats.compiled)
        for _, session in self._slot_sessions:
            counts = [a + b for a, b in zip(counts, session.answers.counters(), strict=True)]
        return counts[0], counts[1], counts[2]

    def _stats_now(self) -> dict[str, float]:
        requests, compute_s, _ = self.compiled_counters()
        return {
            "requests": self._stats.requests + requests,
            "compiled_requests": requests,  # of those, answered by compiled code
            "errors": self._stats.errors,
            "sessions": len(self._sessions),
            "refused": self._gatekeeper.refused if self._gatekeeper is not None else 0,
            "compute_s": self._stats.compute_s + compute_s,
            "uptime_s": time.monotonic() - self._stats.started,
        }

    def _drop(self, identity: bytes) -> None:
        # a SIGTERM handler that raises (the CPU actor's) must not land between the counters' fold and the
        # index's rebind: ``compiled_counters`` would count the session twice
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
        try:
            session = self._sessions.pop(identity, None)
            if session is not None and session.answers is not None:
                counts = zip(self._stats.compiled, session.answers.counters(), strict=True)
                self._stats.compiled = [a + b for a, b in counts]
            self._index_slot_sessions()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if session is not None and session.shm is not None:
            self._attaching.pop(identity, None)
            self._poller.unregister(session.shm.request_bell.fd)
            del self._by_fd[session.shm.request_bell.fd]
            session.shm.close()

    def _index_slot_sessions(self) -> None:
        """Rebinds (never mutates) the list, so a loop over it survives a session dropped mid-loop."""
        self._slot_sessions = [(i, s) for i, s in self._sessions.items() if s.shm is not None]


_HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # what ``_drop`` holds back while it updates its counters


def serve(
    info: ShardInfo, compute: ComputeFn, config: ChannelConfig | None = None, endpoint: str | None = None
) -> None:
    """Serve until a client sends ``Shutdown``; use ``Server`` to learn a ``:0`` port before serving."""
    with Server(info, compute, config, endpoint) as server:
        server.serve_forever()
