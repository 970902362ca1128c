"""The str-valued enum every state, reason and kind of the node layer is (Python 3.10 has no enum.StrEnum)."""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """An Enum whose members are their string values (in JSON, f-strings and comparisons)."""

    def __str__(self) -> str:
        return self.value
