"""The vLLM general plugin: its switch, idempotency, never raising, feature detection and the detect document."""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest

from kvcached.integration import enabled
from kvcached.integration.patchkit import PatchStatus
from kvcached.integration.vllm.common import plugin_allowed
from kvcached.node.ops.detectdoc import parse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("env, on", [
    ({}, False),
    ({"ENABLE_KVCACHED": "true"}, True),
    ({"ENABLE_KVCACHED": "True"}, True),
    ({"ENABLE_KVCACHED": "false"}, False),
    ({"KVCACHED_ENABLE": "1"}, True),
    ({"KVCACHED_ENABLE": "0"}, False),
    ({"ENABLE_KVCACHED": "false", "KVCACHED_ENABLE": "1"}, True),
    ({"KVCACHED_ELASTIC": "yes"}, True),  # elastic KV needs the other patches: it turns the plugin on
    ({"KVCACHED_ENABLE": "ture"}, False),  # a typo: one warning, then the default (off)
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


def test_a_relative_root_makes_kvcached_stand_aside_in_the_engine(monkeypatch, uniq, caplog) -> None:
    """KVCACHED_ROOT is strict: a relative one is not taken for `/`, so nothing lands on the real node."""
    from types import SimpleNamespace

    from kvcached.integration.vllm.claim import start_engine

    monkeypatch.setenv("KVCACHED_ROOT", "relative/root")
    monkeypatch.setenv("KVCACHED_IPC_NAME", uniq)
    executor = SimpleNamespace(parallel_config=SimpleNamespace(), vllm_config=SimpleNamespace())
    with caplog.at_level(logging.WARNING, logger="kvcached.integration.vllm"):
        assert start_engine(executor, serve=True) is None
    assert "engine state not set up: KVCACHED_ROOT='relative/root': not an absolute path" in caplog.text
    assert not os.path.lexists(f"/dev/shm/{uniq}") and not glob.glob(f"/tmp/kvcached-tp-{uniq}-*")


def test_entry_point_is_declared() -> None:
    try:
        eps = metadata.entry_points(group="vllm.general_plugins")
    except Exception as e:  # pragma: no cover - very old importlib.metadata
        pytest.skip(f"entry points unreadable: {e}")
    ours = [ep for ep in eps if ep.name == "kvcached"]
    if not ours:
        pytest.skip("kvcached is not installed into this environment (pip install -e .), so no entry point")
    assert ours[0].value == "kvcached.integration.vllm.plugin:register"


# With vLLM ------------------------------------------------------------------------------

ALL_PATCHES = ("lmcache-shutdown", "owner-cleanup", "worker-listener", "engine-state")

_skip_without_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")


def needs_vllm(fn):
    return pytest.mark.vllm(_skip_without_vllm(fn))


@pytest.fixture
def clean_patches(monkeypatch):
    from kvcached.integration.vllm import plugin
    from kvcached.integration.vllm.patches import REGISTRY

    REGISTRY.revert()
    monkeypatch.setattr(REGISTRY, "_warned", set())
    monkeypatch.setattr(plugin._once, "done", False)
    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    monkeypatch.delenv("KVCACHED_ENABLE", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("KVCACHED_ELASTIC", raising=False)
    yield REGISTRY
    REGISTRY.revert()
    plugin.unroute_logs()


def _statuses(registry) -> dict[str, PatchStatus]:
    return {p.name: p.status for p in registry.report()}


@needs_vllm
def test_disabled_plugin_does_nothing(clean_patches) -> None:
    from kvcached.integration.vllm import plugin

    plugin.register()
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
    from kvcached.integration.patchkit import is_ours, original
    from kvcached.integration.vllm import plugin

    wrapper = vutils.CoreEngineProcManager.__dict__["shutdown"]
    assert is_ours(wrapper) and not is_ours(wrapper.__wrapped__)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    plugin.register()
    clean_patches.apply()
    assert vutils.CoreEngineProcManager.__dict__["shutdown"] is wrapper  # wrapped once, however often loaded
    clean_patches.revert()
    assert vutils.CoreEngineProcManager.__dict__["shutdown"] is original(wrapper)


@needs_vllm
def test_plugin_never_raises_into_vllm(clean_patches, monkeypatch, caplog) -> None:
    """The failure is logged, through vLLM's handlers (where vLLM's own lines go), and vLLM goes on."""
    from kvcached.integration.vllm import plugin

    def boom(*_a, **_k):
        raise RuntimeError("patching exploded")

    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    monkeypatch.setattr(clean_patches, "apply", boom)
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    try:
        plugin.register()
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

        from kvcached.integration.vllm import plugin

        logging.getLogger("kvcached.node.owner").info("before routing")
        plugin.route_logs_to_vllm()  # the plugin may load before vLLM configures logging
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
    vllm_format = re.compile(r"^\(\S+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[test_plugin.py:\d+\] ")
    assert vllm_format.match(ours[0]) and vllm_format.match(theirs[0]), out
    assert "before routing" not in out and "not at vLLM level" not in out


@needs_vllm
def test_unknown_shape_disables_only_that_patch_and_what_requires_it(clean_patches, monkeypatch, caplog) -> None:
    """One warning for the unknown shape, one for elastic-kv that requires it; the others still apply."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    def shutdown(self, timeout):  # a future vLLM's different signature
        return None

    monkeypatch.setattr(WorkerProc, "shutdown", shutdown)
    monkeypatch.setenv("KVCACHED_ELASTIC", "1")
    with caplog.at_level(logging.WARNING, logger="kvcached.integration.vllm"):
        first = clean_patches.apply()
        second = clean_patches.apply()
    A, U, N = PatchStatus.APPLIED, PatchStatus.UNKNOWN_SHAPE, PatchStatus.NOT_COVERED
    assert first == second == {"lmcache-shutdown": A, "owner-cleanup": A, "worker-listener": U,
                               "engine-state": A, "elastic-kv": N}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # once per patch and process, however often the plugin loads
    assert "worker-listener" in warnings[0] and "WorkerProc.shutdown" in warnings[0]
    assert "elastic-kv" in warnings[1] and "requires worker-listener, which is unknown_shape" in warnings[1]
    assert WorkerProc.shutdown is shutdown
    report = {p.name: p for p in clean_patches.report()}
    assert report["worker-listener"].status is U and "WorkerProc.shutdown" in report["worker-listener"].reason


@needs_vllm
def test_elastic_kv_stands_aside_naming_exactly_what_differs(clean_patches, monkeypatch) -> None:
    """A changed target: the reason names that attribute or signature, and nothing that is still as expected."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    monkeypatch.setenv("KVCACHED_ELASTIC", "1")
    assert {p.name: p for p in clean_patches.report()}["elastic-kv"].status is PatchStatus.READY

    fields = KVCacheBlock.__dataclass_fields__
    monkeypatch.setattr(KVCacheBlock, "__dataclass_fields__", {k: v for k, v in fields.items() if k != "is_null"})
    reason = {p.name: p for p in clean_patches.report()}["elastic-kv"].reason
    assert reason == "KVCacheBlock has no field is_null"
    monkeypatch.setattr(KVCacheBlock, "__dataclass_fields__", fields)

    def free_blocks(self, blocks, evict_first=False):  # a future vLLM's rename
        return None

    monkeypatch.setattr(BlockPool, "free_blocks", free_blocks)
    elastic = {p.name: p for p in clean_patches.report()}["elastic-kv"]
    assert elastic.status is PatchStatus.UNKNOWN_SHAPE
    assert elastic.reason.startswith("BlockPool.free_blocks(self, blocks, evict_first) has none of the known shapes")
    assert "vLLM 0.34's (self, ordered_blocks, evict_first): parameter 2 is blocks, not ordered_blocks" \
        in elastic.reason


@needs_vllm
def test_detect_reports_conditions_and_patches(clean_patches, monkeypatch) -> None:
    from kvcached.integration.vllm.detect import section

    eng = section()
    assert eng.version == metadata.version("vllm") and eng.error is None
    assert {c.name: c.present for c in eng.conditions} == {
        "shutdown-timeout-zero": True, "sigterm-reset-before-teardown": True, "lmcache-no-shutdown-forwarding": True}
    lifecycle = {p.name: p for p in eng.patches if p.name != "elastic-kv"}
    assert set(lifecycle) == set(ALL_PATCHES)
    assert all(p.status is PatchStatus.READY and not eng.patch_active(p) for p in lifecycle.values())
    elastic = next(p for p in eng.patches if p.name == "elastic-kv")  # opt-in, off here
    assert elastic.status is PatchStatus.DISABLED and "KVCACHED_ELASTIC=1" in elastic.reason
    assert elastic.requires == ("worker-listener",)
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    eng = section()
    assert all(eng.patch_active(p) for p in eng.patches if p.name != "elastic-kv")
    clean_patches.apply()
    eng = section()
    assert {p.name for p in eng.patches if p.status is PatchStatus.APPLIED} == set(ALL_PATCHES)
    conditions = {c.name: c.present for c in eng.conditions}
    assert conditions["lmcache-no-shutdown-forwarding"] is True  # vLLM's own class, not our override
    assert parse(json.loads(json.dumps({"schema": "kvcached.detect/1", "engines": {"vllm": eng.to_dict()}})))


def _detect(env: dict[str, str]) -> dict:
    """`python -m kvcached.integration.detect --json` as doctor runs it: its stdout is one JSON document."""
    r = subprocess.run([sys.executable, "-m", "kvcached.integration.detect", "--json"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": REPO, **env}, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@needs_vllm
def test_the_detect_entry_prints_the_document_doctor_reads() -> None:
    """One entry for doctor: the whole of stdout is the document (vLLM's import-time logs go to stderr)."""
    data = _detect({"ENABLE_KVCACHED": "true", "VLLM_LOGGING_LEVEL": "DEBUG"})
    doc = parse(data)
    eng = doc.engines["vllm"]
    assert {c.name for c in eng.conditions} == {"shutdown-timeout-zero", "sigterm-reset-before-teardown",
                                                "lmcache-no-shutdown-forwarding"}
    assert {p.name for p in eng.patches if eng.patch_active(p)} == set(ALL_PATCHES)
    assert eng.plugin.allowed is True and eng.facts["ray_installed"] is False
    assert eng.label == "vLLM" and eng.plugin.fix is None  # enabled and allowed: nothing to fix
    (ray,) = eng.hazards  # Ray is not installed here: no note, but doctor still looks for Ray-backed serves
    assert ray.name == "ray" and ray.report_absent is False and ray.processes is not None


@needs_vllm
def test_vllm_plugins_excluding_kvcached_makes_every_patch_inactive(clean_patches, monkeypatch) -> None:
    """vLLM skips a plugin VLLM_PLUGINS does not list: detect and doctor say inactive, with the fix."""
    from kvcached.integration.vllm.detect import section
    from kvcached.node.ops.diagnostics import Status, engine_results

    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver")
    eng = section()
    assert eng.plugin.allowed is False and eng.plugin.allow_list == "lora_resolver"
    assert not any(eng.patch_active(p) for p in eng.patches)
    results = {r.name: r for r in engine_results("vllm", eng)}
    assert "inactive" in results["vllm"].summary and results["vllm"].status is Status.WARN
    assert (results["vllm-plugins"].fix or "").startswith("export VLLM_PLUGINS=lora_resolver,kvcached")
    assert all("inactive" in results[f"vllm-patch:{n}"].summary for n in ALL_PATCHES)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver,kvcached")
    eng = section()
    assert all(eng.patch_active(p) for p in eng.patches if p.name in ALL_PATCHES)  # elastic-kv: opt-in, off


@needs_vllm
def test_kvctl_doctor_says_enable_kvcached_once_for_vllm(layout) -> None:
    """A new user's first run: vLLM installed, kvcached not switched on. One fix for vLLM, its patches under it."""
    from tests.conftest import KVCTL

    env = {k: v for k, v in os.environ.items()
           if k not in ("ENABLE_KVCACHED", "KVCACHED_ENABLE", "KVCACHED_ELASTIC", "VLLM_PLUGINS")}
    r = subprocess.run([KVCTL, "--root", layout.root, "doctor", "engine"], env=env, capture_output=True, text=True,
                       timeout=400, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    # Once for vLLM; SGLang, installed beside it, gets the same switch in its own fix line (issue 38).
    assert r.stdout.count("export ENABLE_KVCACHED=true (kvcached's vLLM plugin") == 1, r.stdout
    if "warn sglang " in r.stdout:
        assert "fix: export ENABLE_KVCACHED=true (kvcached's SGLang plugin" in r.stdout, r.stdout
    # No serve runs under this root: what follows is said to be this shell's environment, not a serve's.
    assert "serve of an engine kvcached integrates with runs with KVCACHED_ROOT=" in r.stdout
    assert "this shell's environment" in r.stdout
    lines = r.stdout.splitlines()
    (engine,) = [i for i, ln in enumerate(lines) if ln.startswith("  warn vllm ")]
    assert "fix: export ENABLE_KVCACHED=true" in lines[engine + 1]
    for name in ALL_PATCHES:  # each listed under vLLM's line, without a fix of its own
        (i,) = [i for i, ln in enumerate(lines) if ln.startswith(f"    warn vllm-patch:{name} ")]
        assert "inactive" in lines[i] and "fix: " not in lines[i + 1]


def test_detect_without_vllm_reports_why(monkeypatch) -> None:
    """Where vLLM cannot be imported, the section still comes back (and never raises)."""
    from kvcached.integration.vllm import detect

    def missing(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(detect, "module", missing)
    eng = detect.section()
    assert eng.version is None and "not importable" in (eng.error or "") and eng.patches == ()
    parse({"schema": "kvcached.detect/1", "engines": {"vllm": eng.to_dict()}})
