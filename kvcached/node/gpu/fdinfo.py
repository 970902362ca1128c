"""AMD's (and any DRM driver's) per-client memory from /proc/<pid>/fdinfo/<fd>, where the kernel lists it.

A DRM file descriptor's fdinfo carries `drm-client-id` and, for drivers that
keep the accounting (amdgpu, i915, xe), memory keys such as
`drm-memory-vram: 1024 KiB` or `drm-resident-vram: ...`. Two descriptors of one
client (a dup, a fork) show the same id and the same memory: counted once.
"""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}
# Most specific first: resident VRAM is what the process holds on the device now.
_VRAM_KEYS = ("drm-resident-vram", "drm-memory-vram", "drm-total-vram")


def parse_fdinfo(text: str) -> tuple[str | None, int | None]:
    """(drm-client-id, VRAM bytes) from one fdinfo file; None where the key is absent."""
    keys: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            keys[name.strip()] = value.strip()
    vram = None
    for key in _VRAM_KEYS:
        if key in keys:
            number, _, unit = keys[key].partition(" ")
            if number.isdigit() and unit.strip() in _UNITS:
                vram = int(number) * _UNITS[unit.strip()]
                break
    return keys.get("drm-client-id"), vram


def drm_memory(proc_root: str, pid: int, fds: list[str]) -> int | None:
    """VRAM the process's DRM clients hold, summed over distinct clients; None when no fdinfo says."""
    seen: dict[str, int] = {}
    total: int | None = None
    for fd in fds:
        try:
            with open(f"{proc_root}/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
                client, vram = parse_fdinfo(f.read())
        except OSError:
            continue
        if vram is None:
            continue
        key = client if client is not None else f"fd{fd}"
        if key not in seen:
            seen[key] = vram
            total = (total or 0) + vram
    return total
