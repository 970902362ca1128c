"""Hostile-node suite (issue 6): an unprivileged user plants traps; kvctl must not fall in.

A user created by the test (useradd) plants, in a node root it controls and in
the real /tmp and /dev/shm under unique names: a socket directory that is a
symlink to a directory of root's files, a symlink / FIFO / regular file /
directory at w0.sock, a segment that is a hard link to or a symlink to a file
of root's, a directory whose hash suffix does not match, names with a newline,
ANSI escapes and 200 characters, world-writable directories, and entries whose
owner differs from their directory's. Then `kvctl gc --yes`, `gc --dry-run`,
`inspect`, `delete` and `limit` run as root and as that user, and we check:

* nothing that is not provably stale is removed, root's files keep their
  content and mtime, nothing is followed or written through a link;
* output carries no raw ESC (or other C0 control) byte, JSON parses and
  matches kvctl/schemas;
* exit codes are from the documented enum and no traceback is printed.

Every (plant, root, user, command) combination is one counted case; the counts
are printed and must be the ones docs/PROOF.md's "Hostile node" states. Needs root
(useradd, runuser, chown); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvcached.node.base import name_rules

from ..conftest import KVCTL, REPO
from ..schemas import validate
from .kit import PID

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"),
    reason="needs root, useradd and runuser to create and act as an unprivileged user")

EXIT_CODES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 130}
SITE = os.path.join(os.path.dirname(os.path.dirname(KVCTL)), "lib",
                    f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
PREFIX = f"kvh{PID}"
CASES_RUN: list[str] = []
# Text that follows a planted newline: if an output line starts with it, a name was printed raw
# and a planted name could forge output lines.
LINE_FORGERIES: set[bytes] = set()
PLANTED: list[tuple[str, str, int]] = []  # (node, trap, entries that must survive)


@dataclass
class Plant:
    """Everything planted for one trap: paths that must survive, root's files that must not change."""

    case: str
    names: list[str] = field(default_factory=list)      # deployment names (for delete / limit)
    keep: list[str] = field(default_factory=list)       # must still exist, same inode, afterwards
    may_go: list[str] = field(default_factory=list)     # genuinely stale: removing them is fine
    segments: list[str] = field(default_factory=list)   # names to try `kvctl limit` on


class Node:
    """A place to plant: a --root tree the user owns, or the real / (unique names only)."""

    def __init__(self, root: str | None, user: str, uid: int, secret_dir: str) -> None:
        self.root = root
        self.tmp = os.path.join(root, "tmp") if root else "/tmp"
        self.shm = os.path.join(root, "dev/shm") if root else "/dev/shm"
        self.user, self.uid = user, uid
        self.secret_dir = secret_dir
        self.plants: list[Plant] = []
        self.idents: dict[str, tuple[int, int]] = {}
        self.planted: list[str] = []  # every top-level path we created (for cleanup on the real node)
        self.secrets: dict[str, tuple[bytes, float]] = {}  # root's files planted links point at

    def sdir(self, name: str) -> str:
        return os.path.join(self.tmp, name_rules.socket_dir_name(name))


def _as_user(user: str, code: str) -> None:
    """Run a planting snippet as `user` (files it makes are the user's)."""
    subprocess.run(["runuser", "-u", user, "--", "/usr/bin/env", "-i", "PATH=/usr/bin:/bin",
                    "/usr/bin/python3", "-c", code], check=True, timeout=60)


def _stale_sock(path: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()


def _user_code_stale_sock(path: str) -> str:
    return f"import socket; s = socket.socket(socket.AF_UNIX); s.bind({path!r}); s.close()"


def plant_all(node: Node) -> None:
    """Plant every trap on `node`; record what must survive."""
    u, sec = node.user, node.secret_dir
    secret_file = os.path.join(sec, "root-file")
    n = lambda tag: f"{PREFIX}{tag}"  # noqa: E731

    def mk(case: str) -> Plant:
        p = Plant(case)
        node.plants.append(p)
        return p

    # 1. socket directory that is a symlink to a directory holding root's files
    p = mk("dir-symlink")
    name = n("sl")
    os.symlink(sec, node.sdir(name))
    os.lchown(node.sdir(name), node.uid, node.uid)
    p.names.append(name)
    p.keep += [node.sdir(name), os.path.join(sec, "w0.sock"), secret_file]
    node.planted.append(node.sdir(name))

    # 2-5. symlink / FIFO / regular file / directory at w0.sock, in the user's own directory
    for tag, code in (("ws", f"import os; os.symlink({secret_file!r}, '{{p}}')"),
                      ("wf", "import os; os.mkfifo('{p}')"),
                      ("wr", "open('{p}', 'w').write('x')"),
                      ("wd", "import os; os.mkdir('{p}'); open('{p}/inner', 'w').write('x')")):
        p = mk(f"w0.sock-{ {'ws': 'symlink', 'wf': 'fifo', 'wr': 'regular', 'wd': 'directory'}[tag]}")
        name = n(tag)
        d = node.sdir(name)
        path = os.path.join(d, "w0.sock")
        _as_user(u, f"import os; os.mkdir({d!r}, 0o700); " + code.replace("{p}", path))
        p.names.append(name)
        p.keep += [path]
        node.planted.append(d)

    # 6-7. segment that is a hard link / a symlink to root's file (the hard link made by root:
    # fs.protected_hardlinks stops the user from linking a file it does not own)
    root_seg_file = os.path.join(node.shm, f"{PREFIX}-rootfile")
    with open(root_seg_file, "wb") as f:
        f.write(b"R" * 24)
    os.chmod(root_seg_file, 0o644)
    node.planted.append(root_seg_file)
    node.secrets[root_seg_file] = (b"R" * 24, os.stat(root_seg_file).st_mtime)
    for tag, how in (("hl", "hardlink"), ("ss", "symlink")):
        p = mk(f"segment-{how}")
        name = n(tag)
        os.mkdir(node.sdir(name), 0o700)  # a real socket dir ties the explicit name to kvcached
        os.chown(node.sdir(name), node.uid, node.uid)
        seg = os.path.join(node.shm, name)
        if how == "hardlink":
            os.link(root_seg_file, seg)
        else:
            _as_user(u, f"import os; os.symlink({root_seg_file!r}, {seg!r})")
        p.names.append(name)
        p.segments.append(name)
        p.keep += [seg, root_seg_file]
        p.may_go += [node.sdir(name)]  # the user's empty directory is genuinely stale
        node.planted += [node.sdir(name), seg]

    # 8. a directory whose hash suffix does not match, holding a stale socket of root's
    p = mk("bad-hash")
    d = os.path.join(node.tmp, f"kvcached-tp-{n('bh')}-00000000")
    os.mkdir(d, 0o700)
    _stale_sock(os.path.join(d, "w0.sock"))
    p.keep += [d, os.path.join(d, "w0.sock")]
    node.planted.append(d)

    # 9. names with a newline: in a socket dir name, a segment name, a socket name
    p = mk("newline-names")
    d = os.path.join(node.tmp, f"kvcached-tp-{n('nl')}\nx-{name_rules.socket_hash(n('nl'))}")
    LINE_FORGERIES.add(f"x-{name_rules.socket_hash(n('nl'))}".encode())
    _as_user(u, f"import os; os.mkdir({d!r}, 0o700)")
    p.keep.append(d)
    seg_nl = os.path.join(node.shm, f"kvcached_proc_{PID}\n")
    _as_user(u, f"open({seg_nl!r}, 'wb').write(bytes(24))")
    p.keep.append(seg_nl)  # not ours: a trailing newline (test_regressions.py)
    name = n("nl2")
    d2 = node.sdir(name)
    _as_user(u, f"import os; os.mkdir({d2!r}, 0o700); " + _user_code_stale_sock(os.path.join(d2, "w0.sock\n")))
    p.names.append(name)
    p.keep.append(os.path.join(d2, "w0.sock\n"))  # not rank 0's node (test_regressions.py)
    node.planted += [d, seg_nl, d2]

    # 10. ANSI escapes in names (a directory and a socket inside a valid one)
    p = mk("ansi-escapes")
    esc = "\x1b[31mRED\x1b]0;pwned\x07"
    d = os.path.join(node.tmp, f"kvcached-tp-{n('es')}{esc}-{name_rules.socket_hash(n('es'))}")
    _as_user(u, f"import os; os.mkdir({d!r}, 0o700)")
    p.keep.append(d)
    name = n("es2")
    d2 = node.sdir(name)
    _as_user(u, f"import os; os.mkdir({d2!r}, 0o700); open({os.path.join(d2, esc)!r}, 'w').write('x')")
    p.names.append(name)
    p.keep += [d2, os.path.join(d2, esc)]
    node.planted += [d, d2]

    # 11. 200-character names
    p = mk("200-char-names")
    long_name = (n("lg") + "L" * 200)[:200]
    d = os.path.join(node.tmp, f"kvcached-tp-{long_name}-{name_rules.socket_hash(long_name)}")
    _as_user(u, f"import os; os.mkdir({d!r}, 0o700)")
    p.keep.append(d)
    node.planted.append(d)

    # 12. world-writable directories: the user's 0777 dir, and a root dir 1777, with stale sockets
    p = mk("world-writable")
    name = n("ww")
    d = node.sdir(name)
    _as_user(u, f"import os; os.mkdir({d!r}); os.chmod({d!r}, 0o777); "
             + _user_code_stale_sock(os.path.join(d, "w0.sock")))
    p.names.append(name)
    p.keep.append(d)
    p.may_go.append(os.path.join(d, "w0.sock"))  # the user's own stale socket
    name2 = n("wx")
    d2 = node.sdir(name2)
    os.mkdir(d2)
    os.chmod(d2, 0o1777)
    _as_user(u, _user_code_stale_sock(os.path.join(d2, "w1.sock")))
    p.names.append(name2)
    p.keep += [d2, os.path.join(d2, "w1.sock")]  # user's socket in root's dir: owner mismatch
    node.planted += [d, d2]

    # 13. entries whose owner differs from their directory's: root's socket in the user's dir
    p = mk("owner-mismatch")
    name = n("om")
    d = node.sdir(name)
    _as_user(u, f"import os; os.mkdir({d!r}, 0o755)")
    _stale_sock(os.path.join(d, "w0.sock"))
    p.names.append(name)
    p.keep += [d, os.path.join(d, "w0.sock")]
    node.planted.append(d)

    # 14. a FIFO and a 100-byte file where a segment belongs (limit must not block or write)
    p = mk("segment-fifo-and-size")
    for tag, code in (("ff", "import os; os.mkfifo('{p}')"), ("bs", "open('{p}', 'wb').write(bytes(100))")):
        name = n(tag)
        plant = code.replace("{p}", os.path.join(node.shm, name))
        _as_user(u, f"import os; os.mkdir({node.sdir(name)!r}, 0o700); " + plant)
        p.names.append(name)
        p.segments.append(name)
        p.keep.append(os.path.join(node.shm, name))
        p.may_go.append(node.sdir(name))
        node.planted += [node.sdir(name), os.path.join(node.shm, name)]

    # 15. a stage directory that is a symlink to root's directory
    p = mk("stage-symlink")
    name = n("ps")
    d = node.sdir(name)
    _as_user(u, f"import os; os.mkdir({d!r}, 0o700); os.symlink({sec!r}, {os.path.join(d, 'pp1')!r})")
    p.names.append(name)
    p.keep += [d, os.path.join(d, "pp1"), os.path.join(sec, "w0.sock")]
    node.planted.append(d)

    for p in node.plants:
        for path in p.keep:
            st = os.lstat(path)
            node.idents[path] = (st.st_dev, st.st_ino)
        PLANTED.append(("--root" if node.root else "real", p.case, len(p.keep)))


def _kvctl_cmd(user: str | None, root: str | None, args: list[str]) -> list[str]:
    glob = ["--root", root] if root else []
    if user is None:
        return [KVCTL, *glob, *args]
    # The venv's interpreter lives under /root (0700): run the same code with the system
    # Python of the same minor version, the venv's packages on the path.
    return [
        "runuser",
        "-u",
        user,
        "--",
        "/usr/bin/env",
        f"PYTHONPATH={REPO}:{SITE}",
        "NO_COLOR=1",
        f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}",
        "-c",
        "import sys; sys.argv[0] = 'kvctl'; from kvctl.cli import main; sys.exit(main())",
        *glob,
        *args,
    ]


def _run(user: str | None, root: str | None, args: list[str], case: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        _kvctl_cmd(user, root, args),
        capture_output=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
        stdin=subprocess.DEVNULL,
    )
    who = user or "root"
    CASES_RUN.append(f"{case} | {who} | {'--root' if root else 'real'} | {' '.join(args)} | exit {r.returncode}")
    out = r.stdout + r.stderr
    if args[0] == "limit":
        assert r.returncode in (6, 7), f"{who} {args}: limit on a planted non-segment exited {r.returncode}: {out!r}"
    assert r.returncode in EXIT_CODES, f"{who} {args}: undocumented exit {r.returncode}: {out[-2000:]!r}"
    assert b"Traceback" not in out, f"{who} {args}: traceback: {out[-3000:].decode(errors='replace')}"
    for byte in set(out) & (set(range(0x20)) - {0x0A, 0x09}):
        raise AssertionError(
            f"{who} {args}: raw control byte {byte:#04x} in output: "
            f"{out[max(0, out.index(bytes([byte])) - 80) : out.index(bytes([byte])) + 40]!r}"
        )
    for line in out.splitlines():
        assert not any(line.lstrip().startswith(f) for f in LINE_FORGERIES), (
            f"{who} {args}: a planted newline reached the output raw: {line!r}"
        )
    if "--json" in args and r.stdout.strip():
        doc = json.loads(r.stdout)
        _validate(doc)
    return r


def _validate(doc: dict) -> None:
    schema = "list" if isinstance(doc, list) else str(doc.get("schema", ""))
    name = {"kvctl.gc/1": "gc", "kvctl.delete/1": "gc", "kvctl.inspect/1": "inspect", "kvctl.limit/1": "limit",
            "kvctl.error/1": "error", "list": "list"}.get(schema)
    if name:
        validate(doc, name)


def _check_node(node: Node, secrets: dict[str, tuple[bytes, float]]) -> None:
    for p in node.plants:
        for path in p.keep:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                raise AssertionError(f"[{p.case}] {path!r} was removed") from None
            assert (st.st_dev, st.st_ino) == node.idents[path], f"[{p.case}] {path!r} was replaced"
    for path, (content, mtime) in {**secrets, **node.secrets}.items():
        with open(path, "rb") as f:
            assert f.read() == content, f"root's {path} was written"
        assert os.stat(path).st_mtime == mtime, f"root's {path} mtime changed"


@pytest.fixture(scope="module")
def user() -> Iterator[tuple[str, int]]:
    name = f"kvh{PID % 100000}"
    subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name], check=True)
    uid = int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout)
    yield name, uid
    subprocess.run(["userdel", name], check=False)


def _secret_dir(base: str) -> tuple[str, dict[str, tuple[bytes, float]]]:
    sec = os.path.join(base, f"{PREFIX}-rootsecret")
    os.mkdir(sec, 0o755)
    with open(os.path.join(sec, "root-file"), "wb") as f:
        f.write(b"root's data, not to be touched")
    _stale_sock(os.path.join(sec, "w0.sock"))
    return sec, {
        os.path.join(sec, "root-file"): (
            b"root's data, not to be touched",
            os.stat(os.path.join(sec, "root-file")).st_mtime,
        )
    }


def _commands(node: Node) -> list[tuple[str, list[str]]]:
    """(case, kvctl args) for this node: read-only ones first, then the removing ones."""
    real = node.root is None
    scope = [f"{PREFIX}*"] if real else []  # on the real node never touch anyone else's state
    cmds: list[tuple[str, list[str]]] = [
        ("all", ["inspect"]),
        ("all", ["inspect", "--json"]),
        ("all", ["gc", "--dry-run", "--min-age", "0", *scope]),
        ("all", ["gc", "--dry-run", "--min-age", "0", "--json", *scope]),
        ("all", ["list", "--json"]),
    ]
    for p in node.plants:
        for seg in p.segments:
            cmds.append((p.case, ["limit", seg, "1G", "--json"]))
        for name in p.names:
            cmds.append((p.case, ["delete", name, "--yes", "--min-age", "0", "--json"]))
    cmds += [
        ("all", ["gc", "--yes", "--min-age", "0", *scope]),
        ("all", ["gc", "--yes", "--min-age", "0", "--json", *scope]),
    ]
    return cmds


def _hostile_run(node: Node, secrets: dict[str, tuple[bytes, float]], user: tuple[str, int]) -> None:
    plant_all(node)
    try:
        for who in (user[0], None):  # the user first (it may only touch its own), then root
            for case, args in _commands(node):
                _run(who, node.root, args, case)
                try:
                    _check_node(node, secrets)
                except AssertionError as e:
                    raise AssertionError(f"after `kvctl {' '.join(args)}` as {who or 'root'}: {e}") from None
    finally:
        if node.root is None:
            for path in node.planted:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    os.unlink(path)


def test_hostile_node_under_root(tmp_path_factory, user) -> None:  # type: ignore[no-untyped-def]
    """Traps in a node root the user controls (--root)."""
    base = str(tmp_path_factory.mktemp("h"))  # short: socket paths must stay under 108 bytes
    os.chmod(base, 0o755)
    root = os.path.join(base, "n")
    for sub in ("tmp", "dev/shm"):
        os.makedirs(os.path.join(root, sub))
        os.chmod(os.path.join(root, sub), 0o1777)
    os.chown(root, user[1], user[1])
    for p in (os.path.dirname(base), os.path.dirname(os.path.dirname(base))):
        os.chmod(p, os.stat(p).st_mode | 0o005)  # pytest's basetemp is 0700: let the user in
    sec, secrets = _secret_dir(base)
    _hostile_run(Node(root, user[0], user[1], sec), secrets, user)


def test_hostile_node_real_tmp_and_shm(tmp_path, user) -> None:  # type: ignore[no-untyped-def]
    """The same traps in the real /tmp and /dev/shm, unique names, removed afterwards."""
    sec, secrets = _secret_dir("/tmp")
    try:
        _hostile_run(Node(None, user[0], user[1], sec), secrets, user)
    finally:
        shutil.rmtree(sec, ignore_errors=True)


HOSTILE_TESTS = ("test_hostile_node_under_root", "test_hostile_node_real_tmp_and_shm")
_CLAIM = re.compile(r"(\d+) trap kinds planted (\d+) times \((\d+) entries that must survive\); (\d+) `kvctl` "
                    r"invocations \(([^)]*)\) as root and as that user")


def _documented_claim() -> tuple[tuple[int, int, int, int], list[str]]:
    """docs/PROOF.md's "Hostile node" numbers (kinds, plantings, survivors, invocations) and the commands it names."""
    with open(os.path.join(REPO, "docs/PROOF.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    m = _CLAIM.search(text)
    assert m, "docs/PROOF.md's Hostile node section no longer states its counts in the form this test reads"
    commands = [c.strip("` ") for c in m.group(5).split(",") if c.strip().startswith("`")]
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))), commands


def test_zz_hostile_case_count(request: pytest.FixtureRequest) -> None:
    """What docs/PROOF.md says the hostile suite does is what this session did: its counts, each command, each user."""
    selected = {item.name for item in request.session.items}
    if not set(HOSTILE_TESTS) <= selected:
        pytest.skip("both hostile tests must run in this session for their counts to mean anything")
    traps = sorted({t for _, t, _ in PLANTED})
    survivors = sum(k for _, _, k in PLANTED)
    print(
        f"\nhostile traps: {len(traps)} kinds, planted {len(PLANTED)} times "
        f"({survivors} entries that must survive) in {len({n for n, _, _ in PLANTED})} roots"
    )
    print(f"hostile cases (trap set x user x root x kvctl command, each followed by a full check): {len(CASES_RUN)}")
    print("  traps: " + ", ".join(traps))
    from collections import Counter

    by = Counter((c.split(" | ")[3].split()[0], c.split(" | ")[1] == "root", c.split(" | ")[-1]) for c in CASES_RUN)
    for (cmd, as_root, code), k in sorted(by.items()):
        print(f"  {cmd:8} as {'root' if as_root else 'user'}: {code} x{k}")

    counts, commands = _documented_claim()
    assert (len(traps), len(PLANTED), survivors, len(CASES_RUN)) == counts, (
        "docs/PROOF.md's Hostile node counts (kinds, plantings, entries that must survive, invocations) "
        f"are {counts}; this run: {(len(traps), len(PLANTED), survivors, len(CASES_RUN))}")
    # Every trap kind on both nodes, every command docs/PROOF.md names as root and as the user on both.
    assert {(n, t) for n, t, _ in PLANTED} == {(n, t) for n in ("--root", "real") for t in traps}
    ran = {(c.split(" | ")[1] == "root", c.split(" | ")[2], c.split(" | ")[3]) for c in CASES_RUN}
    for cmd in commands:
        if cmd == "--json":
            continue  # "with and without `--json`": checked below
        for as_root in (True, False):
            for node in ("--root", "real"):
                assert any(r == as_root and n == node and (a + " ").startswith(cmd + " ") for r, n, a in ran), (
                    f"kvctl {cmd} did not run as {'root' if as_root else 'the user'} on the {node} node")
    assert {"--json" in a.split() for _, _, a in ran} == {True, False}, "with and without --json"
