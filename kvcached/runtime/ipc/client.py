"""A client for our worker listeners. Never point it at an upstream socket (docs/NODE.md §3)."""

from __future__ import annotations

import os
import socket
from typing import Any

from ...node import IpcError, ProtocolError
from .protocol import REPLY, REQUEST, encode, recv_frame


class Client:
    """One request per connection, like the listener expects."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout

    def call(self, command: str, **args: Any) -> dict[str, Any]:
        """Send `command` with `args`; return the result object or raise IpcError."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
            s.sendall(encode(REQUEST, {"cmd": command, "args": args}))
            _, reply = recv_frame(s, REPLY)
        except ProtocolError as e:
            raise IpcError(f"{self.path}: {command}: {e}") from None
        except OSError as e:
            raise IpcError(f"{self.path}: {command}: {e.strerror or e}") from None
        finally:
            s.close()
        if not reply.get("ok"):
            raise IpcError(f"{self.path}: {command}: {reply.get('error', 'unknown error')}")
        result = reply.get("result", {})
        return result if isinstance(result, dict) else {"value": result}

    def ping(self) -> dict[str, Any]:
        return self.call("ping")


def ping(path: str, timeout: float = 2.0) -> dict[str, Any]:
    """Ping one of our listeners."""
    return Client(os.fspath(path), timeout).ping()
