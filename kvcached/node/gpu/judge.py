"""The orphan rule for GPU holders: a pure function of a process, its parent and their roles.

An engine child (EngineCore, a vLLM worker, an SGLang scheduler, the DP
controller, the detokenizer: processes only an engine's own main or engine
starts) is an orphan when its parent engine process is gone: it was reparented
to a process that never starts such children (init, a subreaper) or to one
that started after it. Its process group alone proves nothing: a serve started
under a shell that lives on keeps its group leader after the API server dies.
A process that is no engine's (a training job, a notebook) is reported and
never killed, whatever its parent.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base.enums import StrEnum
from ..clean.facts import START_SLACK, ProcessInfo
from ..clean.roles import Role, RoleInfo


class HolderState(StrEnum):
    ORPHAN = "orphan"      # an engine child whose engine is gone: gc --engines --kill-orphans terminates it
    SERVING = "serving"    # part of a live serve
    FOREIGN = "foreign"    # not an engine's process: reported, never killed
    UNKNOWN = "unknown"    # the view is incomplete (its parent unreadable): kept


@dataclass(frozen=True)
class Parent:
    """What the rule needs to know about a holder's parent."""

    info: ProcessInfo
    role: RoleInfo
    namespace_init: bool   # PID 1 of its PID namespace (NSpid's last field is 1)


def engine_child(role: RoleInfo) -> bool:
    """A process only an engine's main or engine starts: EngineCore, a worker, any `sglang::` helper."""
    return role.role in (Role.ENGINE, Role.WORKER) or role.title.startswith("sglang::")


def engine_family(role: RoleInfo) -> bool:
    """Any process of a serve: its main (API server), its engine children."""
    return role.role is not Role.OTHER or role.title.startswith("sglang::")


def _who(p: Parent) -> str:
    return f"PID {p.info.pid} ({p.role.title or p.info.comm})"


def judge(child: ProcessInfo, role: RoleInfo, parent: Parent | None, *, view_complete: bool = True
          ) -> tuple[HolderState, str]:
    """The holder's state and why, from its role and its parent's."""
    if not engine_child(role):
        if engine_family(role):
            return HolderState.SERVING, "a serve's main process: never killed"
        return HolderState.FOREIGN, "not an engine process: reported, never killed"
    if parent is None:
        why = "hidden (hidepid)" if not view_complete else "gone or unreadable"
        return HolderState.UNKNOWN, f"its parent PID {child.ppid} is {why}: kept"
    if parent.info.start_time > child.start_time + START_SLACK:
        # A parent cannot start a child before it exists itself: the kernel reparented it.
        return HolderState.ORPHAN, f"its engine is gone; reparented to {_who(parent)}, which started after it"
    if parent.namespace_init and not parent.info.engine_like:
        return HolderState.ORPHAN, f"its engine is gone; reparented to {_who(parent)}, its namespace's init"
    if engine_family(parent.role):
        return HolderState.SERVING, f"its parent {_who(parent)} is alive"
    if parent.info.pgid != child.pgid:
        # A serve's processes start in their starter's group; a parent outside it that is no engine's own
        # is a subreaper (or init) the kernel handed the child to when its engine died.
        return HolderState.ORPHAN, (f"its engine is gone; reparented to {_who(parent)}, outside its serve's "
                                    f"process group {child.pgid}")
    return HolderState.SERVING, f"started by {_who(parent)}, in its process group"
