"""Crash matrix (issue 6): TP × PP shapes × ways of dying, with the runtime's owner cleanup on.

For each cell: start a real harness deployment (api owner + engine + TP×PP
workers, owner_cleanup=True), kill it one way, wait for the owner to finish,
record what the runtime left, then run `kvctl --root DIR gc --yes --min-age 0
--json` (right after a crash every entry is younger than the default 60 s
grace, which would keep all of it as `young`) and record what it removed and what it kept and why. Every cell
checks that nothing live was removed and that every live listener still
answers a ping; a second gc finds nothing more to remove.

The table is printed at the end of the module, and written to the file
$KVCACHED_CRASH_TABLE names when it is set (nothing is written otherwise).
The default run covers 1×1 and 2×2; `-m slow` adds 2×1 and 4×2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.state.lease import segment_lease_held
from kvcached.runtime.harness import Deployment
from kvcached.runtime.ipc.client import ping

from ..conftest import KVCTL
from ..waiting import proc_state, wait_for_state, wait_until
from .kit import uniq

DEFAULT_SHAPES = [(1, 1), (2, 2)]
SLOW_SHAPES = [(2, 1), (4, 2)]
DEATHS = ["vllm_stop", "harness_stop_like_vllm", "sigkill_all", "sigkill_engine", "stopped_worker_then_term",
          "double_sigterm", "restart_same_name"]
ROWS: list[dict[str, str]] = []
OWNER_WAIT = 8.0  # the owner retries its cleanup for up to 5 s while workers still serve


def _alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def _wait_dead(pids: list[int], timeout: float) -> bool:
    return wait_until(lambda: not any(_alive(p) for p in pids), timeout)


def _tree(layout: Layout) -> list[str]:
    """Every path under the node's tmp and dev/shm, relative to the root."""
    out = []
    for top in (layout.tmp_dir, layout.shm_dir):
        for dirpath, dirnames, filenames in os.walk(top):
            for n in dirnames + filenames:
                out.append(os.path.relpath(os.path.join(dirpath, n), layout.root))
    return sorted(out)


def _short(path: str, layout: Layout, name: str) -> str:
    rel = os.path.relpath(path, layout.root)
    return rel.replace(f"tmp/kvcached-tp-{name}-", "tmp/D-").replace(f"dev/shm/{name}", "shm").split("/", 1)[-1] \
        if name in rel else rel


def _summarise(paths: list[str], layout: Layout, name: str) -> str:
    socks = sum(p.endswith(".sock") for p in paths)
    dirs = sum(os.path.basename(p).startswith(("kvcached-tp-", "pp")) and not p.endswith(".sock") for p in paths)
    seg = sum(p.startswith("dev/shm/") for p in paths)
    parts = [f"{socks} sock" if socks else "", f"{dirs} dir" if dirs else "", "segment" if seg else ""]
    return ", ".join(p for p in parts if p) or "nothing"


def _gc(layout: Layout, *extra: str) -> tuple[int, list[dict]]:
    """`kvctl --root ROOT gc --min-age 0 --json EXTRA`: (exit code, entries)."""
    env = {**os.environ, "KVCTL_LOCK": os.path.join(layout.root, "kvctl-gc.lock"), "NO_COLOR": "1"}
    r = subprocess.run([KVCTL, "--root", layout.root, "gc", "--min-age", "0", "--json", *extra],
                       capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert r.stdout.strip(), f"kvctl gc printed no JSON (exit {r.returncode}): {r.stderr[-2000:]}"
    return r.returncode, json.loads(r.stdout)["entries"]


def _kept_why(entries: list[dict]) -> str:
    c = Counter(f"{e['state']}:{e['reason']}" for e in entries if e["action"] == "kept")
    return ", ".join(f"{n}× {k}" for k, n in sorted(c.items())) or "-"


def _pings(paths: list[str]) -> list[str]:
    bad = []
    for p in paths:
        try:
            ping(p, timeout=2.0)
        except Exception as e:  # noqa: BLE001 - any failure is a dead listener
            bad.append(f"{p}: {e}")
    return bad


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            role = f.read().split(b"--role\0", 1)[1].split(b"\0", 1)[0].decode()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
    except (OSError, IndexError):
        return f"{pid}: gone"
    return f"{role} {pid} blocked in {wchan}"


def _die(d: Deployment, how: str) -> None:
    """Kill deployment `d` the way `how` names, then wait for every process to be gone."""
    if how == "vllm_stop":
        # vLLM 0.33: SIGTERM to the group; the API server (our owner) SIGTERMs EngineCore and
        # SIGKILLs its tree at once, then returns and runs its shutdown; it is not SIGKILLed.
        d.signal_group(signal.SIGTERM)
        time.sleep(0.02)
        for pid in [d.engine_pid, *d.worker_pids.values()]:
            d.signal(pid, signal.SIGKILL)
    elif how == "harness_stop_like_vllm":
        d.stop_like_vllm()  # group SIGTERM, then group SIGKILL 20 ms later (owner included)
    elif how == "sigkill_all":
        d.signal_group(signal.SIGKILL)
    elif how == "sigkill_engine":
        d.signal(d.engine_pid, signal.SIGKILL)  # workers orphaned, still serving
    elif how == "stopped_worker_then_term":
        victim = d.worker_pids[max(d.worker_pids)]
        d.signal(victim, signal.SIGSTOP)
        wait_for_state(victim, "T")  # really stopped before the group's SIGTERM reaches it
        d.signal_group(signal.SIGTERM)
    elif how == "double_sigterm":
        d.signal_group(signal.SIGTERM)
        time.sleep(0.005)
        d.signal_group(signal.SIGTERM)
    else:
        raise ValueError(how)


def _settle(d: Deployment, how: str) -> str | None:
    """Wait for the owner to finish; returns a problem description when it hangs (then SIGKILLs it)."""
    if _wait_dead([d.api_pid], OWNER_WAIT):
        if how != "sigkill_engine":
            _wait_dead(d.pids, 5)
        return None
    try:
        with open(f"/proc/{d.api_pid}/wchan") as f:
            wchan = f.read()
    except OSError:
        wchan = "?"
    d.signal(d.api_pid, signal.SIGKILL)
    d.wait(timeout=5)
    return f"owner (api pid {d.api_pid}) still alive {OWNER_WAIT:.0f}s after {how} (blocked in {wchan})"


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    if not ROWS:
        return
    cols = ["shape", "death", "runtime left", "gc removed", "gc kept (state:reason)", "gc exit", "live intact"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in ROWS]
    text = "\n".join(lines)
    print("\n\nCrash matrix (owner cleanup on; gc with --min-age 0)\n" + text)
    out = os.environ.get("KVCACHED_CRASH_TABLE")  # a file only when asked for: a test run leaves nothing behind
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
        print(f"(written to {out})")


def _cases() -> list:
    cases = [pytest.param(tp, pp, how, id=f"{tp}x{pp}-{how}") for tp, pp in DEFAULT_SHAPES for how in DEATHS]
    cases += [pytest.param(tp, pp, how, id=f"{tp}x{pp}-{how}", marks=pytest.mark.slow)
              for tp, pp in SLOW_SHAPES for how in DEATHS]
    return cases


@pytest.mark.parametrize("tp,pp,how", _cases())
def test_crash_matrix(tp: int, pp: int, how: str, node: Layout,
                      deployments: Callable[..., Deployment]) -> None:
    name = uniq(f"c{tp}{pp}{DEATHS.index(how)}")
    d = deployments(name, tp, pp, layout=node, owner_cleanup=True)
    live_paths: list[str] = []
    successor: Deployment | None = None
    if how == "restart_same_name":
        d.signal_group(signal.SIGTERM)  # the old owner kills its engine tree and starts its cleanup ...
        _wait_dead([d.engine_pid, *d.worker_pids.values()], 10)
        successor = deployments(name, tp, pp, layout=node, owner_cleanup=True)  # ... while we restart
        hung = _settle(d, how)
        live_paths = [p for _, _, p in node.socket_paths(name, tp, pp)]
    else:
        _die(d, how)
        hung = _settle(d, how)
        if how == "sigkill_engine":
            live_paths = [p for _, _, p in node.socket_paths(name, tp, pp)]
    orphans_expected = set(d.worker_pids.values()) if how == "sigkill_engine" else set()
    survivors = sorted(p for p in d.pids if _alive(p) and p not in orphans_expected)
    survivor_desc = [_describe(p) for p in survivors]
    left = _tree(node)
    live_before = {p: os.lstat(p) for p in live_paths if os.path.lexists(p)}
    assert _pings(live_paths) == [], "a live listener died before gc"

    code, entries = _gc(node, "--yes")
    removed = [e["path"] for e in entries if e["action"] == "removed"]
    stale_remaining = [e for e in entries if e["state"] == "stale" and e["action"] != "removed"]
    ROWS.append({
        "shape": f"{tp}×{pp}", "death": how,
        "runtime left": _summarise(left, node, name) + (" (OWNER HUNG, SIGKILLed)" if hung else "")
        + (f" ({len(survivors)} process(es) HUNG)" if survivors else ""),
        "gc removed": _summarise([os.path.relpath(p, node.root) for p in removed], node, name),
        "gc kept (state:reason)": _kept_why(entries),
        "gc exit": str(code),
        "live intact": f"yes ({len(live_before)} answer)" if live_paths else "n/a (none live)",
    })

    # Nothing live removed, every live listener still answers.
    for e in entries:
        assert not (e["action"] == "removed" and e["state"] != "stale"), e
    assert code == (3 if stale_remaining else 0), f"kvctl gc exit {code} with {len(stale_remaining)} stale left"
    for p, st in live_before.items():
        now = os.lstat(p)
        assert (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino), f"live {p} was removed or replaced"
    assert _pings(live_paths) == [], "a live listener stopped answering after gc"
    if live_paths:
        # kvctl delete on a deployment something still serves: refused, nothing removed.
        r = subprocess.run([KVCTL, "--root", node.root, "delete", name, "--yes", "--min-age", "0", "--json"],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env={**os.environ, "KVCTL_LOCK": os.path.join(node.root, "kvctl-gc.lock")})
        assert r.returncode in (0, 7), f"kvctl delete of a live deployment exited {r.returncode}: {r.stderr}"
        for p, st in live_before.items():
            assert os.path.lexists(p) and os.lstat(p).st_ino == st.st_ino, f"kvctl delete removed live {p}"
        assert _pings(live_paths) == [], "a live listener stopped answering after kvctl delete"
    if successor is not None:
        seg = node.segment_path(name)
        r = subprocess.run([KVCTL, "--root", node.root, "limit", name, "2G", "--json"], capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"kvctl limit on the successor's live segment exited {r.returncode}: {r.stderr}"
        from kvcached.node.state.segment import read_segment
        assert read_segment(seg).total == 2 << 30
        assert os.path.exists(seg), "the successor's segment was removed"
        assert segment_lease_held(seg), "the segment at the path is not the one the successor's engine holds"
    elif survivors:
        # Processes that should be dead still run (and hold leases): gc must keep their state.
        assert all(e["state"] == "stale" for e in entries if e["path"] in removed)
        for pid in survivors:
            d.signal(pid, signal.SIGKILL)
        _wait_dead(survivors, 5)
        _, after = _gc(node, "--yes")
        ROWS[-1]["gc removed"] += f"; after SIGKILL of the hung: {sum(e['action'] == 'removed' for e in after)} more"
        assert _tree(node) == [], f"once the hung processes are gone, gc still left {_tree(node)}"
    else:
        # The deployment is dead (or only orphaned workers serve): nothing stale may stay.
        assert not stale_remaining, stale_remaining
        if how != "sigkill_engine":
            assert _tree(node) == [], f"gc left {_tree(node)}: " + "; ".join(
                f"{e['path']}: {e['state']}/{e['reason']}/{e['action']} {e['detail']}" for e in entries)
    again_code, again = _gc(node, "--dry-run")
    assert not [e for e in again if e["action"] == "would_remove"], "a second gc finds more"
    assert again_code == 0, f"a second gc exits {again_code} on a node with nothing stale left"

    if survivors:
        pytest.fail(f"{len(survivors)} process(es) of the deployment still alive after {how}: "
                    + "; ".join(survivor_desc))
    if hung:
        pytest.fail(f"{hung}: harness._run_api's SIGTERM handler calls engine.wait() while the main "
                    "thread is inside engine.wait() (Popen._waitpid_lock is not re-entrant), so the owner "
                    "deadlocks and never runs its cleanup; see test_regressions.py")
