"""The GPU-holder room's pure parts as tables: the orphan rule, device numbers, fdinfo, metrics."""

from __future__ import annotations

import os

import pytest

from kvcached.node.clean.facts import ProcessInfo
from kvcached.node.clean.roles import Role, RoleInfo, classify_process
from kvcached.node.gpu.devices import DeviceTable, device_table, parse_proc_devices
from kvcached.node.gpu.fdinfo import parse_fdinfo
from kvcached.node.gpu.holders import GpuHolder, GpuReport
from kvcached.node.gpu.judge import HolderState, Parent, judge
from kvcached.node.gpu.metrics import render_gpu

T0 = 1_000_000.0


def proc(pid: int, title: str, *, ppid: int = 1, pgid: int = 100, start: float = T0, comm: str | None = None,
         ) -> ProcessInfo:
    return ProcessInfo(pid, start, ppid, pgid, 0, comm or title[:15], (title,), None, frozenset(), frozenset(),
                       None, None, frozenset())


def parent(p: ProcessInfo, *, init: bool = False) -> Parent:
    return Parent(p, classify_process(p), init)


ENGINE = proc(200, "VLLM::EngineCore", ppid=100)
WORKER = proc(300, "VLLM::Worker_TP0_PP0", ppid=200)
API = proc(100, "VLLM::APIServer", start=T0 - 10)
INIT = proc(1, "/sbin/init", ppid=0, pgid=1, start=T0 - 1000, comm="systemd")
SUBREAPER = proc(50, "containerd-shim", ppid=1, pgid=50, start=T0 - 100)
SCRIPT = proc(90, "python", pgid=100, start=T0 - 10)           # `python offline.py` running vllm.LLM in-process
LATE = proc(400, "bash", pgid=400, start=T0 + 50)               # started after the engine: cannot be its parent
PY_INIT = proc(1, "python", ppid=0, pgid=100, start=T0 - 10)     # a container whose CMD is `python offline.py`


@pytest.mark.parametrize(("child", "par", "state", "why"), [
    (ENGINE, parent(API), HolderState.SERVING, "is alive"),
    (WORKER, parent(ENGINE), HolderState.SERVING, "is alive"),
    (ENGINE, parent(INIT, init=True), HolderState.ORPHAN, "namespace's init"),
    (ENGINE, parent(SUBREAPER), HolderState.ORPHAN, "outside its serve's process group"),
    (ENGINE, parent(LATE), HolderState.ORPHAN, "started after it"),
    (ENGINE, parent(SCRIPT), HolderState.SERVING, "in its process group"),
    (ENGINE, parent(PY_INIT, init=True), HolderState.SERVING, "in its process group"),
    (ENGINE, None, HolderState.UNKNOWN, "gone or unreadable"),
    (proc(500, "python", ppid=1), parent(INIT, init=True), HolderState.FOREIGN, "never killed"),
    (proc(501, "VLLM::APIServer", ppid=1), parent(INIT, init=True), HolderState.SERVING, "never killed"),
    (proc(502, "sglang::detokenizer", ppid=1), parent(INIT, init=True), HolderState.ORPHAN, "init"),
])
def test_the_orphan_rule(child: ProcessInfo, par: Parent | None, state: HolderState, why: str) -> None:
    got, reason = judge(child, classify_process(child), par)
    assert (got, why in reason) == (state, True), reason


def test_hidden_parents_make_unknown_not_orphans() -> None:
    assert judge(ENGINE, classify_process(ENGINE), None, view_complete=False)[0] is HolderState.UNKNOWN


PROC_DEVICES = """Character devices:
  1 mem
195 nvidia-frontend
226 drm
234 kfd
235 nvidia-caps
510 nvidia-uvm

Block devices:
  7 loop
235 not-a-gpu
"""


def test_proc_devices_gives_the_dynamic_majors_of_character_devices_only() -> None:
    assert parse_proc_devices(PROC_DEVICES) == {195: "nvidia", 226: "drm", 234: "kfd", 235: "nvidia-caps",
                                                510: "nvidia-uvm"}


@pytest.mark.parametrize(("major", "minor", "name", "gpu"), [
    (195, 0, "nvidia0", 0), (195, 7, "nvidia7", 7), (195, 255, "nvidiactl", None),
    (195, 254, "nvidia-modeset", None), (226, 128, "renderD128", None), (226, 0, "card0", None),
    (510, 0, "nvidia-uvm", None), (234, 0, "kfd", None)])
def test_names_and_gpu_indexes_come_from_the_device_number(major: int, minor: int, name: str, gpu: int | None
                                                          ) -> None:
    table = DeviceTable(parse_proc_devices(PROC_DEVICES))
    dev = table.device(os.makedev(major, minor))
    assert dev is not None and (dev.name, dev.gpu) == (name, gpu)


def test_the_fixed_majors_hold_without_a_driver_and_others_are_no_gpu() -> None:
    table = device_table("/proc")  # this machine lists no GPU driver
    assert table.device(os.makedev(195, 3)) is not None and table.device(os.makedev(226, 129)) is not None
    assert table.device(os.makedev(1, 3)) is None and table.device(os.makedev(136, 0)) is None  # /dev/null, a pty


@pytest.mark.parametrize(("text", "client", "vram"), [
    ("pos:\t0\nflags:\t02\ndrm-driver:\tamdgpu\ndrm-client-id:\t7\ndrm-memory-vram:\t2048 KiB\n", "7", 2 << 20),
    ("drm-client-id: 3\ndrm-total-vram: 1 GiB\ndrm-resident-vram: 512 MiB\n", "3", 512 << 20),
    ("pos:\t0\nflags:\t0100000\nmnt_id:\t25\n", None, None),
    ("drm-client-id:\t9\ndrm-memory-vram:\tlots\n", "9", None),
])
def test_fdinfo_memory_keys(text: str, client: str | None, vram: int | None) -> None:
    assert parse_fdinfo(text) == (client, vram)


def test_metrics_by_gpu_and_state() -> None:
    def holder(pid: int, state: HolderState, by_gpu: dict[str, int]) -> GpuHolder:
        return GpuHolder(proc(pid, "VLLM::EngineCore"), RoleInfo(role=Role.ENGINE, title="VLLM::EngineCore"), None,
                         (), sum(by_gpu.values()) or None, by_gpu, state, "", "S")

    report = GpuReport((holder(1, HolderState.ORPHAN, {"0": 5, "1": 7}), holder(2, HolderState.ORPHAN, {"0": 1}),
                        holder(3, HolderState.SERVING, {"0": 100})))
    text = render_gpu(report)
    assert "kvctl_gpu_orphan_processes 2" in text
    assert 'kvctl_gpu_orphan_bytes{gpu="0"} 6' in text and 'kvctl_gpu_orphan_bytes{gpu="1"} 7' in text
    assert 'kvctl_gpu_holders{state="serving"} 1' in text and 'kvctl_gpu_holders{state="foreign"} 0' in text
