"""Doctor's host hazards on real files: logind's RemoveIPC, tmpfiles.d aging (against the real systemd-tmpfiles),
and upstream kvcached's in-process revisioned limits (against a real interpreter)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.ops import diagnostics as dx
from kvcached.node.ops.host_hazards import (
    HostConfig,
    check_remove_ipc,
    check_tmpfiles,
    check_upstream_limits,
    remove_ipc,
    tmpfiles_rules,
)
from kvcached.node.state.segment import create_segment

from ..conftest import KVCTL, REPO
from ..waiting import wait_until
from .helpers import backdate

CONTRIB = REPO / "contrib" / "tmpfiles.d" / "kvcached.conf"


def _write(root: str, rel: str, text: str) -> str:
    path = os.path.join(root, rel.lstrip("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


# logind ---------------------------------------------------------------------


def test_remove_ipc_default_and_override_by_name(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert remove_ipc(HostConfig(root=root)) == (True, "systemd's default")
    _write(root, "/etc/systemd/logind.conf", "[Login]\n#RemoveIPC=no\nKillUserProcesses=no\n")
    assert remove_ipc(HostConfig(root=root))[0] is True
    vendor = _write(root, "/usr/lib/systemd/logind.conf.d/50-ipc.conf", "[Login]\nRemoveIPC=no\n")
    assert remove_ipc(HostConfig(root=root)) == (False, vendor)
    # The same name in /etc masks the vendor's file; a later name overrides an earlier one.
    local = _write(root, "/etc/systemd/logind.conf.d/50-ipc.conf", "[Login]\nRemoveIPC=yes\n")
    assert remove_ipc(HostConfig(root=root)) == (True, local)
    later = _write(root, "/run/systemd/logind.conf.d/90-ipc.conf", "[Login]\nRemoveIPC=off\n")
    assert remove_ipc(HostConfig(root=root)) == (False, later)
    _write(root, "/etc/systemd/logind.conf.d/95-other.conf", "[Other]\nRemoveIPC=yes\n")
    assert remove_ipc(HostConfig(root=root)) == (False, later)  # not the [Login] section


@pytest.fixture
def engine_as_user(unpriv_user) -> Iterator[int]:  # type: ignore[no-untyped-def]
    """A process of the test user titled as vLLM's engine (as `roles` recognises it), reaped at teardown."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv(1) is not installed")
    p = subprocess.Popen(["setpriv", f"--reuid={unpriv_user.pw_uid}", f"--regid={unpriv_user.pw_gid}",
                          "--clear-groups", "bash", "-c", "exec -a VLLM::EngineCore sleep 60"])

    def titled() -> bool:
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                return f.read().startswith(b"VLLM::EngineCore")
        except OSError:
            return False

    wait_until(titled, 5)
    yield p.pid
    p.kill()
    p.wait()


def _logind(layout: Layout, root: str) -> dx.CheckResult:
    (r,) = dx.check_logind(dx.Context(layout, host=HostConfig(root=root)))
    return r


def test_logind_warns_for_a_serve_of_a_user_without_linger(layout: Layout, tmp_path: Path, unpriv_user,  # type: ignore[no-untyped-def]
                                                           engine_as_user: int) -> None:
    root = str(tmp_path)
    user = unpriv_user.pw_name
    _write(root, "/etc/passwd", f"root:x:0:0::/root:/bin/sh\n{user}:x:{unpriv_user.pw_uid}:"
           f"{unpriv_user.pw_gid}::/nonexistent:/usr/sbin/nologin\n")
    r = _logind(layout, root)
    assert r.status is dx.Status.WARN, r
    assert user in r.details["users"] and engine_as_user in r.details["users"][user]
    assert f"loginctl enable-linger {user}" in (r.fix or "")

    # Lingering: the user's manager outlives every login, and its IPC with it.
    _write(root, f"/var/lib/systemd/linger/{user}", "")
    assert _logind(layout, root).status is dx.Status.OK
    os.unlink(os.path.join(root, f"var/lib/systemd/linger/{user}"))
    # RemoveIPC=no: nothing is removed at logout.
    _write(root, "/etc/systemd/logind.conf.d/kvcached.conf", "[Login]\nRemoveIPC=no\n")
    assert _logind(layout, root).status is dx.Status.OK


def test_logind_ignores_root_and_system_users(tmp_path: Path) -> None:
    cfg = HostConfig(root=str(tmp_path))
    assert check_remove_ipc(cfg, {0: [1], 998: [2], 65534: [3]}).status == "ok"
    assert check_remove_ipc(cfg, {1000: [4]}).status == "warn"


# tmpfiles -------------------------------------------------------------------

AGING = "d /dev/shm 1777 root root 1s\nq /tmp 1777 root root 1s\n"


@pytest.fixture
def tmpfiles() -> str:
    tool = shutil.which("systemd-tmpfiles")
    if tool is None:
        pytest.skip("systemd-tmpfiles is not installed (apt-get install -y systemd)")
    return tool


def _live_segment(layout: Layout, name: str) -> tuple[str, subprocess.Popen]:
    """A segment held open by a running child, with its socket directory flocked as kvcached's runtime does."""
    path = layout.segment_path(name)
    create_segment(path, 1 << 30)
    os.makedirs(layout.socket_dir(name))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "d = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY)\n"
        "fcntl.flock(d, fcntl.LOCK_SH)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"), path, layout.socket_dir(name)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
    for p in (path, layout.socket_dir(name)):
        backdate(p)
    time.sleep(1.2)  # its change time (which utime cannot set back) older than the rule's age too
    return path, holder


def _clean(tool: str, root: str) -> None:
    r = subprocess.run([tool, "--clean", "--root", root], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_an_aging_rule_removes_a_live_segment_without_the_file(layout: Layout, tmpfiles: str, uniq: str) -> None:
    _write(layout.root, "/etc/tmpfiles.d/age.conf", AGING)
    cfg = HostConfig(root=layout.root)
    finding = check_tmpfiles(cfg)
    assert finding.status == "warn" and "age.conf:1" in finding.summary, finding
    assert CONTRIB.name in (finding.fix or "")
    name = f"kvcached_proc_{uniq[-6:]}"
    path, holder = _live_segment(layout, name)
    try:
        _clean(tmpfiles, layout.root)
        assert not os.path.exists(path)  # the hazard is real: a live segment gone
        assert os.path.isdir(layout.socket_dir(name))  # the flock kept the directory
    finally:
        holder.kill()
        holder.wait()


def test_the_contrib_file_keeps_a_live_segment(layout: Layout, tmpfiles: str, uniq: str) -> None:
    _write(layout.root, "/etc/tmpfiles.d/age.conf", AGING)
    shutil.copy(CONTRIB, os.path.join(layout.root, "etc/tmpfiles.d/kvcached.conf"))
    cfg = HostConfig(root=layout.root)
    finding = check_tmpfiles(cfg)
    assert finding.status == "ok" and "excluded" in finding.summary, finding
    other = os.path.join(layout.shm_dir, "not-kvcached")
    with open(other, "w"):
        pass
    backdate(other)  # its change time ages with the segment's, below
    name = f"kvcached_proc_{uniq[-6:]}"
    path, holder = _live_segment(layout, name)
    try:
        _clean(tmpfiles, layout.root)
        assert os.path.exists(path) and os.path.isdir(layout.socket_dir(name))
        assert not os.path.exists(other)  # the rule still ages what is not kvcached's
    finally:
        holder.kill()
        holder.wait()


def test_an_explicit_name_needs_its_own_line(tmp_path: Path) -> None:
    root = str(tmp_path)
    _write(root, "/etc/tmpfiles.d/age.conf", AGING)
    shutil.copy(CONTRIB, os.path.join(root, "etc/tmpfiles.d/kvcached.conf"))
    cfg = HostConfig(root=root)
    warn = check_tmpfiles(cfg, ["my-serve"])
    assert warn.status == "warn" and warn.details["exposed"] == ["/dev/shm/my-serve"]
    _write(root, "/etc/tmpfiles.d/my-serve.conf", "x /dev/shm/my-serve\n")
    assert check_tmpfiles(cfg, ["my-serve"]).status == "ok"


def test_no_aging_rule_and_masked_files(tmp_path: Path) -> None:
    root = str(tmp_path)
    _write(root, "/usr/lib/tmpfiles.d/tmp.conf", "D /tmp 1777 root root -\n")
    assert check_tmpfiles(HostConfig(root=root)).summary == "no systemd-tmpfiles rule ages /dev/shm or /tmp"
    _write(root, "/usr/lib/tmpfiles.d/aging.conf", "e /dev/shm - - - 10d\n")
    assert check_tmpfiles(HostConfig(root=root)).status == "warn"
    # A file of the same name in /etc masks the vendor's, and a link to /dev/null masks it entirely.
    os.makedirs(os.path.join(root, "etc/tmpfiles.d"))
    os.symlink("/dev/null", os.path.join(root, "etc/tmpfiles.d/aging.conf"))
    assert [r.path for r in tmpfiles_rules(HostConfig(root=root)) if r.age] == []
    assert check_tmpfiles(HostConfig(root=root)).status == "ok"


def test_doctor_names_the_rule(layout: Layout) -> None:
    _write(layout.root, "/etc/tmpfiles.d/age.conf", AGING)
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_ROOT"}
    r = subprocess.run([KVCTL, "--root", layout.root, "doctor", "tmpfiles", "--json"], capture_output=True,
                       text=True, env=env, timeout=120)
    (check,) = json.loads(r.stdout)["checks"]
    assert (check["name"], check["status"]) == ("tmpfiles-age", "warn"), check
    shutil.copy(CONTRIB, os.path.join(layout.root, "etc/tmpfiles.d/kvcached.conf"))
    r = subprocess.run([KVCTL, "--root", layout.root, "doctor", "tmpfiles", "--json"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert json.loads(r.stdout)["checks"][0]["status"] == "ok"


# upstream kvcached ------------------------------------------------------------


def _upstream_site(tmp_path: Path, *, revisioned: bool) -> str:
    """A site directory holding an upstream-shaped kvcached distribution (its files only, never imported)."""
    site = tmp_path / "site"
    pkg = site / "kvcached"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the probe must not import upstream')\n")
    control = "def set_instance_memory_limit(\n    limit_bytes,\n    *,\n    revision,\n):\n    return {}\n"
    (pkg / "control.py").write_text(control if revisioned else "def other():\n    pass\n")
    meta = site / "kvcached-0.1.7.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcached\nVersion: 0.1.7\n")
    return str(site)


def test_upstream_revisioned_limits_are_named(tmp_path: Path) -> None:
    site = _upstream_site(tmp_path, revisioned=True)
    f = check_upstream_limits(sys.executable, {**os.environ, "PYTHONPATH": site})
    assert f.status == "warn", f
    assert "0.1.7" in f.summary and "kvctl limit" in f.summary and f.details["paths"] == [f"{site}/kvcached/control.py"]


def test_no_revisioned_limits_no_warning(tmp_path: Path) -> None:
    site = _upstream_site(tmp_path, revisioned=False)
    assert check_upstream_limits(sys.executable, {**os.environ, "PYTHONPATH": site}).status == "ok"
    # Ours: a kvcached without kvcached/control.py (this module's own source names the function, as a pattern).
    assert check_upstream_limits(sys.executable, {**os.environ, "PYTHONPATH": str(REPO)}).status == "ok"

