"""The engine families' name patterns: real names match, names that only look like them never do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from multiprocessing import shared_memory

import pytest

from kvcached.node.base.name_rules import socket_dir_name
from kvcached.node.clean.leftovers.families import FAMILIES, Engine, EngineKind, Evidence, Where, match_name


def _kind(where: Where, name: str) -> EngineKind | None:
    m = match_name(where, name)
    return None if m is None else m.family.kind


def test_cpython_shared_memory_names_are_vllm_buffers() -> None:
    """Names from CPython's own SharedMemory (what vLLM's shm broadcast and tensor arena create)."""
    for _ in range(20):
        shm = shared_memory.SharedMemory(create=True, size=64)
        try:
            assert _kind(Where.SHM, shm.name.lstrip("/")) is EngineKind.VLLM_SHM, shm.name
        finally:
            shm.close()
            shm.unlink()


def test_tempfile_names_are_sglang_sockets(tmp_path) -> None:
    """Names from CPython's own NamedTemporaryFile(delete=False), the call SGLang's PortArgs names endpoints with."""
    for _ in range(200):
        f = tempfile.NamedTemporaryFile(dir=tmp_path, delete=False)
        f.close()
        assert os.path.dirname(f.name) == str(tmp_path)
        assert _kind(Where.RPC, os.path.basename(f.name)) is EngineKind.SGLANG_IPC, f.name
        assert match_name(Where.SHM, os.path.basename(f.name)) is None


def test_the_sglang_pattern_is_exactly_tempfiles_alphabet() -> None:
    """tempfile's template and every character its name sequence draws from, and nothing else (CPython 3.11)."""
    assert tempfile.template == "tmp"
    alphabet = tempfile._RandomNameSequence.characters  # type: ignore[attr-defined]
    assert alphabet == "abcdefghijklmnopqrstuvwxyz0123456789_"
    for ch in alphabet:
        assert _kind(Where.RPC, "tmp" + ch * 8) is EngineKind.SGLANG_IPC, ch
    for ch in map(chr, range(33, 127)):
        if ch not in alphabet:
            assert match_name(Where.RPC, "tmp" + ch * 8) is None, ch


_VLLM_NAMES = r"""
import json
from vllm.envs import _generate_shm_name
from vllm.utils.network_utils import get_open_zmq_ipc_path
print(json.dumps({"mm": [_generate_shm_name() for _ in range(50)],
                  "ipc": [get_open_zmq_ipc_path() for _ in range(50)]}))
"""


@pytest.mark.vllm
def test_vllm_033_generates_names_that_match() -> None:
    """vLLM 0.33's own name makers, run in a child (they import torch): object storage and ZMQ IPC paths."""
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh)")
    env = {**os.environ, "VLLM_RPC_BASE_PATH": "/tmp"}
    r = subprocess.run([sys.executable, "-c", _VLLM_NAMES], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    names = json.loads(r.stdout.strip().splitlines()[-1])
    for n in names["mm"]:
        assert _kind(Where.SHM, n) is EngineKind.VLLM_SHM, n
    for path in names["ipc"]:
        assert path.startswith("ipc:///tmp/")
        assert _kind(Where.RPC, path.rpartition("/")[2]) is EngineKind.VLLM_IPC, path


@pytest.mark.parametrize(("where", "name", "kind", "pid", "group"), [
    (Where.SHM, "psm_0a1b2c3d", EngineKind.VLLM_SHM, None, None),
    (Where.SHM, "vllm_offload_8f1c2d3e-aaaa-4bbb-8ccc-0123456789ab.mmap", EngineKind.VLLM_SHM, None,
     "vllm_offload_8f1c2d3e-aaaa-4bbb-8ccc-0123456789ab.mmap"),
    (Where.SHM, "vllm_offload_engine-0.mmap.3", EngineKind.VLLM_SHM, None, "vllm_offload_engine-0.mmap"),
    (Where.SHM, "vllm_ec_engine-0.mmap", EngineKind.VLLM_SHM, None, None),
    (Where.SHM, "sgl_shm_mm_4242_deadbeef", EngineKind.SGLANG_SHM, 4242, None),
    # SGLang reads the PID as the second-to-last field, whatever the tag holds.
    (Where.SHM, "sgl_shm_mm_feat_12_4242_deadbeef", EngineKind.SGLANG_SHM, 4242, None),
    (Where.SHM, "sgl_shm__77_deadbeef", EngineKind.SGLANG_SHM, 77, None),
    (Where.SHM, "multi_tokenizer_args_31337", EngineKind.SGLANG_SHM, 31337, None),
    (Where.SHM, "sglang_loads_default_0a1b2c3d.shm", EngineKind.SGLANG_SHM, None, None),
    (Where.SHM, "sglang_loads_my.ipc-name_0a1b2c3d.shm", EngineKind.SGLANG_SHM, None, None),
    (Where.SHM, "nccl-Ab3dE9", EngineKind.NCCL_SHM, None, None),
    (Where.SHM, "cuda.shm.3e9.52f2.1", EngineKind.CUDA_SHM, None, None),
    (Where.SHM, "torch_5650_3262000796_0", EngineKind.TORCH_SHM, 5650, None),
    (Where.SHM, "torch_1_0_18446744073709551615", EngineKind.TORCH_SHM, 1, None),
    (Where.SHM, "sem.mp-ab12cd_9", EngineKind.PYTHON_SEM, None, None),
    (Where.SHM, "sem.loky-31337-ab12cd_9", EngineKind.PYTHON_SEM, 31337, None),
    (Where.RPC, str(uuid.UUID(int=0x1234, version=4)), EngineKind.VLLM_IPC, None, None),
    (Where.RPC, "tmpab12cd_9", EngineKind.SGLANG_IPC, None, None),
    (Where.RPC, "tmp________", EngineKind.SGLANG_IPC, None, None),
])
def test_real_shapes_match(where: Where, name: str, kind: EngineKind, pid: int | None, group: str | None) -> None:
    m = match_name(where, name)
    assert m is not None and m.family.kind is kind
    assert m.creator_pid == pid
    assert m.group == group


LOOKALIKES = [
    "psm_0a1b2c3",            # 7 hex digits: CPython always makes 8
    "psm_0a1b2c3d4",          # 9
    "psm_0A1B2C3D",           # token_hex is lowercase
    "psm_0a1b2c3g",
    "psm_0a1b2c3d.bak",
    "psm_",
    "vllm_mm_short",
    "vllm_mm_nUKTVBmkToWItLaBT5T-E",   # 21 characters: a uuid4 in base64 has 22
    "vllm_offload_.mmap",
    "vllm_offload_x.mmap.0",  # segments are numbered from 1
    "vllm_offload_x.mmapx",
    "sgl_shm_mm_0_deadbeef",  # PID 0 is no process
    "sgl_shm_mm_4242_deadbee",
    "sgl_shm_mm_4242_DEADBEEF",
    "sgl_shm_mm_x_deadbeef",
    "sgl_shm_mm_4242",
    "multi_tokenizer_args_",
    "multi_tokenizer_args_0",
    "multi_tokenizer_args_12a",
    "sglang_loads_default.shm",
    "sglang_loads_default_0a1b2c3d",
    "nccl-Ab3dE",             # mkstemp fills exactly six
    "torch_5650_3262000796",  # torch 2.13 always appends the counter
    "torch_0_1_2",            # PID 0 is no process
    "torch_5650_03262000796_0",  # std::to_string writes no leading zero
    "torch_5650_42949672950_0",  # random_device() is 32 bits: ten digits at most
    "torch_x_1_2",
    "torch_5650_1_2.bak",
    "sem.mp-ab12cd_",         # tempfile's sequence draws exactly eight
    "sem.mp-ab12cd_9x",
    "sem.mp-AB12CD_9",        # lowercase only
    "sem.mp_ab12cd_9",
    "sem.loky-0-ab12cd_9",
    "sem.loky-x-ab12cd_9",
    "sem.loky-31337-ab12cd",
    "sem.other-ab12cd_9",     # any other program's semaphore
    "nccl-Ab3dE9x",
    "nccl-Ab3_E9",
    "nccl-shm-recv-1",
    "cuda.shm.123",
    "cuda.shm.3e9.52f2",
    "cuda.shm.3e9.xyz.1",
    "kvcached_vLLM_4242",     # ours, never an engine's
    "sem.loky-0-testonly",
]


@pytest.mark.parametrize("name", LOOKALIKES)
def test_lookalikes_in_dev_shm_never_match(name: str) -> None:
    assert match_name(Where.SHM, name) is None


@pytest.mark.parametrize("name", [
    str(uuid.UUID(int=0x1234, version=1)),            # another version
    "a0b1c2d3-e4f5-4a6b-8c7d-e8f9a0b1c2d3".upper(),   # str(uuid4()) is lowercase
    "0123456789abcdef0123456789abcdef",               # uuid4().hex: not vLLM's spelling
    str(uuid.UUID(int=0x1234, version=4)) + ".sock",
    "12345678-1234-4234-c234-123456789abc",           # not the RFC 4122 variant uuid4() sets
    "12345678-1234-4234-8234-123456789ab",            # one digit short
    socket_dir_name("kvcached_vLLM_4242"),
    "tmpab12cd_",                                     # tempfile always draws 8 characters
    "tmpab12cd_99",
    "tmpAB12CD_9",                                    # its alphabet is lowercase
    "tmpab12cD_9",
    "TMPab12cd_9",
    "tmpab12cd-9",
    "tmpab12cd.9",
    "tmpab12cd_9.sock",
    "tmp-ab12cd_9",
    "tmp",
    "pymp-ab12cd_9",                                  # multiprocessing's directories: another prefix
])
def test_lookalikes_in_rpc_dirs_never_match(name: str) -> None:
    assert match_name(Where.RPC, name) is None


def test_a_shm_name_is_not_an_rpc_name_and_back() -> None:
    assert match_name(Where.RPC, "psm_0a1b2c3d") is None
    assert match_name(Where.SHM, str(uuid.uuid4())) is None
    assert match_name(Where.SHM, "tmpab12cd_9") is None


def test_sglang_ipc_is_sglangs_and_proven_by_a_binding() -> None:
    m = match_name(Where.RPC, "tmpab12cd_9")
    assert m is not None
    fam = m.family
    assert (fam.kind, fam.engine, fam.where, fam.evidence) == (EngineKind.SGLANG_IPC, Engine.SGLANG, Where.RPC,
                                                               Evidence.BINDING)
    assert (m.creator_pid, m.group) == (None, None)


def test_every_kind_and_engine_has_a_family() -> None:
    assert {f.kind for f in FAMILIES} == set(EngineKind)
    assert {f.engine for f in FAMILIES} == set(Engine)
    assert {f.evidence for f in FAMILIES} == set(Evidence)
