"""Settings are read one way: declared once, parsed alike, read when used, and documented in docs/ENVIRONMENT.md."""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached import settings
from kvcached.settings import Amount, Setting, SettingError

REPO = Path(__file__).resolve().parents[2]
OWN = re.compile(r"^(KVCACHED_|KVCTL_)[A-Z0-9_]+$|^ENABLE_KVCACHED$")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch) -> None:
    """Each test sees its own first warning (settings warn once per variable and value per process)."""
    monkeypatch.setattr(settings, "_warned", set())


@pytest.mark.parametrize("setting, raw, want", [
    (settings.ENABLE, "1", True), (settings.ENABLE, " Yes ", True), (settings.ENABLE, "off", False),
    (settings.ENABLE_KVCACHED, "True", True), (settings.ENABLE_KVCACHED, "false", False),
    (settings.PUBLISH_INTERVAL_S, "0.25", 0.25), (settings.OWNER_RETRY_S, "0", 0.0),
    (settings.ELASTIC_RESERVE_PAGES, "3", 3), (settings.PAGE_SIZE, "65536", 65536),
    (settings.LIMIT, "40G", Amount(bytes=40 << 30)), (settings.LIMIT, "80%", Amount(share=0.8)),
    (settings.LIMIT, "1.5GiB", Amount(bytes=3 << 29)),
    (settings.ROOT, "/tmp/x", "/tmp/x"), (settings.IPC_NAME, "prod a", "prod a"),
    (settings.VLLM_PLUGINS, "", ""),  # blank means something here: an allow-list naming no plugin
    (settings.SGLANG_PLUGINS, "  ", "  "),  # for SGLang, blanks are a list naming no plugin (and "" is no list)
    (settings.KVCTL_LOCK, "/run/x.lock", "/run/x.lock"),
])
def test_values_parse(setting: Setting, raw: str, want: object) -> None:
    assert setting.get({setting.name: raw}) == want


@pytest.mark.parametrize("setting", [s for s in settings.ALL if s.name not in ("VLLM_PLUGINS", "SGLANG_PLUGINS")])
def test_unset_and_blank_mean_the_default(setting: Setting) -> None:
    assert setting.get({}) == setting.default
    assert setting.get({setting.name: "  "}) == setting.default


@pytest.mark.parametrize("setting, raw", [
    (settings.ENABLE, "ture"), (settings.ELASTIC, "2"), (settings.PUBLISH_INTERVAL_S, "0"),
    (settings.PUBLISH_INTERVAL_S, "fast"), (settings.OWNER_EXIT_WAIT_S, "-1"), (settings.OWNER_RETRY_S, "inf"),
    (settings.OWNER_RETRY_S, "nan"), (settings.ELASTIC_RESERVE_PAGES, "1.5"), (settings.PAGE_SIZE, "64k"),
    (settings.PAGE_SIZE, "1000"), (settings.PAGE_SIZE, "0"), (settings.LIMIT, "lots"), (settings.LIMIT, "150%"),
    (settings.LIMIT, "-1G"), (settings.KVCTL_LOCK, "relative.lock"), (settings.NVIDIA_GPUS_DIR, "gpus"),
])
def test_a_bad_value_warns_once_naming_the_variable_and_the_default_is_used(setting: Setting, raw: str,
                                                                            caplog) -> None:
    assert setting.strict is None
    with caplog.at_level(logging.WARNING, logger="kvcached.settings"):
        assert setting.get({setting.name: raw}) == setting.default
        assert setting.get({setting.name: raw}) == setting.default  # read again: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"{setting.name}={raw!r} is not usable" in lines[0] and "using the default" in lines[0]


@pytest.mark.parametrize("setting, raw", [(settings.ROOT, "relative/root"), (settings.REQUIRE_EXT, "maybe")])
def test_strict_settings_refuse_a_bad_value_and_say_why(setting: Setting, raw: str) -> None:
    with pytest.raises(SettingError) as e:
        setting.get({setting.name: raw})
    assert setting.name in str(e.value) and repr(raw) in str(e.value) and "not falling back" in str(e.value)
    assert setting.strict and setting.strict in str(e.value)


def test_only_the_two_documented_settings_are_strict() -> None:
    assert {s.name for s in settings.ALL if s.strict} == {"KVCACHED_ROOT", "KVCACHED_REQUIRE_EXT"}


def test_settings_are_read_when_used_not_at_import(monkeypatch) -> None:
    """The bug of old: a typo read at import disabled two patches for the process's whole life."""
    from kvcached.integration.engine_owner import EngineOwner

    monkeypatch.setenv("KVCACHED_OWNER_EXIT_WAIT_S", "oops")
    assert settings.OWNER_EXIT_WAIT_S.get() == 2.0
    monkeypatch.setenv("KVCACHED_OWNER_EXIT_WAIT_S", "0.5")
    assert settings.OWNER_EXIT_WAIT_S.get() == 0.5
    assert EngineOwner  # importing it read nothing: see test_no_module_reads_a_setting_at_import


def test_no_module_reads_a_setting_at_import() -> None:
    """Import every kvcached and kvctl module with every variable set to garbage: nothing warns or fails."""
    code = (
        "import logging, pkgutil, importlib, kvcached, kvctl\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "skip = ('kvcached.integration.vllm.elastic_alloc',)  # subclasses vLLM's BlockPool: vLLM reads its env\n"
        "for pkg in (kvcached, kvctl):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if m.name not in skip and not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
    )
    env = {**os.environ, **{s.name: "garbage!" for s in settings.ALL}}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "garbage" not in r.stderr, r.stderr[-2000:]


def test_reading_settings_costs_no_heavy_import() -> None:
    """Shell completion reads names through kvcached.node.base.name_rules, which reads a setting: keep it cheap.

    Counted as modules loaded, not as time (benchmarks measure time): without
    site, so that nothing else has loaded them first.
    """
    code = ("import sys, kvcached.settings as s\n"
            "s.IPC_NAME.get({'KVCACHED_IPC_NAME': 'x'}); s.LIMIT.get({})\n"
            "print(sorted(m for m in ('typing', 'logging', 'dataclasses', 'threading', 'kvcached.node') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.strip() == "[]"


def test_declared_once() -> None:
    names = [s.name for s in settings.ALL]
    assert len(names) == len(set(names))
    declared = {v.name for v in vars(settings).values() if isinstance(v, Setting)}
    assert declared == set(names), "a Setting declared in settings.py but missing from settings.ALL"
    assert all(s.doc and s.kind for s in settings.ALL)


def test_page_size_default_is_the_extensions() -> None:
    pages = pytest.importorskip("kvcached.runtime.pages", reason="the compiled extension is not built here")
    assert settings.PAGE_SIZE.default == pages.DEFAULT_PAGE_SIZE


# Every variable named in the code is declared; the docs document exactly the declared set. ----------------


def _code_files() -> list[Path]:
    files = [REPO / "setup.py"] + sorted((REPO / "kvcached").rglob("*.py")) + sorted((REPO / "kvctl").rglob("*.py"))
    return [f for f in files if f.name != "settings.py" or f.parent.name != "kvcached"]


def test_every_variable_the_code_names_is_declared() -> None:
    """A new os.environ read of a KVCACHED_/KVCTL_ variable without a Setting fails here."""
    declared = {s.name for s in settings.ALL}
    named: dict[str, str] = {}
    for f in _code_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and OWN.match(node.value):
                named.setdefault(node.value, f"{f.relative_to(REPO)}:{node.lineno}")
    for f in sorted((REPO / "csrc").glob("*.cpp")):
        for name in re.findall(r'getenv\("([A-Z0-9_]+)"\)', f.read_text()):
            if OWN.match(name):  # CUDA_VISIBLE_DEVICES is CUDA's, read as CUDA reads it
                named.setdefault(name, str(f.relative_to(REPO)))
    assert {n: w for n, w in named.items() if n not in declared} == {}


def _first_column(doc: str) -> dict[str, set[str]]:
    """heading -> every variable named in the first column of a table under it, in `doc`."""
    tables: dict[str, set[str]] = {}
    heading = None
    for line in (REPO / doc).read_text().splitlines():
        if line.startswith("#"):
            heading = line
        elif line.startswith("| `") and heading is not None:
            first = line.split("|")[1]
            for name in re.findall(r"`([A-Z_][A-Z0-9_]*)(?:=[^`]*)?`", first):
                tables.setdefault(heading, set()).add(name)
    return tables


def _env_tables() -> set[str]:
    """Every variable named in the environment tables: docs/ENVIRONMENT.md's, and kvctl's in docs/KVCTL.md."""
    return set().union(*_first_column("docs/ENVIRONMENT.md").values()) | _first_column("docs/KVCTL.md")[
        "## 8. Environment"]


def test_the_docs_document_every_declared_variable_and_only_those() -> None:
    documented = _env_tables()
    declared = {s.name for s in settings.ALL}
    assert declared - documented == set(), "declared in kvcached/settings.py, missing from docs/ENVIRONMENT.md"
    ours = {n for n in documented if OWN.match(n)}
    # docs/ENVIRONMENT.md's "script variable" table: read by the scripts and the test harness, not our code
    script_only = {"KVCACHED_WHEELHOUSE", "KVCACHED_SOAK", "KVCACHED_REQUIRE_VLLM", "KVCACHED_REQUIRE_SGLANG"}
    assert ours - declared == script_only
    for name in script_only:  # and indeed read by no module of kvcached or kvctl
        assert not any(name in f.read_text() for f in _code_files()), name
