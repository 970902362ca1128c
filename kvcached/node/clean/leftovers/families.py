"""The engines' leftover families: which names, where, and what evidence of life each carries.

Each pattern is as tight as the code that makes the names allows (read from
the installed sources: CPython 3.11's multiprocessing.shared_memory and
synchronize, vLLM 0.33, SGLang's make_shm_name, load snapshots and ZMQ
endpoints, NCCL's shmutils.cc, torch 2.13's file_system sharing, loky's
semaphores). A name
that matches none of them is never touched, however much it looks like one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from ...base.enums import Engine, EngineKind, StrEnum

# Nothing of the pipeline is imported here: report.Origin names a Family (its entries' `origin`, one per family,
# is leftovers/scan.py's).


class Where(StrEnum):
    """Which directory a family lives in."""

    SHM = "shm"  # /dev/shm
    RPC = "rpc"  # /tmp, or VLLM_RPC_BASE_PATH: where the engines bind their ZMQ IPC sockets


class Evidence(StrEnum):
    """What can prove an entry of the family alive."""

    USERS = "users"        # a process maps it or holds it open; nothing else
    CREATOR = "creator"    # as USERS, or the PID in its name is alive and started before it
    BINDING = "binding"    # a socket is bound to the node


@dataclass(frozen=True)
class Family:
    kind: EngineKind
    engine: Engine
    where: Where
    evidence: Evidence
    pattern: re.Pattern[str]
    what: str  # who makes these names, for reports and docs/KVCTL.md §13


class Match(NamedTuple):
    family: Family
    creator_pid: int | None  # the PID in the name (CREATOR families)
    group: str | None        # files that form one region: a live member keeps the others


def _f(kind: EngineKind, engine: Engine, where: Where, evidence: Evidence, pattern: str, what: str) -> Family:
    return Family(kind, engine, where, evidence, re.compile(pattern), what)


_HEX = "[0-9a-f]"
# vLLM's engine_id (kv_transfer_config): uuid4 by default, any name a user sets; never a "/".
_ENGINE_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}?"

FAMILIES: tuple[Family, ...] = (
    # CPython: "/psm_" + secrets.token_hex((_SHM_SAFE_NAME_LENGTH 14 - 5) // 2), so 8 lowercase hex digits.
    # vLLM's ShmRingBuffer (shm_broadcast), ShmTensorArena and is_in_the_same_node probe create these.
    _f(EngineKind.VLLM_SHM, Engine.VLLM, Where.SHM, Evidence.USERS, rf"psm_{_HEX}{{8}}",
       "Python shared memory: vLLM's shm broadcast ring, tensor arena, node probe"),
    # envs._generate_shm_name: "vllm_mm_" + urlsafe base64 of a uuid4 (16 bytes: 22 characters, '=' stripped).
    _f(EngineKind.VLLM_SHM, Engine.VLLM, Where.SHM, Evidence.USERS, r"vllm_mm_[A-Za-z0-9_-]{22}",
       "vLLM's multimodal object storage (VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME's default)"),
    # SharedOffloadRegion: vllm_offload_<engine_id>.mmap, then .mmap.<i> for segments i >= 1.
    _f(EngineKind.VLLM_SHM, Engine.VLLM, Where.SHM, Evidence.USERS,
       rf"(?P<group>vllm_offload_{_ENGINE_ID}\.mmap)(?:\.[1-9][0-9]{{0,5}})?",
       "vLLM's CPU KV offload region"),
    _f(EngineKind.VLLM_SHM, Engine.VLLM, Where.SHM, Evidence.USERS, rf"vllm_ec_{_ENGINE_ID}\.mmap",
       "vLLM's encoder cache region"),
    # network_utils.get_open_zmq_ipc_path: f"{VLLM_RPC_BASE_PATH}/{uuid4()}": version 4, RFC 4122 variant.
    _f(EngineKind.VLLM_IPC, Engine.VLLM, Where.RPC, Evidence.BINDING,
       rf"{_HEX}{{8}}-{_HEX}{{4}}-4{_HEX}{{3}}-[89ab]{_HEX}{{3}}-{_HEX}{{12}}",
       "vLLM's ZMQ IPC sockets"),
    # PortArgs (srt/server_args.py), the multi-tokenizer and detokenizer workers and the forward-pass metrics
    # reporter name their ZMQ endpoints f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}": "tmp", then 8 of
    # _RandomNameSequence.characters (CPython 3.11), in tempfile.gettempdir(). zmq replaces the empty file with
    # the socket; a name zmq never bound stays a regular file, which the RPC scan never takes.
    _f(EngineKind.SGLANG_IPC, Engine.SGLANG, Where.RPC, Evidence.BINDING, r"tmp[a-z0-9_]{8}",
       "SGLang's ZMQ IPC sockets"),
    # make_shm_name: f"sgl_shm_{kind}_{os.getpid()}_{uuid4().hex[:8]}"; the PID is the second-to-last field.
    _f(EngineKind.SGLANG_SHM, Engine.SGLANG, Where.SHM, Evidence.CREATOR,
       rf"sgl_shm_[A-Za-z0-9_.-]*?_(?P<pid>[1-9][0-9]{{0,9}})_{_HEX}{{8}}",
       "SGLang shared memory (multimodal features and others)"),
    # write_data_for_multi_tokenizer: f"multi_tokenizer_args_{os.getpid()}", written and closed.
    _f(EngineKind.SGLANG_SHM, Engine.SGLANG, Where.SHM, Evidence.CREATOR,
       r"multi_tokenizer_args_(?P<pid>[1-9][0-9]{0,9})", "SGLang's multi-tokenizer arguments"),
    # load_snapshot.shm_path_for: sglang_loads_<sanitised name>_<blake2s 4-byte hex>.shm, kept mapped.
    _f(EngineKind.SGLANG_SHM, Engine.SGLANG, Where.SHM, Evidence.USERS, rf"sglang_loads_[\w.-]+_{_HEX}{{8}}\.shm",
       "SGLang's load snapshots"),
    # ncclShmOpen: mkstemp("/dev/shm/nccl-XXXXXX"), glibc's 62 letters and digits.
    _f(EngineKind.NCCL_SHM, Engine.NCCL, Where.SHM, Evidence.USERS, r"nccl-[A-Za-z0-9]{6}",
       "NCCL shared-memory transport"),
    # The CUDA driver's IPC files: cuda.shm.<uid hex>.<pid hex>.<seq> (closed source: the shape seen on nodes).
    _f(EngineKind.CUDA_SHM, Engine.CUDA, Where.SHM, Evidence.USERS,
       rf"cuda\.shm\.{_HEX}{{1,8}}\.{_HEX}{{1,8}}\.{_HEX}{{1,16}}", "CUDA IPC"),
    # torch.multiprocessing's file_system strategy (a DataLoader's workers, a queue of CPU tensors):
    # at::NewProcessWideShmHandle, "/torch_" + getpid() + "_" + random_device() (an unsigned 32-bit number) + "_"
    # + a per-process counter (uint64), all decimal. The creator maps it while its storage lives; a sender that
    # dropped its tensor after put() leaves it to the receiver unmapped (its shared refcount keeps it), so its
    # creator, alive, is the evidence until then. torch_shm_manager unlinks them only when every client is gone.
    _f(EngineKind.TORCH_SHM, Engine.TORCH, Where.SHM, Evidence.CREATOR,
       r"torch_(?P<pid>[1-9][0-9]{0,9})_(?:0|[1-9][0-9]{0,9})_(?:0|[1-9][0-9]{0,19})",
       "torch's file_system sharing strategy (torch.multiprocessing, DataLoader workers)"),
    # multiprocessing's SemLock under spawn and forkserver (fork unlinks the name at once): "/mp-" + 8 of
    # tempfile's _RandomNameSequence, which sem_open stores as sem.<name>. Every process that has it open maps it
    # (glibc's sem_open maps the file and closes the descriptor): a child given one through pickling opens it.
    _f(EngineKind.PYTHON_SEM, Engine.PYTHON, Where.SHM, Evidence.USERS, r"sem\.mp-[a-z0-9_]{8}",
       "multiprocessing's named semaphores (Lock, Semaphore, Queue under spawn and forkserver)"),
    # loky (joblib's process pool) renames them "/loky-<pid>-<8 of the same sequence>", also for multiprocessing's
    # own once loky is imported (it patches SemLock._make_name): the PID is its creator's.
    _f(EngineKind.PYTHON_SEM, Engine.PYTHON, Where.SHM, Evidence.CREATOR,
       r"sem\.loky-(?P<pid>[1-9][0-9]{0,9})-[a-z0-9_]{8}", "loky's and joblib's named semaphores"),
)

_BY_WHERE = {w: tuple(f for f in FAMILIES if f.where is w) for w in Where}


def match_name(where: Where, name: str) -> Match | None:
    """The family `name` belongs to in `where`, with the PID and group its name carries; None: not an engine's."""
    for fam in _BY_WHERE[where]:
        m = fam.pattern.fullmatch(name)
        if m is None:
            continue
        groups = m.groupdict()
        pid = groups.get("pid")
        return Match(fam, int(pid) if pid is not None else None, groups.get("group"))
    return None
