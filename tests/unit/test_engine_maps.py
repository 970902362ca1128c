"""The maps parsers of the fact pass: by /dev/shm path (plain gc) and by device (the engine pass)."""

from __future__ import annotations

import os

from kvcached.node.clean.facts import _device_maps, _shm_maps

LINES = [
    b"55d0c0a00000-55d0c0a21000 r--p 00000000 fe:00 1234567                    /usr/bin/python3.11",
    b"7f0000000000-7f0000100000 rw-s 00000000 00:1a 4242                       /dev/shm/psm_0a1b2c3d",
    b"7f0000100000-7f0000200000 rw-s 00000000 00:1a 4243                       /dev/shm/nccl-Ab3dE9 (deleted)",
    b"7f0000200000-7f0000300000 r--s 00001000 00:1a 4244                       /host/dev/shm/sgl_shm_mm_1_0a1b2c3d",
    b"7f0000300000-7f0000400000 r--s 00000000 00:1a 4245                       /mnt/other-mount/psm_1a2b3c4d",
    # a path that contains the device text itself must not count twice, nor as another inode
    b"7f0000400000-7f0000500000 r--p 00000000 fe:00 99                         /srv/x 00:1a 7/dev/shm/",
    b"7f0000500000-7f0000600000 rw-p 00000000 00:00 0                          [heap]",
    b"7f0000600000-7f0000700000 rw-s 00000000 00:1b 4246                       /dev/shm/other-tmpfs",
    b"7f0000700000-7f0000800000 rw-s 00000000 00:1a 4247",
]
RAW = b"\n".join(LINES) + b"\n"


def _reference(raw: bytes) -> set[tuple[int, int]]:
    """The line-by-line parse the fact pass used before the search-based one."""
    out = set()
    for line in raw.splitlines():
        if b"/dev/shm/" not in line:
            continue
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        maj, mnr = parts[3].split(b":")
        out.add((os.makedev(int(maj, 16), int(mnr, 16)), int(parts[4])))
    return out


def test_by_path_is_what_the_line_by_line_parse_gives() -> None:
    expected = {(os.makedev(0, 0x1A), i) for i in (4242, 4243, 4244)} | {(os.makedev(0xFE, 0), 99),
                                                                          (os.makedev(0, 0x1B), 4246)}
    assert _shm_maps(RAW) == _reference(RAW) == expected
    assert _shm_maps(RAW.rstrip(b"\n")) == expected  # no final newline
    with open("/proc/self/maps", "rb") as f:
        mine = f.read()
    assert _shm_maps(mine) == _reference(mine)


def test_by_device_finds_every_mount_of_the_tmpfs_and_only_its_fourth_field() -> None:
    dev = os.makedev(0, 0x1A)
    got = _device_maps(RAW, [(dev, b" 00:1a ")])
    assert got == {(dev, i) for i in (4242, 4243, 4244, 4245, 4247)}
    big = os.makedev(0, 0x12C)  # minors past 0xff print with more digits
    assert _device_maps(b"7f-80 rw-s 00000000 00:12c 77                 /dev/shm/x\n", [(big, b" 00:12c ")]) == {
        (big, 77)}
