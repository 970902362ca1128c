"""The wire format: an 8-byte header, then a JSON object.

Header: magic b"KV", protocol version (u8), frame type (u8), body length (u32,
big-endian). JSON carries only plain data, so a peer cannot make us run code
(upstream's pickle can); the length cap bounds what a peer can make us buffer.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from ...node import ProtocolError

MAGIC = b"KV"
VERSION = 1
REQUEST = 1
REPLY = 2
MAX_BODY = 1 << 20
_HEADER = struct.Struct(">2sBBI")
HEADER_SIZE = _HEADER.size


def encode(frame_type: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_BODY:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {MAX_BODY}-byte cap")
    return _HEADER.pack(MAGIC, VERSION, frame_type, len(data)) + data


def parse_header(raw: bytes) -> tuple[int, int, int]:
    """(version, frame type, length); raises ProtocolError for anything we do not accept."""
    magic, version, frame_type, length = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not a kvcached peer")
    if frame_type not in (REQUEST, REPLY):
        raise ProtocolError(f"unknown frame type {frame_type}")
    if length > MAX_BODY:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_BODY}-byte cap")
    return version, frame_type, length


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, expect: int) -> tuple[int, dict[str, Any]]:
    """Read one frame; returns (peer version, body)."""
    version, frame_type, length = parse_header(recv_exact(sock, HEADER_SIZE))
    if frame_type != expect:
        raise ProtocolError(f"expected frame type {expect}, got {frame_type}")
    body = recv_exact(sock, length)
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("body is not a JSON object")
    return version, obj


# The commands an engine owner sends its workers' listeners (the harness's pool and vLLM's elastic KV buffer
# speak the same ones, with upstream's names and byte offsets for the pages).
CMD_CREATE = "create_kv_tensors"
CMD_CREATED = "kv_tensors_created"
CMD_MAP = "map_to_kv_tensors"
CMD_UNMAP = "unmap_from_kv_tensors"
CMD_MAPPED = "kv_pages_mapped"
CMD_INFO = "kv_elastic_info"
CMD_CONFIGURE = "kv_elastic_configure"
