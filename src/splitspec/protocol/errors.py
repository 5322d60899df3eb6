"""What a caller of the channel may catch, beyond ``ProtocolError`` (a message that broke the schema)."""

from __future__ import annotations

from splitspec.protocol.messages import ErrorCode


class RemoteError(RuntimeError):
    """The CPU actor answered with an error reply; the channel itself is still usable."""

    def __init__(self, code: ErrorCode, text: str) -> None:
        super().__init__(f"CPU actor replied {code.name}: {text}")
        self.code = code
        self.text = text

    def __reduce__(self) -> tuple:  # rebuilt from its own arguments where it crosses Ray (an actor's init)
        return type(self), (self.code, self.text)


class PeerLost(ConnectionError):
    """The peer died or disconnected; requests in flight are lost. The client reconnects on next use."""


class RequestTimeout(TimeoutError):
    """No answer within the configured timeout: the peer is overloaded, stuck or unreachable."""


class AccessRefused(ConnectionRefusedError):
    """The peer refused the channel's security handshake (a CURVE key that is not its cluster's, or one
    side without CURVE): retrying with the same keys cannot help."""
