"""The node layer's public enums, in one cheap module (the enum module only: no psutil, no other node module).

kvctl compares states, actions, kinds and outcomes as members (`e.action is
Action.KEPT`), never through their strings; importing them from here costs it
no scan, /proc pass or decision code. Their old homes (`decide.State`,
`cleanup.Action`, `scan.Kind`, `gcrun.Outcome`, `orphans.Outcome`,
`leftovers.families.EngineKind` and `Engine`) import them from here, so both
spellings name the same members.
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """An Enum whose members are their string values (in JSON, f-strings and comparisons).

    Python 3.10 has no enum.StrEnum.
    """

    def __str__(self) -> str:
        return self.value


class State(StrEnum):
    """What the decision made of an entry; only `stale` is ever removed."""

    LIVE = "live"
    STALE = "stale"
    UNKNOWN = "unknown"
    YOUNG = "young"
    FOREIGN = "foreign"


class Action(StrEnum):
    """What a run did with an entry."""

    REMOVED = "removed"
    WOULD_REMOVE = "would_remove"
    KEPT = "kept"
    FAILED = "failed"


class Kind(StrEnum):
    """What an entry is."""

    SEGMENT = "segment"
    SOCKET = "socket"
    DIRECTORY = "directory"


class EngineKind(StrEnum):
    """What an engine leftover is (kvcached.node.clean.leftovers): the `kind` of its entries, a value of `gc --kind`."""

    VLLM_SHM = "vllm-shm"      # vLLM's /dev/shm buffers (psm_*, vllm_mm_*, offload and encoder cache regions)
    VLLM_IPC = "vllm-ipc"      # vLLM's ZMQ IPC sockets (/tmp/<uuid4>, VLLM_RPC_BASE_PATH)
    SGLANG_SHM = "sglang-shm"  # sgl_shm_*, multi_tokenizer_args_*, sglang_loads_*
    SGLANG_IPC = "sglang-ipc"  # SGLang's ZMQ IPC sockets (/tmp/tmp<8 of tempfile's characters>)
    NCCL_SHM = "nccl-shm"      # nccl-*
    CUDA_SHM = "cuda-shm"      # cuda.shm.*
    TORCH_SHM = "torch-shm"    # torch_<pid>_<rand>_<n>: torch.multiprocessing's file_system sharing strategy
    PYTHON_SEM = "python-sem"  # sem.mp-*, sem.loky-*: multiprocessing's and loky's named POSIX semaphores


class Engine(StrEnum):
    """Whose leftover an engine entry is (its `engine` field, the `engine` label of its metrics)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    NCCL = "nccl"
    CUDA = "cuda"
    TORCH = "torch"
    PYTHON = "python"


# Each engine leftover's kind to its engine (every family of a kind is one engine's: clean/leftovers/families.py).
ENGINE_OF: dict[Kind | EngineKind, Engine] = {
    EngineKind.VLLM_SHM: Engine.VLLM, EngineKind.VLLM_IPC: Engine.VLLM, EngineKind.SGLANG_SHM: Engine.SGLANG,
    EngineKind.SGLANG_IPC: Engine.SGLANG, EngineKind.NCCL_SHM: Engine.NCCL, EngineKind.CUDA_SHM: Engine.CUDA,
    EngineKind.TORCH_SHM: Engine.TORCH, EngineKind.PYTHON_SEM: Engine.PYTHON,
}


class Outcome(StrEnum):
    """How a gc or delete run ended; kvctl maps each to one exit code."""

    CLEAN = "clean"                      # nothing stale remains
    STALE_REMAIN = "stale_remain"        # dry run, not confirmed, time limit, or a directory kept for its segment
    PARTIAL_FAILURE = "partial_failure"  # a removal or a kill failed; the rest was done


class KillOutcome(StrEnum):
    """What terminating one orphaned process came to."""

    TERMINATED = "terminated"   # exited after SIGTERM
    KILLED = "killed"           # needed SIGKILL
    GONE = "gone"               # already exited
    REPLACED = "replaced"       # the PID now names another process: left alone
    FAILED = "failed"


class Category(StrEnum):
    """What kind of failure a domain error is (errors.py); kvctl maps each to one exit code."""

    FAILED = "failed"          # an operation failed: I/O, an unexpected state of the node
    BAD_INPUT = "bad_input"    # a value or name the rules reject: a size, a duration, an IPC name, a path
    NOT_FOUND = "not_found"    # the named segment, deployment or process does not exist
    REFUSED = "refused"        # the target is live, not ours, or not a kvcached segment: nothing done
    BUSY = "busy"              # another run holds what this one needs (the node's gc lock)
