"""What an engine process publishes about kvcached in it, and how kvctl reads it back (docs/NODE.md §7).

Every vLLM and SGLang process whose kvcached plugin runs holds one sealed
memfd named `kvcached-published` (kvcached.integration.publish), its
content one JSON record: which engine, which patches it applied and how the
others ended. kvctl finds it among the process's descriptors
(`/proc/PID/fd/N -> /memfd:kvcached-published (deleted)`) and reads it
through that link (kvcached.node.ops.serves): no socket is connected to, no
file is left on the node, and the record goes with the process, so there is
nothing for a cleaner to judge. This module is the format both sides share:
the name, the schema and the record, encoded and strictly decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PUBLISHED_MEMFD = "kvcached-published"
LINK = f"/memfd:{PUBLISHED_MEMFD} (deleted)"  # what readlink(/proc/PID/fd/N) says of it
SCHEMA = "kvcached.published/1"
MAX_BYTES = 64 << 10  # a record is a few hundred bytes; a reader reads no more than this


class RecordError(ValueError):
    """A memfd of the name whose content is no record of this schema."""


@dataclass(frozen=True, kw_only=True)
class Published:
    """One process's record: the engine it is, and what kvcached's plugin did in it."""

    pid: int                       # in the process's own PID namespace (os.getpid() there)
    engine: str                    # "vllm" or "sglang": the integration's name
    label: str                     # "vLLM", "SGLang": as the engine names itself
    engine_version: str | None
    kvcached_version: str
    root: str                      # KVCACHED_ROOT: where its kvcached state lives
    applied: tuple[str, ...] = ()  # the patches installed in the process, in dependency order
    statuses: dict[str, str] = field(default_factory=dict)  # each patch tried so far -> how it ended
    seq: int = 0                   # grows with each update: of two records seen at once, the higher is current
    updated: float = 0.0

    def encode(self) -> bytes:
        return json.dumps({"schema": SCHEMA, "pid": self.pid, "engine": self.engine, "label": self.label,
                           "engine_version": self.engine_version, "kvcached_version": self.kvcached_version,
                           "root": self.root, "applied": list(self.applied), "statuses": self.statuses,
                           "seq": self.seq, "updated": self.updated}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Published:
        """The record in `data`; RecordError for anything else (kvctl says so and judges nothing by it)."""
        try:
            doc = json.loads(data.decode("utf-8")) if len(data) <= MAX_BYTES else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RecordError(f"not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise RecordError(f"not a {SCHEMA} record")
        try:
            return cls(pid=_int(doc["pid"]), engine=_str(doc["engine"]), label=_str(doc["label"]),
                       engine_version=_opt_str(doc["engine_version"]),
                       kvcached_version=_str(doc["kvcached_version"]), root=_str(doc["root"]),
                       applied=tuple(_str(a) for a in _list(doc["applied"])),
                       statuses={_str(k): _str(v) for k, v in _dict(doc["statuses"]).items()},
                       seq=_int(doc["seq"]), updated=float(doc["updated"]))
        except (KeyError, TypeError, ValueError) as e:
            raise RecordError(f"a malformed {SCHEMA} record ({type(e).__name__}: {e})") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.encode())
        return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{v!r} is not a string")
    return v


def _opt_str(v: Any) -> str | None:
    return None if v is None else _str(v)


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise TypeError(f"{v!r} is not a list")
    return v


def _dict(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise TypeError(f"{v!r} is not an object")
    return v
