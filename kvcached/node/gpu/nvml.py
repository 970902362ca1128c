"""GPU memory per process from NVML, through nvidia-ml-py, imported only when a pass has NVIDIA holders.

NVML (libnvidia-ml.so.1, shipped with the driver) lists each GPU's compute
processes by PID with the memory they hold. Where the bindings are not
installed, the library is absent (no driver) or NVML fails, memory is unknown:
the reason is said once for the whole run, not once per process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuMemory:
    """Bytes each process holds on each GPU (by the GPU's minor number), or why nobody could say."""

    by_pid: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    note: str | None = None      # set when NVML could not answer: every figure is unknown

    @property
    def known(self) -> bool:
        return self.note is None

    def of(self, pid: int) -> int | None:
        """The process's bytes over every GPU; None when NVML could not answer (0 when it lists none)."""
        if not self.known:
            return None
        return sum(self.by_pid.get(pid, {}).values())

    def per_gpu(self, pid: int) -> Mapping[int, int]:
        return self.by_pid.get(pid, {})


def _minor(pynvml: object, handle: object, index: int) -> int:
    """The GPU's /dev/nvidia<minor>: what device numbers say; NVML's index order may differ from it."""
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a device that cannot say: its index is the best name left
        return index


def query() -> GpuMemory:
    """Every NVIDIA GPU's compute processes and their memory, in one NVML session."""
    try:
        import pynvml  # type: ignore[import-untyped, import-not-found, unused-ignore]  # nvidia-ml-py: never at kvctl start-up, only in a pass that found NVIDIA holders
    except ImportError:
        return GpuMemory(note="nvidia-ml-py is not installed: GPU memory unknown")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return GpuMemory(note=f"NVML unavailable ({e}): GPU memory unknown")
    except OSError as e:  # a library that loads but is not NVML (a stray libnvidia-ml.so.1)
        return GpuMemory(note=f"NVML unavailable ({e}): GPU memory unknown")
    out: dict[int, dict[int, int]] = {}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu = _minor(pynvml, handle, index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory
                per = out.setdefault(int(proc.pid), {})
                per[gpu] = per.get(gpu, 0) + (int(used) if used is not None else 0)
    except pynvml.NVMLError as e:
        return GpuMemory(note=f"NVML failed ({e}): GPU memory unknown")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return GpuMemory(by_pid=out)
