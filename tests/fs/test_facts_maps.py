"""The /proc/<pid>/maps reads that Facts.mapped() and Facts.map_users() share, on their two error paths.

Real processes that map a real file (fd closed, so only their maps show it):
one that exits between the fact pass and the query (gone: skipped, hides
nothing), and one of root's that an unprivileged fact pass may not read
(EACCES: a blind spot), while that user's own maps it reads.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.facts import Facts, gather_facts

from .engine_plant import MAPPER, Children
from .helpers import run_as

QUERIES = ["mapped", "map_users"]


def _query(facts: Facts, query: str, ident: tuple[int, int]) -> list[int]:
    got = facts.mapped() if query == "mapped" else facts.map_users({ident[0]})
    return got.get(ident, [])


def _plant(layout: Layout, uniq: str) -> tuple[str, tuple[int, int]]:
    path = os.path.join(layout.shm_dir, f"{uniq}-mapped")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, b"k" * 4096)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return path, (st.st_dev, st.st_ino)


@pytest.mark.parametrize("query", QUERIES)
def test_a_process_gone_since_the_pass_is_skipped_not_blind(query: str, layout: Layout, uniq: str,
                                                            children: Children) -> None:
    path, ident = _plant(layout, uniq)
    stays = children.spawn(MAPPER, path)
    goes = children.spawn(MAPPER, path)
    facts = gather_facts()
    assert {stays.pid, goes.pid} <= facts.processes.keys()
    goes.kill()
    goes.wait()  # reaped: its /proc/<pid> is gone (ENOENT)
    assert _query(facts, query, ident) == [stays.pid]
    assert "maps" not in facts.unreadable_pids.get(goes.pid, frozenset())


# The fact pass as the unprivileged user, mapping the file itself (the venv's interpreter lives
# under /root, which that user cannot run, so a child of its own is not spawned from here).
AS_USER = textwrap.dedent("""
    import json, mmap, os, sys
    from kvcached.node.clean.facts import gather_facts
    query, path, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    st = os.stat(path)
    fd = os.open(path, os.O_RDONLY)
    mine = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
    facts = gather_facts()
    before = sorted(facts.unreadable_pids.get(pid, ()))
    got = facts.mapped() if query == "mapped" else facts.map_users({st.st_dev})
    print(json.dumps({"seen": pid in facts.processes, "before": before,
                      "after": sorted(facts.unreadable_pids.get(pid, ())),
                      "users": got.get((st.st_dev, st.st_ino), []), "me": os.getpid()}))
""")


@pytest.mark.parametrize("query", QUERIES)
def test_a_process_we_may_not_read_is_a_blind_spot(query: str, layout: Layout, uniq: str, children: Children,
                                                   unpriv_user) -> None:  # type: ignore[no-untyped-def]
    path, _ = _plant(layout, uniq)
    roots = children.spawn(MAPPER, path)
    out = run_as(unpriv_user, AS_USER, query, path, str(roots.pid))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["seen"], doc  # listed (stat and status are world-readable), only its maps are not
    assert "maps" not in doc["before"] and "maps" in doc["after"], doc
    assert doc["users"] == [doc["me"]], doc  # its own maps it reads
