"""`doctor sight` and gc's blindness, from real credentials and a real hidepid /proc (issue 30, "no sight").

Each case runs the installed kvctl: as root here (it sees), as an
unprivileged user, and as root without CAP_SYS_PTRACE inside a private mount
namespace whose /proc is a fresh procfs mounted with hidepid=2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.sight import pid_view_gap
from kvcached.node.state.segment import create_segment

from ..conftest import KVCTL
from ..fs.helpers import backdate
from ..schemas import validate

GAP = pid_view_gap("/proc")
whole_view = pytest.mark.skipif(GAP is not None, reason=f"/proc here is a container's: {GAP}")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users and mounting /proc need root")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("KVCTL_ROOT", "NO_COLOR")}


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=timeout, stdin=subprocess.DEVNULL)


def _as_user(user) -> list[str]:  # type: ignore[no-untyped-def]
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]


def _hidepid(*argv: str, drop_ptrace: bool = True) -> list[str]:
    """argv run as root in a private mount namespace whose /proc is mounted with hidepid=2."""
    inner = " ".join(f"'{a}'" for a in argv)
    drop = "setpriv --inh-caps=-sys_ptrace --bounding-set=-sys_ptrace " if drop_ptrace else ""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f"mount -t proc -o hidepid=2 proc /proc && exec {drop}{inner}"]


def _segment(layout: Layout, name: str, uid: int) -> str:
    """A kvcached segment nobody holds, an hour old, owned by `uid`."""
    path = layout.segment_path(name)
    create_segment(path, 1 << 30)
    os.chown(path, uid, -1)
    backdate(path)
    return path


def _sight(stdout: str) -> list[dict]:
    doc = json.loads(stdout)
    validate(doc, "doctor")
    return [c for c in doc["checks"] if c["name"] == "sight"]


@pytest.fixture
def needs_tools() -> None:
    for tool in ("setpriv", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool}(1) is not installed")


@whole_view
def test_root_with_hostpid_sees(layout: Layout) -> None:
    r = _run([KVCTL, "--root", layout.root, "doctor", "sight", "--json"])
    checks = _sight(r.stdout)
    assert [c["status"] for c in checks] == ["ok"], checks
    assert r.returncode == 0


def test_unprivileged_user_is_blind(layout: Layout, unpriv_user, uniq: str, needs_tools) -> None:  # type: ignore[no-untyped-def]
    path = _segment(layout, f"kvcached_proc_{uniq[-6:]}1", 0)
    r = _run([*_as_user(unpriv_user), KVCTL, "--root", layout.root, "doctor", "sight", "--json"])
    checks = _sight(r.stdout)
    assert r.returncode != 0 and {c["status"] for c in checks} == {"fail"}
    causes = {c["details"]["cause"] for c in checks}
    assert "no_ptrace" in causes
    assert all(c["fix"] for c in checks)

    prom = os.path.join(layout.tmp_dir, "gc.prom")
    g = _run([*_as_user(unpriv_user), KVCTL, "--root", layout.root, "gc", "--yes", "--json", "--prometheus", prom])
    doc = json.loads(g.stdout)
    validate(doc, "gc")
    assert doc["blind"] is not None and "no_ptrace" in {x["cause"] for x in doc["blind"]["reasons"]}
    assert "blind (no_ptrace" in g.stderr
    assert os.path.exists(path)  # another user's: kept
    assert [e["action"] for e in doc["entries"]] == ["kept"]
    with open(prom) as f:
        assert "kvctl_gc_blind 1\n" in f.read()


def test_hidepid_without_ptrace_is_blind_and_keeps_what_it_cannot_see(
        layout: Layout, unpriv_user, uniq: str, needs_tools) -> None:  # type: ignore[no-untyped-def]
    path = _segment(layout, f"kvcached_proc_{uniq[-6:]}2", unpriv_user.pw_uid)
    # Another user's process, which hidepid=2 hides from a kvctl without CAP_SYS_PTRACE.
    other = subprocess.Popen([*_as_user(unpriv_user), "sleep", "60"])
    try:
        r = _run(_hidepid(KVCTL, "--root", layout.root, "doctor", "sight", "--json"))
        checks = _sight(r.stdout)
        assert r.returncode != 0, r.stderr
        assert {"hidepid", "no_ptrace"} <= {c["details"]["cause"] for c in checks}
        hide = next(c for c in checks if c["details"]["cause"] == "hidepid")
        assert "hidepid=" in hide["summary"] and "remount /proc without hidepid" in hide["fix"]

        prom = os.path.join(layout.tmp_dir, "gc.prom")
        g = _run(_hidepid(KVCTL, "--root", layout.root, "gc", "--yes", "--json", "--prometheus", prom))
        doc = json.loads(g.stdout)
        validate(doc, "gc")
        assert "hidepid" in {x["cause"] for x in doc["blind"]["reasons"]}
        (entry,) = doc["entries"]
        assert (entry["state"], entry["action"]) == ("unknown", "kept"), entry
        assert os.path.exists(path)
        with open(prom) as f:
            assert "kvctl_gc_blind 1\n" in f.read()

        # The same gc with the privileges it needs sees past hidepid: the owner is provably gone.
        full = _run(_hidepid(KVCTL, "--root", layout.root, "doctor", "sight", "--json", drop_ptrace=False))
        if GAP is None:
            assert [c["status"] for c in _sight(full.stdout)] == ["ok"]
    finally:
        other.kill()
        other.wait()


def test_a_gc_with_sight_is_not_blind(layout: Layout, uniq: str) -> None:
    if GAP is not None:
        pytest.skip(f"/proc here is a container's: {GAP}")
    path = _segment(layout, f"kvcached_proc_{uniq[-6:]}3", 0)
    prom = os.path.join(layout.tmp_dir, "gc.prom")
    g = _run([KVCTL, "--root", layout.root, "gc", "--yes", "--json", "--prometheus", prom])
    doc = json.loads(g.stdout)
    validate(doc, "gc")
    assert doc["blind"] is None and "blind" not in g.stderr
    assert not os.path.exists(path)
    with open(prom) as f:
        assert "kvctl_gc_blind 0\n" in f.read()


def test_root_without_ptrace_records_another_users_fds_as_unread(unpriv_user, needs_tools) -> None:  # type: ignore[no-untyped-def]
    """Root may list another user's /proc/<pid>/fd (DAC override) yet not read one link in it: unread, not empty."""
    other = subprocess.Popen([*_as_user(unpriv_user), "sleep", "60"])
    try:
        code = ("import json, sys; from kvcached.node.clean.facts import gather_facts; f = gather_facts(); "
                "print(json.dumps(sorted(f.unreadable_pids.get(int(sys.argv[1]), ()))))")
        r = _run(["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", sys.executable, "-c", code,
                  str(other.pid)])
        assert r.returncode == 0, r.stderr
        assert "fd" in json.loads(r.stdout), r.stdout
    finally:
        other.kill()
        other.wait()
