"""The vLLM general plugin: its switch, idempotency, never raising, feature detection and the doctor's report."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest

from kvcached.integration import enabled, plugin_allowed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("env, on", [
    ({}, False),
    ({"ENABLE_KVCACHED": "true"}, True),
    ({"ENABLE_KVCACHED": "True"}, True),
    ({"ENABLE_KVCACHED": "false"}, False),
    ({"KVCACHED_ENABLE": "1"}, True),
    ({"KVCACHED_ENABLE": "0"}, False),
    ({"ENABLE_KVCACHED": "false", "KVCACHED_ENABLE": "1"}, True),
])
def test_switch(env: dict[str, str], on: bool) -> None:
    assert enabled(env) is on


@pytest.mark.parametrize("env, allowed", [
    ({}, True),
    ({"VLLM_PLUGINS": "kvcached"}, True),
    ({"VLLM_PLUGINS": "lora_resolver,kvcached"}, True),
    ({"VLLM_PLUGINS": "lora_resolver"}, False),
    ({"VLLM_PLUGINS": ""}, False),  # vLLM parses "" as [""]: an allow-list naming no plugin
    ({"VLLM_PLUGINS": "lora_resolver, kvcached"}, False),  # vLLM compares names exactly: " kvcached" is not ours
])
def test_vllm_plugins_allow_list(env: dict[str, str], allowed: bool) -> None:
    assert plugin_allowed(env) is allowed


def test_importing_the_integration_imports_no_vllm() -> None:
    """kvctl imports the integration to call detect(): only the call may import vLLM."""
    code = ("import sys, kvcached.integration.vllm_patches, kvcached.integration.vllm_plugin, "
            "kvcached.integration.engine_owner, kvcached.integration.engine_state, kvcached.integration.limits\n"
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})


def test_entry_point_is_declared() -> None:
    try:
        eps = metadata.entry_points(group="vllm.general_plugins")
    except Exception as e:  # pragma: no cover - very old importlib.metadata
        pytest.skip(f"entry points unreadable: {e}")
    ours = [ep for ep in eps if ep.name == "kvcached"]
    if not ours:
        pytest.skip("kvcached is not installed into this environment (pip install -e .), so no entry point")
    assert ours[0].value == "kvcached.integration.vllm_plugin:register"


# With vLLM ------------------------------------------------------------------------------

ALL_PATCHES = ("lmcache-shutdown", "owner-cleanup", "worker-listener", "engine-state")

_skip_without_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")


def needs_vllm(fn):
    return pytest.mark.vllm(_skip_without_vllm(fn))


@pytest.fixture
def clean_patches(monkeypatch):
    from kvcached.integration import vllm_patches, vllm_plugin

    vllm_patches.revert()
    monkeypatch.setattr(vllm_patches, "_warned", set())
    monkeypatch.setattr(vllm_plugin, "_done", False)
    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    monkeypatch.delenv("KVCACHED_ENABLE", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("KVCACHED_ELASTIC", raising=False)
    yield vllm_patches
    vllm_patches.revert()
    vllm_plugin.unroute_logs()


@needs_vllm
def test_disabled_plugin_does_nothing(clean_patches) -> None:
    from kvcached.integration import vllm_plugin

    vllm_plugin.register()
    assert clean_patches.applied() == ()


@needs_vllm
def test_vllm_loads_the_plugin_once_per_process(clean_patches, monkeypatch) -> None:
    """vLLM's own load_general_plugins() finds and runs it; calling it again wraps nothing twice."""
    import vllm.plugins
    from vllm.v1.engine import utils as vutils

    if not any(ep.name == "kvcached" for ep in metadata.entry_points(group="vllm.general_plugins")):
        pytest.skip("kvcached is not installed into this environment (pip install -e .), so vLLM cannot find it")
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert clean_patches.applied() == ALL_PATCHES
    wrapper = vutils.CoreEngineProcManager.shutdown
    from kvcached.integration import vllm_plugin

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    vllm_plugin.register()
    clean_patches.apply()
    assert vutils.CoreEngineProcManager.shutdown is wrapper
    assert not hasattr(wrapper.__kvcached_original__, "__kvcached_original__")


@needs_vllm
def test_plugin_never_raises_into_vllm(clean_patches, monkeypatch, caplog) -> None:
    """The failure is logged, through vLLM's handlers (where vLLM's own lines go), and vLLM goes on."""
    from kvcached.integration import vllm_plugin

    def boom(*_a, **_k):
        raise RuntimeError("patching exploded")

    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    monkeypatch.setattr(clean_patches, "apply", boom)
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    try:
        vllm_plugin.register()
    finally:
        vllm_logger.removeHandler(caplog.handler)
    assert "patching exploded" in caplog.text


def _in_fork(fn, out_path: str) -> int:
    """Run `fn` in a forked child (vLLM already imported) with its stdout and stderr in `out_path`; its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            fn()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@needs_vllm
def test_kvcached_logs_appear_in_vllms_stream_and_format(clean_patches, tmp_path, monkeypatch) -> None:
    """vLLM configures only the `vllm` logger (propagate False): without routing, kvcached's INFO lines vanish."""

    def child() -> None:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging

        from kvcached.integration import vllm_plugin

        logging.getLogger("kvcached.node.owner").info("before routing")
        vllm_plugin.route_logs_to_vllm()  # the plugin may load before vLLM configures logging
        configure_logging(LoggingConfig())  # what vLLM does in every process it starts
        logging.getLogger("kvcached.node.owner").info("owner removed /dev/shm/x")
        logging.getLogger("kvcached.node.owner").debug("not at vLLM level")
        logging.getLogger("vllm.test").info("a vllm line")

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("NO_COLOR", "1")
    out_path = str(tmp_path / "out")
    status = _in_fork(child, out_path)
    out = open(out_path).read()
    assert status == 0, out
    ours = [ln for ln in out.splitlines() if "owner removed /dev/shm/x" in ln]
    theirs = [ln for ln in out.splitlines() if "a vllm line" in ln]
    assert len(ours) == 1 and len(theirs) == 1, out
    # vLLM's format: "(<process> pid=<pid>) INFO <date> <time> [<file>:<line>] <message>", for both.
    vllm_format = re.compile(r"^\(\S+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[test_vllm_plugin.py:\d+\] ")
    assert vllm_format.match(ours[0]) and vllm_format.match(theirs[0]), out
    assert "before routing" not in out and "not at vLLM level" not in out


@needs_vllm
def test_unknown_shape_disables_only_that_patch_with_one_warning(clean_patches, monkeypatch, caplog) -> None:
    from vllm.v1.executor.multiproc_executor import WorkerProc

    def shutdown(self, timeout):  # a future vLLM's different signature
        return None

    monkeypatch.setattr(WorkerProc, "shutdown", shutdown)
    with caplog.at_level(logging.WARNING, logger="kvcached.integration.vllm"):
        first = clean_patches.apply()
        second = clean_patches.apply()
    assert first == second == {"lmcache-shutdown": True, "owner-cleanup": True, "worker-listener": False,
                               "engine-state": True,
                               "elastic-kv": False}  # off: KVCACHED_ELASTIC is not set
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "worker-listener" in warnings[0] and "WorkerProc.shutdown" in warnings[0]
    assert WorkerProc.shutdown is shutdown
    status = {p.name: p for p in clean_patches.detect().patches}
    assert not status["worker-listener"].applicable and "unknown vLLM shape" in status["worker-listener"].detail


@needs_vllm
def test_detect_reports_conditions_and_patches(clean_patches, monkeypatch) -> None:
    report = clean_patches.detect()
    assert report.vllm_version == "0.33.0" and report.error is None
    conditions = {c.name: c.present for c in report.conditions}
    assert conditions == {"shutdown-timeout-zero": True, "sigterm-reset-before-teardown": True,
                          "lmcache-no-shutdown-forwarding": True}
    lifecycle = [p for p in report.patches if p.name != "elastic-kv"]
    assert all(p.applicable and not p.applied and not p.active for p in lifecycle)
    elastic = next(p for p in report.patches if p.name == "elastic-kv")  # opt-in, off here
    assert not elastic.active and "KVCACHED_ELASTIC=1" in elastic.detail
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    assert all(p.active and not p.applied for p in clean_patches.detect().patches if p.name != "elastic-kv")
    clean_patches.apply()
    d = clean_patches.detect().to_dict()
    assert all(p["applied"] and p["active"] for k, p in d["patches"].items() if k != "elastic-kv")
    assert d["conditions"]["lmcache-no-shutdown-forwarding"]["present"] is True  # vLLM's own class, not ours
    json.dumps(d)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.enabled = True  # type: ignore[misc]  # frozen


@needs_vllm
def test_doctor_probe_reads_the_report() -> None:
    """kvctl doctor runs this probe in a subprocess; it must print the report as one JSON line."""
    diagnostics = pytest.importorskip("kvcached.node.diagnostics")
    r = subprocess.run([sys.executable, "-c", diagnostics._DETECT_PROBE], capture_output=True, text=True,
                       env={**os.environ, "ENABLE_KVCACHED": "true", "PYTHONPATH": REPO}, timeout=120)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(diagnostics._DETECT_MARK))
    data = json.loads(line[len(diagnostics._DETECT_MARK):])
    assert set(data["conditions"]) == {"shutdown-timeout-zero", "sigterm-reset-before-teardown",
                                       "lmcache-no-shutdown-forwarding"}
    assert {k for k, v in data["patches"].items() if v["active"]} == set(ALL_PATCHES)
    assert data["plugin_allowed"] is True


@needs_vllm
def test_vllm_plugins_excluding_kvcached_makes_every_patch_inactive(clean_patches, monkeypatch) -> None:
    """vLLM skips a plugin VLLM_PLUGINS does not list: detect() and doctor say inactive, with the fix."""
    from kvcached.node.diagnostics import vllm_results

    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver")
    d = clean_patches.detect().to_dict()
    assert d["plugin_allowed"] is False and d["vllm_plugins"] == "lora_resolver"
    assert not any(p["active"] for p in d["patches"].values())
    results = {r.name: r for r in vllm_results(d)}
    assert "inactive" in results["vllm"].summary and results["vllm"].status == "warn"
    assert results["vllm-plugins"].fix.startswith("export VLLM_PLUGINS=lora_resolver,kvcached")
    assert all("inactive" in results[f"vllm-patch:{n}"].summary for n in ALL_PATCHES)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver,kvcached")
    patches = clean_patches.detect().to_dict()["patches"]
    assert all(patches[n]["active"] for n in ALL_PATCHES)  # elastic-kv: opt-in, off without KVCACHED_ELASTIC


def test_detect_without_vllm_reports_why(monkeypatch) -> None:
    """Where vLLM cannot be imported, detect() still returns a report (and never raises)."""
    from kvcached.integration import vllm_patches

    def missing(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(vllm_patches, "_module", missing)
    report = vllm_patches.detect()
    assert report.vllm_version is None and "not importable" in (report.error or "")
    assert report.to_dict()["patches"] == {} and report.to_dict()["schema"] == vllm_patches.SCHEMA
