"""Small pieces of the engine pass's API that the kvctl phase calls."""

from __future__ import annotations

from kvcached.node.clean.present import rpc_dirs


def test_vllm_rpc_base_path_is_rebased_under_the_root() -> None:
    assert rpc_dirs("/", {"VLLM_RPC_BASE_PATH": "/var/run/vllm"}) == ("/var/run/vllm",)
    assert rpc_dirs("/srv/node", {"VLLM_RPC_BASE_PATH": "/var/run/vllm/"}) == ("/srv/node/var/run/vllm",)


def test_unset_empty_or_relative_means_only_tmp() -> None:
    for env in ({}, {"VLLM_RPC_BASE_PATH": ""}, {"VLLM_RPC_BASE_PATH": "rpc"}):
        assert rpc_dirs("/", env) == ()


def test_the_name_patterns_load_alone() -> None:
    """Plain gc's hint (present.engine_leftover_count) imports the name patterns, not the scan, evidence and act."""
    import subprocess
    import sys

    code = ("import sys, kvcached.node.clean.leftovers.families\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvcached.node.clean.leftovers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['kvcached.node.clean.leftovers', 'kvcached.node.clean.leftovers.families']"


def test_the_cheap_prefixes_cover_every_family_in_dev_shm() -> None:
    """present.engine_leftover_count skips names without one of these prefixes: none of a family's may lack one."""
    import re

    from kvcached.node.clean.leftovers.families import FAMILIES, Where
    from kvcached.node.clean.present import ENGINE_SHM_PREFIXES

    shm = [f for f in FAMILIES if f.where is Where.SHM]
    assert len(shm) == 12
    for fam in shm:
        raw = fam.pattern.pattern.removeprefix("(?P<group>")
        m = re.match(r"(?:[A-Za-z0-9_-]|\\\.)+", raw)
        assert m is not None, fam.pattern
        literal = m.group(0).replace("\\.", ".")
        assert literal.startswith(ENGINE_SHM_PREFIXES), (literal, fam.pattern)


def test_the_cheap_rpc_shape_covers_every_family_in_rpc_dirs() -> None:
    """present.engine_leftover_count skips RPC names of another length or prefix: real names of each family pass."""
    import tempfile
    import uuid

    from kvcached.node.clean.leftovers.families import FAMILIES, EngineKind, Where, match_name
    from kvcached.node.clean.present import _rpc_shaped

    assert {f.kind for f in FAMILIES if f.where is Where.RPC} == {EngineKind.VLLM_IPC, EngineKind.SGLANG_IPC}
    sequence = tempfile._get_candidate_names()  # type: ignore[attr-defined]  # what mkstemp draws from
    names = [str(uuid.uuid4()) for _ in range(50)] + [tempfile.template + next(sequence) for _ in range(50)]
    for n in names:
        assert match_name(Where.RPC, n) is not None, n
        assert _rpc_shaped(n), n
    assert not _rpc_shaped("tmpab12cd_99") and not _rpc_shaped("xmpab12cd_9")


def test_gc_kind_choices_are_kvcacheds_kinds_and_the_engine_kinds() -> None:
    from kvcached.node.base.enums import EngineKind, Kind
    from kvctl.commands.gc import NODE_KIND, KindChoice

    assert [c.value for c in KindChoice] == [m.value for m in (*Kind, *EngineKind)]
    assert all(NODE_KIND[c].value == c.value for c in KindChoice)
