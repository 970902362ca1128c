"""Naming and layout, both directions (docs/NODE.md §1-3)."""

from __future__ import annotations

import pytest

from kvcached.node.base import name_rules
from kvcached.node.base.errors import InvalidName, PathTooLong
from kvcached.node.base.layout import Layout, PathKind, PathRef


def test_sanitize_matches_upstream_rule() -> None:
    assert name_rules.sanitize("my model/v1:prod") == "my-model-v1-prod"
    assert name_rules.sanitize("ünïcode_ok-1") == "ünïcode_ok-1"  # str.isalnum is Unicode-aware
    assert name_rules.sanitize("a" * 100) == "a" * 64
    assert name_rules.sanitize("x\ny\x1b[31m") == "x-y--31m"


def test_name_from_env_explicit_and_default() -> None:
    assert name_rules.ipc_name_from_env({"KVCACHED_IPC_NAME": "a b"}) == "a-b"
    assert name_rules.ipc_name_from_env({"KVCACHED_IPC_NAME": ""}, tag="proc").startswith("kvcached_proc_")
    assert name_rules.default_ipc_name("vLLM", 12345) == "kvcached_vLLM_12345"
    assert name_rules.default_name_pgid("kvcached_vLLM_12345") == 12345
    assert name_rules.default_name_pgid("kvcached_SGLang_7_g1") == 7
    assert name_rules.default_name_pgid("explicit") is None


def test_hash_is_upstreams() -> None:
    # The example from docs/NODE.md §3.
    assert name_rules.socket_dir_name("kvcached_vLLM_12345") == "kvcached-tp-kvcached_vLLM_12345-9bc83684"


def test_socket_hash_is_upstreams_uuid5() -> None:
    """The directory suffix is the first 8 hex digits of uuid5(NAMESPACE_DNS, name), whichever SHA-1 computes it."""
    import uuid

    for name in ("n", "kvcached_vLLM_12345", "ünïcode_ok-1", "a" * 64, "x.y-z_0"):
        assert name_rules.socket_hash(name) == str(uuid.uuid5(uuid.NAMESPACE_DNS, name))[:8], name


def test_forward_paths() -> None:
    lay = Layout("/r")
    assert lay.segment_path("n") == "/r/dev/shm/n"
    d = f"/r/tmp/kvcached-tp-n-{name_rules.socket_hash('n')}"
    assert lay.socket_dir("n") == d
    assert lay.socket_path("n", 3) == f"{d}/w3.sock"
    assert lay.socket_path("n", 1, 2) == f"{d}/pp2/w1.sock"
    assert [p for _, _, p in lay.socket_paths("n", 2, 2)] == [
        f"{d}/w0.sock", f"{d}/w1.sock", f"{d}/pp1/w0.sock", f"{d}/pp1/w1.sock"]


def test_reverse_classification() -> None:
    lay = Layout("/r")
    d = lay.socket_dir("n")
    assert lay.classify(lay.socket_path("n", 1, 2)) == PathRef(kind=PathKind.SOCKET, deployment="n", rank=1, stage=2)
    assert lay.classify(lay.socket_path("n", 0)) == PathRef(kind=PathKind.SOCKET, deployment="n", rank=0, stage=0)
    assert lay.classify(d) == PathRef(kind=PathKind.SOCKET_DIR, deployment="n")
    assert lay.classify(f"{d}/pp1") == PathRef(kind=PathKind.STAGE_DIR, deployment="n", stage=1)
    assert lay.classify("/r/tmp/kvcached-tp-n-00000000") == PathRef(kind=PathKind.SOCKET_DIR, deployment="n",
                                                                     hash_ok=False)
    assert lay.classify("/r/dev/shm/kvcached_vLLM_9") == PathRef(kind=PathKind.SEGMENT, deployment="kvcached_vLLM_9")
    for not_ours in ("/r/dev/shm/nccl-123", "/r/tmp/other", f"{d}/junk", f"{d}/pp0", "/etc/passwd", "/r/tmp"):
        assert lay.classify(not_ours) is None, not_ours


def test_invalid_names_and_long_paths() -> None:
    lay = Layout("/")
    with pytest.raises(InvalidName):
        lay.segment_path("../etc/passwd")
    with pytest.raises(InvalidName):
        lay.socket_dir("")
    with pytest.raises(PathTooLong):
        Layout("/" + "x" * 80).check_socket_path(Layout("/" + "x" * 80).socket_path("n" * 40, 0))


def test_pid_view_maps_paths_as_processes_see_them() -> None:
    lay = Layout.for_pid(42)
    p = lay.socket_path("n", 0)
    assert p.startswith("/proc/42/root/tmp/")
    assert lay.seen_path(p) == Layout().socket_path("n", 0)


def test_trailing_newlines_are_not_ours() -> None:
    lay = Layout("/r")
    d = lay.socket_dir("n")
    for planted in (f"{d}/w0.sock\n", f"{d}/pp1\n", f"{d}\n", "/r/dev/shm/kvcached_proc_1\n"):
        assert lay.classify(planted) is None, repr(planted)
    assert name_rules.parse_socket_name("w0.sock\n") is None
    assert name_rules.parse_stage_name("pp1\n") is None
    assert name_rules.default_name_pgid("kvcached_vLLM_12\n") is None


def test_dp_rank_names() -> None:
    """Each DP rank of a serve is its own deployment: `<serve>_dp<rank>`, never longer than 64, never shared."""
    assert name_rules.dp_rank_name("kvcached_vLLM_4242", 1) == "kvcached_vLLM_4242_dp1"
    assert name_rules.split_dp_rank("kvcached_vLLM_4242_dp1") == ("kvcached_vLLM_4242", 1)
    assert name_rules.split_dp_rank("prod_dp12") == ("prod", 12)
    assert name_rules.split_dp_rank("prod") == ("prod", None)
    assert name_rules.split_dp_rank("_dp1") == ("_dp1", None)  # a name that is all suffix belongs to no serve
    long = "x" * 64
    ranks = [name_rules.dp_rank_name(long, r) for r in (0, 1, 10)]
    assert all(len(n) <= name_rules.MAX_NAME and name_rules.is_valid_name(n) for n in ranks)
    assert len(set(ranks)) == 3 and ranks[1].endswith("_dp1")
    # A default name with a DP suffix is still recognisably ours and keeps its PGID.
    assert name_rules.default_name_pgid("kvcached_vLLM_4242_dp3") == 4242
    assert Layout("/r").classify("/r/dev/shm/kvcached_vLLM_4242_dp3") == PathRef(kind=PathKind.SEGMENT,
                                                                                  deployment="kvcached_vLLM_4242_dp3")
    with pytest.raises(ValueError):
        name_rules.dp_rank_name("n", -1)
