"""Sizes and durations as operators type them, and back (`512M`, `1.5GiB`, `10m`, `2h`)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from .enums import Category
from .errors import KvcachedError

if TYPE_CHECKING:
    from decimal import Decimal


class BadValue(KvcachedError, ValueError):
    """A size, duration or percentage that does not parse or is out of range."""

    category = Category.BAD_INPUT


# Binary multiples throughout, like upstream kvctl and `free -h`: `2G` and `2GiB` are both 2 * 2**30.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_NUMBER = r"([0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)"
_SIZE_RE = re.compile(rf"^{_NUMBER}\s*([A-Za-z]*)\Z")
_DURATION_RE = re.compile(rf"^{_NUMBER}\s*([smhdSMHD]?)\Z")
_INT64_MAX = (1 << 63) - 1


def _number(text: str, what: str, raw: str) -> Decimal:
    if "__" in text or text.startswith("_") or text.endswith("_") or "_." in text or "._" in text:
        raise BadValue(f"{what} {raw!r}: misplaced '_'")
    # Decimal, not float: a byte count of 18 digits must be stored as typed, and
    # a float keeps only 15-17 of them. Imported here: every kvctl run imports this
    # module (decide words its reasons with it), few parse a value (bench/bench_cli_start.py).
    from decimal import Decimal, InvalidOperation

    try:
        return Decimal(text.replace("_", ""))
    except InvalidOperation:
        raise BadValue(f"{what} {raw!r}: not a number") from None


def parse_size(raw: str) -> int:
    """Bytes from `512M`, `2G`, `1.5GiB`, `100_000` (binary units), exactly; raise BadValue on garbage or < 0.

    A fractional size with a unit is rounded down to whole bytes (`1.5K` = 1536).
    """
    text = raw.strip()
    if text.startswith("-"):
        raise BadValue(f"size {raw!r}: must not be negative")
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise BadValue(f"size {raw!r}: expected a number with an optional unit K, M, G, T (or KiB, MiB, GiB, TiB)")
    value = _number(m.group(1), "size", raw) * _SIZE_UNITS[m.group(2).lower()]
    if value > _INT64_MAX:
        raise BadValue(f"size {raw!r}: too large for a segment (at most {_INT64_MAX} bytes)")
    if value != value.to_integral_value() and m.group(2).lower() in ("", "b"):
        raise BadValue(f"size {raw!r}: a byte count must be whole")
    return int(value)


def parse_duration(raw: str) -> float:
    """Seconds from `0`, `90`, `90s`, `10m`, `2h`, `1d`; raise BadValue on garbage or < 0."""
    text = raw.strip()
    if text.startswith("-"):
        raise BadValue(f"duration {raw!r}: must not be negative")
    m = _DURATION_RE.match(text)
    if not m:
        raise BadValue(f"duration {raw!r}: expected seconds or a number with s, m, h or d (e.g. 90s, 10m, 2h, 1d)")
    value = float(_number(m.group(1), "duration", raw) * _DURATION_UNITS[m.group(2).lower()])
    if not math.isfinite(value):
        raise BadValue(f"duration {raw!r}: out of range")
    return value


MAX_INTERVAL = 86400.0


def parse_interval(raw: str) -> float:
    """A refresh interval: a duration above 0 and at most a day (`2`, `0.5`, `10s`, `1m`)."""
    value = parse_duration(raw)
    if not 0 < value <= MAX_INTERVAL:
        raise BadValue(f"interval {raw!r}: must be above 0 and at most {MAX_INTERVAL:g} seconds (a day)")
    return value


def parse_percent(raw: str | float) -> float:
    """A percentage in (0, 100]; accepts a trailing `%`."""
    text = str(raw).strip().removesuffix("%").strip()
    try:
        value = float(text)
    except ValueError:
        raise BadValue(f"percentage {raw!r}: not a number") from None
    if not math.isfinite(value) or not 0 < value <= 100:
        raise BadValue(f"percentage {raw!r}: must be greater than 0 and at most 100")
    return value


def format_size(n: int | None) -> str:
    """`1.5G`, `512M`, `0`: short binary units for tables."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult:
            v = n / mult
            return f"{sign}{v:.1f}{unit}".replace(".0" + unit, unit)
    return f"{sign}{n}"


def format_duration(seconds: float | None) -> str:
    """`42s`, `3m`, `5h`, `2d`: coarse ages for tables."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    for unit, mult in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= mult:
            return f"{int(s // mult)}{unit}"
    return f"{int(s)}s"


def format_age(seconds: float) -> str:
    """`35 s`, `1 min 30 s`, `1 h 2 min`, `2 d 3 h`: an age in messages, read as a duration (two units at most)."""
    s = int(max(0.0, seconds) + 0.5)
    for big, big_unit, small, small_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "min"), (60, "min", 1, "s")):
        if s >= big:
            rest = (s % big) // small
            return f"{s // big} {big_unit}" + (f" {rest} {small_unit}" if rest else "")
    return f"{s} s"


def entries(n: int, what: str = "") -> str:
    """`1 live entry`, `3 live entries`: counts in messages read as sentences."""
    return f"{n} {what + ' ' if what else ''}entr{'y' if n == 1 else 'ies'}"
