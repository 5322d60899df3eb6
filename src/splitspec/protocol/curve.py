"""ZeroMQ CURVE on the channel's socket: encryption, and a server that admits only its cluster's client.

A CPU actor's socket listens on TCP: the address of its host (another machine's engine connects there)
or loopback (the control socket of the shared-memory path, which hands out the slots). Without keys any
process that reaches it could read activations or inject results. With CURVE the client proves it knows
the server's public key (the server's secret key decrypts its hello) and the server checks the client's
public key against the one its scheduler made (``Gatekeeper``, ZeroMQ's authentication protocol ZAP,
answered in the server's own loop: no thread). Both key pairs are made per cluster and reach the
processes through Ray and the environment, never through a command line (``ps`` shows those to all).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

ENV = "SPLITSPEC_CURVE_KEYS"  # how a launcher hands the keys to the CPU actor process it starts
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks, per context (RFC 27)


@dataclass(frozen=True)
class CurveKeys:
    """The server's and the client's key pairs (Z85 text, as ``zmq.curve_keypair`` makes them)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def to_env(self) -> str:
        return json.dumps({name: getattr(self, name).decode() for name in self.__dataclass_fields__})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> CurveKeys | None:
        """The keys a launcher put in the environment, or None when it started a plain (keyless) server."""
        text = (os.environ if environ is None else environ).get(ENV)
        if not text:
            return None
        try:
            return cls(**{name: value.encode() for name, value in json.loads(text).items()})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{ENV} holds no valid CURVE keys ({exc}); the launcher sets it, not a user") from exc


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class Gatekeeper:
    """Answers libzmq's authentication requests for one context: a CURVE client whose public key is not
    the cluster's is refused before it can send a message. Must exist before the server socket binds."""

    def __init__(self, context: zmq.Context, keys: CurveKeys) -> None:
        self._allowed = z85.decode(keys.client_public)  # ZAP carries the raw 32-byte key
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(_ZAP_ENDPOINT)
        self.refused = 0

    def answer(self) -> None:
        """Answer every pending request (the server's loop calls this when the socket is readable)."""
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            version, request_id, _domain, _address, _identity, mechanism, *credentials = request
            admitted = mechanism == b"CURVE" and credentials == [self._allowed]
            self.refused += not admitted
            status = (b"200", b"OK") if admitted else (b"400", b"not this cluster's client key")
            self.socket.send_multipart([version, request_id, *status, b"", b""])

    def close(self) -> None:
        self.socket.close()
