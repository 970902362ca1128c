"""Which role a process plays in a serve (API server, engine, worker), from its title and command line.

Apart from view.py, which groups processes into deployments: gc asks only
whether any worker or engine runs on the node before it groups anything
(gcrun._orphans), and on a node that runs none it never imports view.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base.enums import StrEnum

if TYPE_CHECKING:
    from .facts import Facts, ProcessInfo


class Role(StrEnum):
    API = "api"
    ENGINE = "engine"
    WORKER = "worker"
    OTHER = "other"


# Process titles (setproctitle rewrites argv[0]; comm keeps its first 15 bytes).
_VLLM_WORKER_RE = re.compile(r"^VLLM::Worker(?:_TP(\d+))?(?:_PP(\d+))?|^VllmWorker(?:[-_ ](\d+))?")
_VLLM_ENGINE_RE = re.compile(r"^VLLM::EngineCor|^EngineCore")
_VLLM_API_RE = re.compile(r"^VLLM::APIServer|^VLLM::API")
# SGLang (docs/SGLANG.md, "Processes"): a scheduler per (PP, TP) rank, titled `sglang::scheduler` plus `_DP<d>`,
# `_PP<k>`, `_ATTN_CP<c>`, `_MOE_DP<m>`, `_TP<r>`, `_EP<e>` (each only when that width is above 1); the
# detokenizer, the DP controller and uvicorn's tokenizer workers titled too; main keeps its command line.
_SGLANG_SCHEDULER_RE = re.compile(r"^sglang::schedul(?:er(?P<parts>(?:_[A-Z_]+?[0-9]+)*))?")
_SGLANG_PART_RE = re.compile(r"_(DP|PP|ATTN_CP|MOE_DP|TP|EP)([0-9]+)")
_SGLANG_HELPERS = (  # title prefix (comm keeps 15 bytes of it), role
    ("sglang::data_parallel_controller", Role.ENGINE),
    ("sglang::detokenizer", Role.API),
    ("sglang::tokenizer_worker", Role.API),
)
_SGLANG_MAIN_RE = re.compile(r"(^|/)sglang\s+serve\b|sglang\.launch_server")
_HARNESS_MODULE = "kvcached.runtime.harness"


@dataclass(frozen=True, kw_only=True)
class RoleInfo:
    role: Role
    title: str
    rank: int | None = None
    stage: int | None = None


def _flag(cmdline: tuple[str, ...], name: str) -> str | None:
    for i, arg in enumerate(cmdline):
        if arg == name and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def classify_process(p: ProcessInfo) -> RoleInfo:
    """API server, engine or worker, from the process title and command line; OTHER when unsure."""
    argv0 = p.cmdline[0] if p.cmdline else ""
    title = argv0 if argv0.startswith(("VLLM::", "VllmWorker", "sglang::", "EngineCore")) else p.comm
    if _HARNESS_MODULE in p.cmdline:
        role = _flag(p.cmdline, "--role")
        if role in ("api", "engine", "worker"):
            rank, stage = (_int(_flag(p.cmdline, "--rank")), _int(_flag(p.cmdline, "--stage"))) \
                if role == "worker" else (None, None)
            return RoleInfo(role=Role(role), title=f"harness {role}", rank=rank, stage=stage)
    for text in (argv0, p.comm):
        if m := _VLLM_WORKER_RE.match(text):
            rank = _int(m.group(1) or m.group(3))
            return RoleInfo(role=Role.WORKER, title=text, rank=rank, stage=_int(m.group(2)))
        if _VLLM_ENGINE_RE.match(text):
            return RoleInfo(role=Role.ENGINE, title=text)
        if _VLLM_API_RE.match(text):
            return RoleInfo(role=Role.API, title=text)
        if (sgl := _sglang_role(text)) is not None:
            return sgl
    joined = " ".join(p.cmdline[:4])
    if re.search(r"(^|/)vllm\s+serve\b|vllm\.entrypoints", joined):
        return RoleInfo(role=Role.API, title="vllm serve")
    if _SGLANG_MAIN_RE.search(joined):
        return RoleInfo(role=Role.API, title="sglang server")
    return RoleInfo(role=Role.OTHER, title=title or (os.path.basename(argv0) if argv0 else ""))


def _sglang_role(text: str) -> RoleInfo | None:
    """An SGLang process by its title: a scheduler is a worker (its TP rank and PP stage from the title)."""
    if m := _SGLANG_SCHEDULER_RE.match(text):
        if m.group("parts") is None:  # only comm's 15 bytes: the ranks are cut off
            return RoleInfo(role=Role.WORKER, title=text)
        parts = dict(_SGLANG_PART_RE.findall(m.group("parts")))
        return RoleInfo(role=Role.WORKER, title=text, rank=int(parts.get("TP", 0)), stage=int(parts.get("PP", 0)))
    for prefix, role in _SGLANG_HELPERS:
        if text.startswith(prefix) or (len(text) == 15 and prefix.startswith(text)):
            return RoleInfo(role=role, title=text)
    return None


def tie_sglang_mains(roles: dict[int, RoleInfo], facts: Facts) -> None:
    """SGLang's main keeps its command line (a script's, `sglang serve`'s): it is the parent of its SGLang
    processes (schedulers, detokenizer, DP controller), in their process group. Marks it as the serve's API."""
    for pid, role in list(roles.items()):
        if not role.title.startswith("sglang::"):
            continue
        child = facts.processes.get(pid)
        parent = None if child is None else facts.processes.get(child.ppid)
        if child is None or parent is None or parent.pgid != child.pgid or roles[parent.pid].role is not Role.OTHER:
            continue
        roles[parent.pid] = RoleInfo(role=Role.API, title="sglang main")
