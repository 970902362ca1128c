"""Pure units: sizes, durations, percentages, output neutralisation, the exit-code enum."""

from __future__ import annotations

import pytest

from kvcached.node.base.units import (
    BadValue,
    format_age,
    format_duration,
    format_size,
    parse_duration,
    parse_percent,
    parse_size,
)
from kvctl.exitcodes import Exit
from kvctl.render import Out, safe


@pytest.mark.parametrize("raw, expected", [
    ("0", 0), ("100_000", 100_000), ("512M", 512 << 20), ("2G", 2 << 30), ("2g", 2 << 30), ("1.5GiB", 3 << 29),
    ("1k", 1024), ("1KB", 1024), ("3T", 3 << 40), (".5G", 1 << 29), (" 7 ", 7), ("64 MiB", 64 << 20),
])
def test_sizes(raw: str, expected: int) -> None:
    assert parse_size(raw) == expected


@pytest.mark.parametrize("raw", ["-1", "-1G", "", "abc", "1.5", "1__0", "_1", "1X", "nan", "inf", "1e5",
                                 "99999999999T", "G", "1 G B"])
def test_bad_sizes(raw: str) -> None:
    with pytest.raises(BadValue):
        parse_size(raw)


@pytest.mark.parametrize("raw, expected", [
    ("0", 0), ("90", 90), ("90s", 90), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1.5h", 5400), ("0s", 0),
])
def test_durations(raw: str, expected: float) -> None:
    assert parse_duration(raw) == expected


@pytest.mark.parametrize("raw", ["-1", "-5m", "", "x", "5w", "1hh", "m"])
def test_bad_durations(raw: str) -> None:
    with pytest.raises(BadValue):
        parse_duration(raw)


@pytest.mark.parametrize("raw, expected", [("50", 50.0), ("100", 100.0), ("0.5", 0.5), ("90%", 90.0)])
def test_percent(raw: str, expected: float) -> None:
    assert parse_percent(raw) == expected


@pytest.mark.parametrize("raw", ["0", "-5", "100.1", "abc", "nan", "inf", ""])
def test_bad_percent(raw: str) -> None:
    with pytest.raises(BadValue):
        parse_percent(raw)


def test_formats() -> None:
    assert [format_size(n) for n in (None, 0, 100, 1 << 30, 3 << 29, 512 << 20)] == [
        "-",
        "0",
        "100",
        "1G",
        "1.5G",
        "512M",
    ]
    assert [format_duration(s) for s in (None, 5, 90, 7200, 90000)] == ["-", "5s", "1m", "2h", "1d"]
    # Ages in messages read as durations (issue 38), two units at most, rounded to the second.
    assert [format_age(s) for s in (0, 5, 59.6, 90, 3725, 7200, 90061, -3)] == [
        "0 s", "5 s", "1 min", "1 min 30 s", "1 h 2 min", "2 h", "1 d 1 h", "0 s"]


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("plain-name_1", "plain-name_1"),
        ("\x1b[31mred", "\\x1b[31mred"),  # ESC cannot recolour the terminal
        ("a\rb\nc", "a\\x0db\\x0ac"),  # CR/LF cannot rewrite or split lines
        ("evil\u202etxt", "evil\\u202etxt"),  # bidi override cannot reorder what is shown
        ("bad\udcffbyte", "bad\\xffbyte"),  # an undecodable byte of a file name
        ("naïve ünïcode", "naïve ünïcode"),
    ],
)
def test_safe(raw: str, shown: str) -> None:
    assert safe(raw) == shown


def test_a_plain_table_pads_each_column_but_the_last_and_neutralises_names() -> None:
    """Off a terminal, rows all as long are written a column at a time; ragged rows cell by cell: the same text."""
    import io

    from kvcached.node.base.enums import Kind

    rows: list[list[object]] = [[("x", "red"), "y\x1b", "tail  "], ["wide-cell", Kind.SEGMENT, ""]]
    written = []
    for table in (rows, rows[:1] + [rows[1][:2]]):  # the second is ragged: its last row has no third cell
        buf = io.StringIO()
        Out(buf, styled=False, terminal=False).table(["A", "LONGER", "LAST"], table)  # type: ignore[arg-type]
        written.append(buf.getvalue())
    assert written == ["  A          LONGER   LAST\n  x          y\\x1b    tail\n  wide-cell  segment\n"] * 2


def test_exit_codes_are_the_documented_numbers() -> None:
    assert {e.name: e.value for e in Exit} == {
        "OK": 0,
        "ERROR": 1,
        "USAGE": 2,
        "STALE_REMAIN": 3,
        "PARTIAL_FAILURE": 4,
        "LOCK_BUSY": 5,
        "NOT_FOUND": 6,
        "REFUSED": 7,
        "UNHEALTHY": 8,
        "METRICS_UNWRITTEN": 9,
        "INTERRUPTED": 130,
    }


def test_unexpected_errors_are_one_line_and_traceback_only_with_verbose(capsys) -> None:
    from kvctl.exitcodes import handle

    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        assert handle(e, verbose=False) == Exit.ERROR
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvctl: internal error: RuntimeError: boom")
        assert handle(e, verbose=True) == Exit.ERROR
        err = capsys.readouterr().err
        assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("kvctl: internal error")
