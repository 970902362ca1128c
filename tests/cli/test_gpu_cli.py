"""kvctl and GPU holders, end to end: inspect's section and JSON, gc ending orphans, doctor, metrics, NVML.

The holders are real processes holding mknod'ed NVIDIA nodes (tests/fs/gpu_fixtures.py). GPU memory comes from
a stand-in libnvidia-ml.so.1 built here from csrc/testing/fake_libnvml.c: the real nvidia-ml-py that kvctl
imports dlopens "libnvidia-ml.so.1" by name, so the kvctl under test finds the stand-in on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcached.node.base.units import format_size
from tests.fs.gpu_fixtures import node
from tests.waiting import wait_for

from .conftest import REPO, kvctl, validate

FAKE_NVML = REPO / "csrc" / "testing" / "fake_libnvml.c"
GiB = 1 << 30


@pytest.fixture(scope="module")
def nvml_dir(tmp_path_factory) -> Path:
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libnvidia-ml.so.1")
    out = tmp_path_factory.mktemp("fakenvml")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libnvidia-ml.so.1", "-o",
                    str(out / "libnvidia-ml.so.1"), str(FAKE_NVML)], check=True, capture_output=True, timeout=120)
    return out


def _orphaned_serve(standins, nodes: dict[str, str]) -> tuple[int, int]:
    """An EngineCore and its worker whose API server was SIGKILLed: (engine, worker)."""
    worker = node("VLLM::Worker_TP1_PP0", "worker", comm="VLLM::Worker_TP", hold=(nodes["nvidiactl"],
                                                                                   nodes["nvidia1"]))
    api = standins.start(node("VLLM::APIServer", "api", children=(
        node("VLLM::EngineCore", "engine", hold=(nodes["nvidiactl"], nodes["nvidia0"]), children=(worker,)),)))
    engine, w = standins.pids("engine", "worker")
    api.kill()
    api.wait()
    return engine, w


def _env(nvml_dir: Path, table: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(nvml_dir), "FAKE_NVML_FILE": str(table)}


def _holders(doc: dict) -> dict[int, dict]:
    return {h["pid"]: h for h in doc["gpu_holders"]}


def test_inspect_names_orphans_serving_and_foreign_holders_with_nvml_memory(root, gpu_nodes, standins, nvml_dir,
                                                                              tmp_path) -> None:
    engine, worker = _orphaned_serve(standins, gpu_nodes)
    standins.start(node("python", "train", hold=(gpu_nodes["nvidia0"],)))
    (train,) = standins.pids("train")
    table = tmp_path / "nvml"
    table.write_text(f"0 {engine} {3 * GiB}\n1 {worker} {2 * GiB}\n0 {train} {GiB}\n")
    r = kvctl("--root", root, "inspect", "--json", env=_env(nvml_dir, table))
    assert r.code == 0, r.stderr
    doc = json.loads(r.stdout)
    validate(doc, "inspect")
    got = _holders(doc)
    assert (got[engine]["state"], got[engine]["gpu_memory_bytes"]) == ("orphan", 3 * GiB)
    assert (got[worker]["state"], got[worker]["gpu_memory_bytes"]) == ("orphan", 2 * GiB)
    assert (got[train]["state"], got[train]["serve"]) == ("foreign", None)
    assert {d["name"]: d["gpu"] for d in got[worker]["devices"]} == {"nvidiactl": None, "nvidia1": 1}
    assert got[engine]["title"] == "VLLM::EngineCore" and got[engine]["proc_state"] == "S"
    assert doc["gpu_memory_note"] is None
    text = kvctl("--root", root, "inspect", env={**_env(nvml_dir, table), "NO_COLOR": "1"})
    assert "GPU holders" in text.stdout and format_size(3 * GiB) in text.stdout
    assert "gc --engines --kill-orphans" in text.stdout


@pytest.mark.parametrize(("env", "why"), [
    ({"LD_LIBRARY_PATH": "/nonexistent"}, "NVML Shared Library Not Found"),
    ({"FAKE_NVML_INIT_ERROR": "9"}, "Driver Not Loaded"),
])
def test_without_nvml_memory_is_unknown_and_said_once(root, gpu_nodes, standins, nvml_dir, env, why) -> None:
    engine, _ = _orphaned_serve(standins, gpu_nodes)
    r = kvctl("--root", root, "inspect", "--json", env={"LD_LIBRARY_PATH": str(nvml_dir), **env})
    doc = json.loads(r.stdout)
    assert _holders(doc)[engine]["gpu_memory_bytes"] is None
    assert why in doc["gpu_memory_note"]


def test_gc_engines_kill_orphans_ends_orphans_waits_for_the_memory_and_keeps_the_rest(
        root, gpu_nodes, standins, nvml_dir, tmp_path) -> None:
    engine, worker = _orphaned_serve(standins, gpu_nodes)
    live = standins.start(node("VLLM::APIServer", "api2", children=(
        node("VLLM::EngineCore", "engine2", hold=(gpu_nodes["nvidia1"],)),)))
    (live_engine,) = standins.pids("engine2")
    table = tmp_path / "nvml"
    table.write_text(f"0 {engine} {3 * GiB}\n1 {worker} {GiB}\n1 {live_engine} {GiB}\n")
    env = _env(nvml_dir, table)
    # Off a terminal and without --yes: nothing is ended.
    r = kvctl("--root", root, "gc", "--engines", "--kill-orphans", "--json", env=env)
    assert json.loads(r.stdout)["killed"] == [] and os.path.exists(f"/proc/{engine}")
    prom = tmp_path / "gc.prom"
    r = kvctl("--root", root, "gc", "--engines", "--kill-orphans", "--yes", "--json", "--prometheus", str(prom),
              env=env, timeout=120)
    doc = json.loads(r.stdout)
    validate(doc, "gc")
    killed = {k["pid"]: k for k in doc["killed"]}
    assert {killed[engine]["outcome"], killed[worker]["outcome"]} == {"terminated"}
    assert "reaped" in killed[engine]["detail"] and "GPU memory back" in killed[engine]["detail"]
    assert live_engine not in killed and live.poll() is None
    wait_for(lambda: not os.path.exists(f"/proc/{engine}") and not os.path.exists(f"/proc/{worker}"))
    metrics = prom.read_text()
    # Node-wide figures: at least this test's two orphans and the 3 GiB NVML gives the engine on GPU 0.
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("kvctl_gpu_"))
    assert int(values["kvctl_gpu_orphan_processes"]) >= 2
    assert int(values['kvctl_gpu_orphan_bytes{gpu="0"}']) >= 3 * GiB
    assert 'kvctl_gpu_holders{state="serving"}' in metrics


def test_doctor_fails_while_an_orphan_holds_a_gpu(root, gpu_nodes, standins, nvml_dir, tmp_path) -> None:
    engine, _ = _orphaned_serve(standins, gpu_nodes)
    table = tmp_path / "nvml"
    table.write_text(f"0 {engine} {3 * GiB}\n")
    r = kvctl("--root", root, "doctor", "--json", "gpu-orphans", env=_env(nvml_dir, table))
    doc = json.loads(r.stdout)
    validate(doc, "doctor")
    (check,) = [c for c in doc["checks"] if c["name"] == "gpu-orphans"]
    assert check["status"] == "fail" and engine in check["details"]["pids"]
    assert format_size(3 * GiB) in check["summary"] and "gc --engines --kill-orphans" in check["fix"]
    assert r.code != 0
