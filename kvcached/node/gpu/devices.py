"""Which character devices are GPUs: NVIDIA's and DRM's fixed majors, the dynamic ones from /proc/devices.

A device is known by its number (st_rdev), never by its path: a container's
/dev/nvidia0 is a node of its own tmpfs, a test's is a node in a tmp dir,
and both are the same GPU as the host's when their numbers are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..base.enums import StrEnum


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"      # kfd: ROCm's compute device
    DRM = "drm"      # /dev/dri: any vendor's render and card nodes


# Fixed in the kernel's list of device numbers (Documentation/admin-guide/devices.txt): a node without the
# driver loaded, like a CI machine, does not list them in /proc/devices.
NVIDIA_MAJOR = 195
DRM_MAJOR = 226
_FIXED = {NVIDIA_MAJOR: "nvidia", DRM_MAJOR: "drm"}
# Drivers whose majors the kernel hands out at load time; /proc/devices names them.
_DYNAMIC = ("nvidia-uvm", "nvidia-caps", "nvidia-caps-imex-channels", "nvidia-nvlink", "nvidia-nvswitch", "kfd")
_NVIDIA_CTL = 255
_NVIDIA_MODESET = 254
_DRM_RENDER_BASE = 128


@dataclass(frozen=True)
class Device:
    """One GPU device node as its number says: its driver, its name, and the GPU index where the minor is one."""

    driver: str          # nvidia, nvidia-uvm, nvidia-caps, ..., drm, kfd
    major: int
    minor: int
    name: str            # nvidia0, nvidiactl, nvidia-uvm, renderD128, card0, kfd
    gpu: int | None      # NVIDIA: the minor of /dev/nvidia<N>; None for control nodes and other drivers

    @property
    def vendor(self) -> Vendor:
        if self.driver.startswith("nvidia"):
            return Vendor.NVIDIA
        return Vendor.AMD if self.driver == "kfd" else Vendor.DRM

    @property
    def label(self) -> str:
        """What a metric's `gpu` label says: the NVIDIA index, else the node's name."""
        return str(self.gpu) if self.gpu is not None else self.name


@dataclass(frozen=True)
class DeviceTable:
    """Major number -> driver name, for every GPU driver this node has or could have."""

    majors: Mapping[int, str]

    def device(self, rdev: int) -> Device | None:
        """The GPU device `rdev` is, or None when its major is no GPU driver's."""
        major, minor = os.major(rdev), os.minor(rdev)
        driver = self.majors.get(major)
        if driver is None:
            return None
        return _named(driver, major, minor)

    def with_majors(self, extra: Mapping[int, str]) -> DeviceTable:
        """This table with more majors (a test's stand-in device)."""
        return DeviceTable({**self.majors, **extra})


def _named(driver: str, major: int, minor: int) -> Device:
    if driver == "nvidia":
        if minor == _NVIDIA_CTL:
            return Device(driver, major, minor, "nvidiactl", None)
        if minor == _NVIDIA_MODESET:
            return Device(driver, major, minor, "nvidia-modeset", None)
        return Device(driver, major, minor, f"nvidia{minor}", minor)
    if driver == "drm":
        name = f"renderD{minor}" if minor >= _DRM_RENDER_BASE else f"card{minor}"
        return Device(driver, major, minor, name, None)
    if driver == "kfd":
        return Device(driver, major, minor, "kfd", None)
    return Device(driver, major, minor, driver if minor == 0 else f"{driver}{minor}", None)


def parse_proc_devices(text: str) -> dict[int, str]:
    """GPU drivers' majors among the character devices /proc/devices lists."""
    out: dict[int, str] = {}
    in_char = False
    for line in text.splitlines():
        if line.endswith("devices:"):
            in_char = line.startswith("Character")
            continue
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            name = parts[1]
            if name in _DYNAMIC or name in ("nvidia", "nvidia-frontend", "drm"):
                out[int(parts[0])] = "nvidia" if name == "nvidia-frontend" else name
    return out


def device_table(proc_root: str = "/proc") -> DeviceTable:
    """The fixed majors plus the dynamic ones this kernel lists (none where no driver is loaded)."""
    majors = dict(_FIXED)
    try:
        with open(f"{proc_root}/devices", encoding="ascii", errors="replace") as f:
            majors.update(parse_proc_devices(f.read()))
    except OSError:
        pass  # the fixed majors still say what NVIDIA's and DRM's nodes are
    return DeviceTable(majors)
