"""The alerts (contrib/prometheus/, contrib/kubernetes/kvctl-gc-prometheusrule.yaml): checked and unit-tested by
Prometheus's own promtool, each with a runbook section, the severity its impact has, and one set of rules for
both ways of deploying them.

promtool is Debian's `prometheus` package's (.ci/run installs it); where it is absent the promtool tests skip,
saying so. That promtool really tests is shown by a rule changed in a copy, which its unit tests then fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).parents[2]
RULES = REPO / "contrib/prometheus/kvctl-gc-rules.yml"
RULE_TESTS = REPO / "contrib/prometheus/kvctl-gc-rules.test.yml"
OPERATOR = REPO / "contrib/kubernetes/kvctl-gc-prometheusrule.yaml"
RUNBOOK = REPO / "docs/RUNBOOK.md"
BASE = "https://docs.example.com/kvcached/RUNBOOK.md#"
CRITICAL = {"KvctlGpuOrphanHeld", "KvctlPlaceFull"}  # a GPU held by an orphan, a place >= 95 % full (issue 38)

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra (kubernetes-validate)")


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _rules() -> list[dict[str, Any]]:
    return [r for g in _load(RULES)["groups"] for r in g["rules"]]


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in _rules()}


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run does)")
    return found


def test_the_operators_rule_holds_the_same_groups_as_the_plain_rules() -> None:
    assert _load(OPERATOR)["spec"]["groups"] == _load(RULES)["groups"]


def test_promtool_checks_the_rules() -> None:
    r = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"SUCCESS: {len(_rules())} rules found" in r.stdout, r.stdout + r.stderr


def test_promtool_unit_tests_pass() -> None:
    r = subprocess.run([_promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_the_unit_tests_catch_a_changed_rule(tmp_path: Path) -> None:
    """A threshold moved and a severity lowered in a copy of the rules: promtool's tests of them fail."""
    text = RULES.read_text()
    for old, new in (("> 1800", "> 7200"), ("severity: critical", "severity: warning")):
        assert old in text
        (tmp_path / RULES.name).write_text(text.replace(old, new))
        shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
        r = subprocess.run([_promtool(), "test", "rules", str(tmp_path / RULE_TESTS.name)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr, (old, r.stdout, r.stderr)


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    cases: dict[str, set[bool]] = {}
    for t in _load(RULE_TESTS)["tests"]:
        for case in t.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    assert {a: cases.get(a) for a in _alerts()} == {a: {True, False} for a in _alerts()}
    assert set(cases) <= set(_alerts()), "a test of an alert that does not exist"


def test_every_alert_says_what_where_and_links_its_runbook_section() -> None:
    sections = _runbook_sections()
    for name, rule in _alerts().items():
        ann = rule["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url"}, name
        assert ann["runbook_url"] == BASE + name.lower(), name
        assert name in sections, f"docs/RUNBOOK.md has no section for {name}"
        if name != "KvctlGcMetricsAbsent":  # the one alert about every node at once
            assert "$labels.node" in ann["summary"] and "$labels.instance" in ann["summary"], name


def test_severities_follow_impact() -> None:
    assert {n: r["labels"]["severity"] for n, r in _alerts().items()} == {
        n: "critical" if n in CRITICAL else "warning" for n in _alerts()}


def test_the_new_alerts_watch_gpu_orphans_place_fill_and_each_node() -> None:
    alerts = _alerts()
    assert "kvctl_gpu_orphan_processes" in alerts["KvctlGpuOrphanHeld"]["expr"]
    for name in ("KvctlPlaceFilling", "KvctlPlaceFull"):
        assert "kvctl_place_used_bytes / kvctl_place_capacity_bytes" in alerts[name]["expr"], name
    assert "predict_linear(kvctl_place_used_bytes[1h], 3600) >= kvctl_place_capacity_bytes" in \
        alerts["KvctlPlaceFullWithinHour"]["expr"]
    assert alerts["KvctlGcAgentDown"]["expr"] == 'up{job="kvctl-gc"} == 0'
    assert "kvctl_gc_last_run_timestamp_seconds" in alerts["KvctlGcNoRecentRun"]["expr"]
    # The engine-metrics alert is the agent's: cron and systemd runs (README's jobs, no --engines) never fire it.
    assert alerts["KvctlGcEngineMetricsAbsent"]["expr"].startswith("kvctl_gc_every_seconds unless")


def _runbook_sections() -> dict[str, str]:
    text = RUNBOOK.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_runbook_has_one_section_per_alert_each_in_four_parts() -> None:
    sections = _runbook_sections()
    assert set(sections) - {"Reaching the node"} == set(_alerts())
    for name in _alerts():
        body = sections[name]
        for part in ("**What it means.**", "**Confirm.**", "**Do.**", "**Never.**"):
            assert part in body, (name, part)
        assert re.search(r"```sh\n.*\bkvctl\b", body, re.S) or "As for" in body, f"{name}: no kvctl command"


def _help_options(command: str) -> set[str]:
    kvctl = shutil.which("kvctl", path=str(Path(__import__("sys").executable).parent))
    assert kvctl is not None
    r = subprocess.run([kvctl, command, "--help"], capture_output=True, text=True, timeout=60,
                       env={"COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(?<![\w-])(?:--[a-z][a-z0-9-]*|-[A-Za-z])\b", r.stdout))


def test_the_runbooks_kvctl_commands_take_only_options_kvctl_has() -> None:
    """Every `kvctl COMMAND ...` in the runbook's shell blocks names options that command's --help lists."""
    blocks = re.findall(r"```sh\n(.*?)```", RUNBOOK.read_text(), re.S)
    commands = [m.group(1).split("#")[0].split("|")[0].split()
                for b in blocks for m in re.finditer(r"(?:^|-- )(kvctl [^\n;]*)", b, re.M)]
    assert len(commands) >= 15
    accepted: dict[str, set[str]] = {}
    for argv in commands:
        sub = argv[1]
        accepted.setdefault(sub, _help_options(sub))
        wrong = {a for a in argv[2:] if a.startswith("-")} - accepted[sub]
        assert not wrong, (argv, wrong)
