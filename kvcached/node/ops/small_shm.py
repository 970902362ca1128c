"""A /dev/shm too small for the tensor- or pipeline-parallel serve whose processes see it (doctor `small-shm`).

Docker's and containerd's default /dev/shm is 64 MiB. A serve with more
than one rank on a node needs far more there, and fails at its start or on
its first large message with "No space left on device", an NCCL error or a
Bus error. What it needs, read from the engines' and NCCL's sources
(docs/PLACES.md §7):

- vLLM 0.33's multiproc executor (every serve with more than one rank on a
  node): EngineCore's broadcast ring of 10 chunks of VLLM_MQ_MAX_CHUNK_BYTES_MB
  (16 MiB), each worker's response ring of 10 chunks of 24 MiB (MessageQueue's
  default), and each TP group's broadcaster of 6 chunks of 4 MiB; vLLM checks
  each ring's whole size against the free space before it makes it
  (shm_broadcast.check_shm_free_space) and refuses to start below it.
- NCCL's SHM transport (where two ranks' GPUs cannot reach each other
  peer-to-peer): a segment per receiving connection and channel of
  sizeof(ncclRecvMem) plus its LL (512 KiB), LL128 (4800 KiB) and Simple
  (NCCL_BUFFSIZE, 4 MiB) buffers, 9637888 bytes; at least a ring's and a
  tree's connection on each of two channels per rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..base.place import dev_text
from ..clean.roles import Role, classify_process

if TYPE_CHECKING:
    from ..clean.facts import Facts
    from .serves import Serve

MIB = 1 << 20
DOCKER_DEFAULT = 64 * MIB  # Docker's and containerd's /dev/shm when nothing sets its size
VLLM_ENGINE_RING = 10 * 16 * MIB   # MultiprocExecutor's rpc_broadcast_mq: max_chunks 10 x VLLM_MQ_MAX_CHUNK_BYTES_MB
VLLM_WORKER_RING = 10 * 24 * MIB   # each WorkerProc's worker_response_mq: MessageQueue(1, 1)'s defaults
VLLM_GROUP_RING = 6 * 4 * MIB      # each TP group's mq_broadcaster: create_from_process_group(group, 1 << 22, 6)
NCCL_SHM_CONNECTION = 9637888      # one receiving SHM connection on one channel (NCCL's own error names it)
NCCL_CONNECTIONS_PER_RANK = 4      # a ring's and a tree's, on two channels: the fewest NCCL builds between GPUs


class Need(NamedTuple):
    """What one parallel serve needs of the /dev/shm its processes see, and where that is."""

    serve: Serve
    ranks: int
    stages: int
    need_bytes: int
    shm: str                 # the directory measured: /proc/<pid>/root/dev/shm of one of its ranks
    device: str | None
    capacity_bytes: int | None
    error: str | None = None


def need_bytes(engine: str, ranks: int, stages: int) -> int:
    """What a serve of `ranks` ranks on this node in `stages` pipeline stages can take of /dev/shm, all written."""
    nccl = ranks * NCCL_CONNECTIONS_PER_RANK * NCCL_SHM_CONNECTION
    if engine != "vllm":
        return nccl
    return VLLM_ENGINE_RING + ranks * VLLM_WORKER_RING + max(1, stages) * VLLM_GROUP_RING + nccl


def _measure(proc_root: str, pid: int) -> tuple[str, str | None, int | None, str | None]:
    """(the directory, its device, its size, why not) of the /dev/shm process `pid` sees, no link followed."""
    from ..places.discover import open_inside

    root = f"{proc_root}/{pid}/root"
    shm = f"{root}/dev/shm"
    try:
        fd = open_inside(root, "/dev/shm")
    except OSError as e:
        return shm, None, None, f"{shm}: {e.strerror}"
    try:
        st, vfs = os.fstat(fd), os.fstatvfs(fd)
    except OSError as e:
        return shm, None, None, f"{shm}: {e.strerror}"
    finally:
        os.close(fd)
    size = vfs.f_blocks * (vfs.f_frsize or vfs.f_bsize)
    return shm, dev_text(st.st_dev), size or None, None if size else f"{shm}: its filesystem reports no size"


def parallel_needs(facts: Facts, serves: Sequence[Serve]) -> list[Need]:
    """Each serve with more than one rank on this node, what it needs of /dev/shm and what its ranks see."""
    out = []
    for s in serves:
        ranks = [p for p in s.processes if p.role == str(Role.WORKER)]
        if len(ranks) < 2:
            continue
        stages = {classify_process(info).stage or 0 for p in ranks if (info := facts.processes.get(p.pid))}
        shm, dev, size, err = _measure(facts.proc_root, ranks[0].pid)
        out.append(Need(s, len(ranks), len(stages) or 1, need_bytes(s.engine, len(ranks), len(stages)), shm, dev,
                        size, err))
    return out


def _gib(n: int) -> str:
    return f"{-(-n // (1 << 30))}Gi"


def small_shm_findings(needs: Sequence[Need], place_of: dict[str, str]) -> list[tuple[str, str, str | None,
                                                                                       dict[str, Any]]]:
    """A warning for each parallel serve whose /dev/shm is smaller than it needs; `place_of`: device -> label."""
    from ..base.units import format_size

    out: list[tuple[str, str, str | None, dict[str, Any]]] = []
    for n in needs:
        details = {"serve": n.serve.pid, "engine": n.serve.engine, "ranks": n.ranks, "stages": n.stages,
                   "need_bytes": n.need_bytes, "shm": n.shm, "device": n.device, "capacity_bytes": n.capacity_bytes}
        who = f"{n.serve.label} serve {n.serve.pid} ({n.ranks} ranks)"
        where = place_of.get(n.device or "", f"the /dev/shm its ranks see ({n.shm})")
        if n.capacity_bytes is None:
            out.append(("warn", f"{who}: the size of {where} is unknown ({n.error})", None, details))
            continue
        if n.capacity_bytes >= n.need_bytes:
            out.append(("ok", f"{who}: {where} has {format_size(n.capacity_bytes)}, it needs up to "
                        f"{format_size(n.need_bytes)}", None, details))
            continue
        default = " (Docker's and containerd's default)" if n.capacity_bytes <= DOCKER_DEFAULT else ""
        size = _gib(n.need_bytes)
        out.append(("warn", f"{who}: {where} has {format_size(n.capacity_bytes)}{default}; its shared-memory rings "
                    f"and NCCL's SHM buffers take up to {format_size(n.need_bytes)}: it fails at start or on a "
                    "large message (No space left on device, an NCCL error, a Bus error)",
                    f"give it a {size} /dev/shm: in Kubernetes a volume emptyDir: {{medium: Memory, sizeLimit: "
                    f"{size}}} mounted at /dev/shm; docker or podman run --shm-size={size.removesuffix('i')}",
                    details))
    return out
