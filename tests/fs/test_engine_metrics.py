"""Prometheus textfile metrics for engine leftovers: counts and bytes by engine and state, from a real run."""

from __future__ import annotations

import os
import re
import time

from kvcached.node.base.layout import Layout
from kvcached.node.clean.cleanup import execute, plan
from kvcached.node.clean.decide import Policy
from kvcached.node.clean.leftovers.act import plan_engines
from kvcached.node.ops import metrics

_SAMPLE = re.compile(r"^(kvctl_gc_[a-z_]+)\{([^}]*)\} (\S+)$")


def _plant(path: str, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(b"x" * nbytes)
    t = time.time() - 3600
    os.utime(path, (t, t))


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = frozenset(tuple(kv.split("=", 1)) for kv in m.group(2).split(","))
            out[(m.group(1), frozenset((k, v.strip('"')) for k, v in labels))] = float(m.group(3))
    return out


def test_counts_and_bytes_by_engine_and_state(layout: Layout, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name, n in (("psm_0a1b2c3d", 8192), ("psm_0a1b2c3e", 4096), ("nccl-Ab3dE9", 12288)):
        _plant(os.path.join(layout.shm_dir, name), n)
    young = os.path.join(layout.shm_dir, "cuda.shm.0.1.2")
    with open(young, "wb") as f:
        f.write(b"y" * 4096)
    # One run of both sources, one report: kvcached's part, then the engines'.
    report = execute(plan(layout, Policy(grace=60)), plan_engines(layout, Policy(grace=60)), dry_run=False)
    target = str(tmp_path / "kvctl.prom")
    metrics.write_report(target, report, success=True)
    text = open(target).read()
    got = _samples(text)

    def value(metric: str, **labels: str) -> float:
        return got[(f"kvctl_gc_{metric}", frozenset(labels.items()))]

    assert value("engine_entries", engine="vllm", state="stale") == 2
    assert value("engine_bytes", engine="vllm", state="stale") == 8192 + 4096
    assert value("engine_entries", engine="nccl", state="stale") == 1
    assert value("engine_bytes", engine="nccl", state="stale") == 12288
    assert value("engine_entries", engine="cuda", state="young") == 1
    assert value("engine_entries", engine="sglang", state="live") == 0
    assert value("engine_removed", engine="vllm") == 2
    assert value("engine_removed_bytes", engine="nccl") == 12288
    assert value("engine_stale_entries", engine="vllm") == 0
    assert value("engine_stale_bytes", engine="cuda") == 0
    # The plain run's own metrics are all still there, and each metric is declared once.
    assert "kvctl_gc_entries{" in text and "kvctl_gc_last_success_timestamp_seconds " in text
    declared = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(declared) == len(set(declared))


def test_a_dry_run_leaves_stale_bytes_and_lock_busy_keeps_them(layout: Layout, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _plant(os.path.join(layout.shm_dir, "psm_0a1b2c3d"), 8192)
    # One run of both sources, one report: kvcached's part, then the engines'.
    report = execute(plan(layout, Policy(grace=60)), plan_engines(layout, Policy(grace=60)), dry_run=True)
    target = str(tmp_path / "kvctl.prom")
    metrics.write_report(target, report, success=False)
    metrics.write_lock_busy(target, time.time() - 1, time.time())
    got = _samples(open(target).read())
    assert got[("kvctl_gc_engine_stale_entries", frozenset({("engine", "vllm")}))] == 1
    assert got[("kvctl_gc_engine_stale_bytes", frozenset({("engine", "vllm")}))] == 8192
    assert os.path.exists(os.path.join(layout.shm_dir, "psm_0a1b2c3d"))


def test_without_engines_the_textfile_is_as_before(layout: Layout) -> None:
    plain = execute(plan(layout, Policy(grace=60)), dry_run=True)
    assert "engine" not in metrics.render(plain, success=True)
