"""The layer-1 operations behind kvctl, as pure tables: process roles, metrics text, the gc lock path."""

from __future__ import annotations

import os

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.cleanup import Report
from kvcached.node.clean.facts import ProcessInfo
from kvcached.node.ops.metrics import previous_value, render, write_textfile
from kvcached.node.ops.view import Role, classify_process
from kvcached.node.state.gclock import GcLock, LockBusy, lock_path


def proc(cmdline: tuple[str, ...], comm: str = "python3") -> ProcessInfo:
    return ProcessInfo(1, 0.0, 0, 1, 0, comm, cmdline, None, frozenset(), frozenset(), None, None, frozenset())


@pytest.mark.parametrize(
    "cmdline, comm, role, rank, stage",
    [
        (("VLLM::EngineCore",), "VLLM::EngineCor", Role.ENGINE, None, None),
        (("VLLM::Worker_TP0_PP1",), "VLLM::Worker_TP", Role.WORKER, 0, 1),
        (("VLLM::Worker_TP3",), "VLLM::Worker_TP", Role.WORKER, 3, None),
        (("python",), "VLLM::Worker_TP", Role.WORKER, None, None),  # title only in comm (truncated)
        (("VllmWorker-2",), "VllmWorker-2", Role.WORKER, 2, None),
        (("/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m"), "python3", Role.API, None, None),
        (("vllm", "serve", "meta-llama/Llama-3"), "vllm", Role.API, None, None),
        (("python", "-m", "vllm.entrypoints.openai.api_server"), "python", Role.API, None, None),
        (("VLLM::APIServer",), "VLLM::APIServer", Role.API, None, None),
        # SGLang: a scheduler is a worker (TP rank, PP stage from its title; each part only when above 1).
        (("sglang::scheduler_TP1",), "sglang::schedul", Role.WORKER, 1, 0),
        (("sglang::scheduler",), "sglang::schedul", Role.WORKER, 0, 0),
        (("sglang::scheduler_DP1_PP1_TP3_EP2",), "sglang::schedul", Role.WORKER, 3, 1),
        (("sglang::scheduler_DP0_ATTN_CP1_MOE_DP1_TP2",), "sglang::schedul", Role.WORKER, 2, 0),
        (("python",), "sglang::schedul", Role.WORKER, None, None),  # title only in comm: the ranks cut off
        (("sglang::detokenizer",), "sglang::detoken", Role.API, None, None),
        (("sglang::tokenizer_worker:4242",), "sglang::tokeniz", Role.API, None, None),
        (("sglang::data_parallel_controller",), "sglang::data_pa", Role.ENGINE, None, None),
        (("python",), "sglang::data_pa", Role.ENGINE, None, None),
        (("/usr/bin/python3", "/usr/local/bin/sglang", "serve", "--model-path", "m"), "python3", Role.API, None, None),
        (("python", "-m", "sglang.launch_server", "--model-path", "m"), "python", Role.API, None, None),
        (("python", "offline_sglang.py"), "python", Role.OTHER, None, None),  # main by its tree: build_view
        (
            (
                "python",
                "-m",
                "kvcached.runtime.harness",
                "--role",
                "worker",
                "--name",
                "x",
                "--rank",
                "1",
                "--stage",
                "2",
            ),
            "python",
            Role.WORKER,
            1,
            2,
        ),
        (
            ("python", "-m", "kvcached.runtime.harness", "--role", "engine", "--name", "x"),
            "python",
            Role.ENGINE,
            None,
            None,
        ),
        (("python", "-m", "kvcached.runtime.harness", "--role", "api", "--name", "x"), "python", Role.API, None, None),
        (("python", "train.py"), "python", Role.OTHER, None, None),
        (("bash",), "bash", Role.OTHER, None, None),
    ],
)
def test_roles(cmdline, comm, role, rank, stage) -> None:
    info = classify_process(proc(cmdline, comm))
    assert (info.role, info.rank, info.stage) == (role, rank, stage)


def test_metrics_text_and_atomic_write(tmp_path) -> None:
    empty = Report(dry_run=False, entries=[], errors=[], started=1000.0, finished=1000.5)
    text = render(empty, success=True)
    assert 'kvctl_gc_entries{kind="segment",state="stale"} 0' in text
    assert "kvctl_gc_last_success_timestamp_seconds 1000.5" in text
    assert "# TYPE kvctl_gc_failures gauge" in text
    path = str(tmp_path / "m.prom")
    write_textfile(path, text)
    assert previous_value(path, "kvctl_gc_last_success_timestamp_seconds") == 1000.5
    failed = render(Report(dry_run=False, entries=[], errors=[], started=2000.0, finished=2000.0), success=False,
                    last_success=1000.5)
    assert "kvctl_gc_last_run_timestamp_seconds 2000" in failed
    assert "kvctl_gc_last_success_timestamp_seconds 1000.5" in failed  # carried, not reset
    assert os.listdir(tmp_path) == ["m.prom"]


def test_gc_lock(layout, monkeypatch) -> None:
    assert lock_path(layout) == os.path.join(layout.tmp_dir, "kvctl-gc.lock")
    os.makedirs(os.path.join(layout.root, "run/lock"))
    os.chmod(os.path.join(layout.root, "run"), 0o1777)  # others may plant in run/: not root's own place
    assert lock_path(layout) == os.path.join(layout.root, "run/lock/kvctl-gc.lock")
    if os.geteuid() == 0:
        os.chmod(os.path.join(layout.root, "run"), 0o755)  # root's, and only root writes there
        assert lock_path(layout) == os.path.join(layout.root, "run/kvctl-gc.lock")
    monkeypatch.setenv("KVCTL_LOCK", "/x/y.lock")
    assert lock_path(Layout("/")) == "/x/y.lock"
    monkeypatch.delenv("KVCTL_LOCK")
    with GcLock(layout):
        with pytest.raises(LockBusy) as e:
            GcLock(layout).acquire()
        assert e.value.pids == (os.getpid(),)
    with GcLock(layout):
        pass  # released on exit


def test_a_planted_link_at_the_lock_path_is_refused(layout) -> None:
    from .conftest import assert_one_line_error, kvctl

    os.symlink("/etc/passwd", os.path.join(layout.tmp_dir, "kvctl-gc.lock"))
    r = kvctl("--root", layout.root, "gc", "--yes")
    assert_one_line_error(r, 1)
    assert "symbolic link" in r.stderr


def test_doctor_names_ray_backed_vllm_processes() -> None:
    """Ray is not covered: doctor warns about Ray-backed vLLM processes it finds, and notes Ray merely installed.

    What such a process looks like is the vLLM integration's (the `ray` hazard of its detect section); doctor
    reads it from the document and matches it against the node's processes.
    """
    import json
    from types import SimpleNamespace

    from kvcached.integration.vllm.detect import RAY_PROCESSES, ray_hazard
    from kvcached.node.ops.detectdoc import DetectDocument, EngineSection, Plugin, parse
    from kvcached.node.ops.diagnostics import Status, engine_results

    procs = [
        SimpleNamespace(pid=10, cmdline=("vllm", "serve", "m", "--distributed-executor-backend", "ray")),
        SimpleNamespace(pid=11, cmdline=("ray::RayWorkerProc.initialize_worker",)),
        SimpleNamespace(pid=12, cmdline=("vllm", "serve", "m", "--data-parallel-backend=ray")),
        SimpleNamespace(pid=13, cmdline=("vllm", "serve", "m", "--distributed-executor-backend", "mp")),
        SimpleNamespace(pid=14, cmdline=("ray::IDLE",)),
        SimpleNamespace(pid=15, cmdline=()),
    ]
    assert [p.pid for p in procs if RAY_PROCESSES.matches(p.cmdline)] == [10, 11, 12]

    def ray_results(installed: bool, processes: list) -> list:
        section = EngineSection(version="0.33.0", error=None, plugin=Plugin(enabled=True, allowed=True),
                                label="vLLM", hazards=(ray_hazard(installed),))
        doc = parse(json.loads(json.dumps(DetectDocument(engines={"vllm": section}).to_dict())))
        return [r for r in engine_results("vllm", doc.engines["vllm"], processes) if r.name == "vllm-ray"]

    (warn,) = ray_results(True, procs[:2])
    assert warn.status is Status.WARN and "PID 10, 11" in warn.summary and "not covered" in warn.summary
    assert warn.details["pids"] == [10, 11] and warn.under == "vllm" and "gc --yes" in (warn.fix or "")
    (warn,) = ray_results(False, procs)  # a Ray-backed serve of another install: found all the same
    assert warn.status is Status.WARN and warn.details["pids"] == [10, 11, 12]
    (note,) = ray_results(True, [])
    assert note.status is Status.SKIP and "not covered" in note.summary
    assert ray_results(False, []) == []
