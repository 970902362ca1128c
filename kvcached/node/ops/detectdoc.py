"""The document the engine integrations describe themselves with: `python -m kvcached.integration.detect --json`.

It is the contract between the integrations (layer 2, engine processes) and
`kvctl doctor` (layer 1, which never imports them): the integrations build it
from these types, doctor reads it back with `parse`, which accepts exactly
what `kvcached/schemas/detect.json` describes and names the first thing wrong
otherwise. One section per engine installed, keyed by the engine's name
(`vllm`, `sglang`: the same shape); with no engine installed,
`engines` is empty and the document is still valid.

Everything engine-specific doctor says comes from here, as data: the engine's
display name, the fix that turns kvcached on for it (each engine has its own
switch and allow-list syntax), and its hazards (shapes kvcached does not
cover, with the node processes that show one is running). Those fields came
after the first ones; the reader accepts documents without them (an older
kvcached in the serve's interpreter) and defaults them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..base.enums import StrEnum

SCHEMA = "kvcached.detect/1"


class PatchStatus(StrEnum):
    """What became of one patch in the process that reports it."""

    APPLIED = "applied"  # installed in this process
    READY = "ready"  # the engine has the expected shape: engine processes with kvcached enabled apply it
    NOT_NEEDED = "not_needed"  # the engine already does what the patch would
    UNKNOWN_SHAPE = "unknown_shape"  # the target does not look as the patch expects: it stands aside
    DISABLED = "disabled"  # switched off by configuration (an opt-in patch not asked for)
    NOT_COVERED = "not_covered"  # this engine install lacks what the patch hooks, or a patch it requires


class DocumentError(ValueError):
    """The document does not have the shape of `kvcached.detect/1`; the message names where."""


@dataclass(frozen=True, kw_only=True)
class PatchReport:
    """One patch: its status, why, the callables it hooks (`module:Qual.name`) and the patches it requires."""

    name: str
    status: PatchStatus
    reason: str
    targets: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"name": self.name, "status": str(self.status), "reason": self.reason,
                "targets": list(self.targets), "requires": list(self.requires)}


@dataclass(frozen=True, kw_only=True)
class Condition:
    """A behaviour of the installed engine that leaks state; `present` None: could not tell."""

    name: str
    present: bool | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"name": self.name, "present": self.present, "detail": self.detail}


@dataclass(frozen=True, kw_only=True)
class Plugin:
    """Whether the engine will run kvcached: switched on here, and let through by the engine's allow-list."""

    enabled: bool  # kvcached is switched on in this environment
    allowed: bool  # the engine's plugin allow-list lets kvcached's plugin load
    allow_list_var: str | None = None  # the allow-list's variable (VLLM_PLUGINS), if the engine has one
    allow_list: str | None = None  # its value, when set
    fix: str | None = None  # what makes kvcached active here (None when it is, or from an older kvcached)

    @classmethod
    def of(cls, *, enabled: bool, allowed: bool, allow_list_var: str, allow_list: str | None, listed: Sequence[str],
           label: str, enable: str, name: str = "kvcached") -> Plugin:
        """The report with its fix: `name` added to the allow-list (whose names, as the engine reads them, are
        `listed`) where it is missing, and `enable` (how this engine switches kvcached on) where it is off."""
        fixes = []
        if not allowed:
            fixes.append(f"export {allow_list_var}={','.join([*listed, name])} (or unset {allow_list_var}): "
                         f"{label} loads only the plugins it lists")
        if not enabled:
            fixes.append(enable)
        return cls(enabled=enabled, allowed=allowed, allow_list_var=allow_list_var, allow_list=allow_list,
                   fix="; and ".join(fixes) or None)

    @property
    def active(self) -> bool:
        """Engine processes started with this environment load kvcached."""
        return self.enabled and self.allowed

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; `fix` only when there is one (an active plugin's report keeps its first shape)."""
        out = {"enabled": self.enabled, "allowed": self.allowed, "allow_list_var": self.allow_list_var,
               "allow_list": self.allow_list}
        return out if self.fix is None else {**out, "fix": self.fix}


@dataclass(frozen=True, kw_only=True)
class ProcessMatch:
    """Which processes of the node show a hazard, by command line: doctor matches them against its /proc pass."""

    label: str  # what one such process is called ("Ray-backed vLLM")
    argv0_prefixes: tuple[str, ...] = ()  # a process title starting so (a Ray actor's `ray::Class.method`)
    options: tuple[tuple[str, str], ...] = ()  # an option with this value, as `--opt value` or `--opt=value`

    def matches(self, argv: Sequence[str]) -> bool:
        """`argv` (a command line, argv[0] first) is one of these processes."""
        if argv and argv[0].startswith(self.argv0_prefixes):
            return True
        pairs = set(self.options)
        joined = {f"{o}={v}" for o, v in self.options}
        return any((a, b) in pairs for a, b in zip(argv, argv[1:])) or any(a in joined for a in argv)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"label": self.label, "argv0_prefixes": list(self.argv0_prefixes),
                "options": [list(o) for o in self.options]}


@dataclass(frozen=True, kw_only=True)
class Hazard:
    """A shape of serve kvcached does not cover: here when `present`, or when a node process matches `processes`."""

    name: str
    present: bool  # this environment is one (as the integration sees it: a variable set, the platform)
    summary: str  # what is not covered, and why
    detail: str = ""  # what makes it present; when absent, what is worth knowing ("Ray is installed here")
    fix: str | None = None  # how to serve so that kvcached covers it
    processes: ProcessMatch | None = None
    report_absent: bool = False  # say it (a skip line) even when absent

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"name": self.name, "present": self.present, "summary": self.summary, "detail": self.detail,
                "fix": self.fix, "processes": None if self.processes is None else self.processes.to_dict(),
                "report_absent": self.report_absent}


@dataclass(frozen=True, kw_only=True)
class EngineSection:
    """One installed engine: its version, kvcached's plugin, its patches, its leak conditions, facts of its own."""

    version: str | None
    error: str | None  # why the engine could not be inspected (then no patches or conditions)
    plugin: Plugin
    patches: tuple[PatchReport, ...] = ()
    conditions: tuple[Condition, ...] = ()
    facts: Mapping[str, bool | str | None] = field(default_factory=dict)  # e.g. vllm: ray_installed
    label: str | None = None  # the engine's name for people ("vLLM"); None: its key
    hazards: tuple[Hazard, ...] = ()
    # The engine versions this kvcached was proven on (its integration tests ran there); () when not said.
    proven: tuple[str, ...] = ()

    @property
    def unproven(self) -> bool:
        """The installed version is outside `proven` (whatever the shape checks say); False when not said."""
        return bool(self.proven) and self.version not in self.proven

    def patch_active(self, patch: PatchReport) -> bool:
        """The patch works in engine processes: applied here, or ready where the plugin loads."""
        return patch.status is PatchStatus.APPLIED or (patch.status is PatchStatus.READY and self.plugin.active)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"version": self.version, "error": self.error, "plugin": self.plugin.to_dict(),
                "patches": [p.to_dict() for p in self.patches],
                "conditions": [c.to_dict() for c in self.conditions], "facts": dict(self.facts),
                "label": self.label, "hazards": [h.to_dict() for h in self.hazards], "proven": list(self.proven)}


@dataclass(frozen=True, kw_only=True)
class DetectDocument:
    """What `python -m kvcached.integration.detect --json` prints."""

    engines: Mapping[str, EngineSection] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the schema's name."""
        return {"schema": SCHEMA, "engines": {k: v.to_dict() for k, v in self.engines.items()}}


# Strict reading: exactly the schema, every key known, every type checked. --------------------------------


def parse(data: object) -> DetectDocument:
    """The document in `data` (parsed JSON); raises DocumentError naming the first place it is malformed."""
    doc = _object(data, "document", required=("schema", "engines"), optional=())
    if doc["schema"] != SCHEMA:
        raise DocumentError(f"schema: expected {SCHEMA!r}, got {doc['schema']!r}")
    engines = _object(doc["engines"], "engines", required=(), optional=None)
    return DetectDocument(engines={str(k): _engine(v, f"engines.{k}") for k, v in engines.items()})


def _engine(data: object, where: str) -> EngineSection:
    d = _object(data, where, required=("version", "error", "plugin", "patches", "conditions", "facts"),
                optional=("label", "hazards", "proven"))
    p = _object(d["plugin"], f"{where}.plugin", required=("enabled", "allowed", "allow_list_var", "allow_list"),
                optional=("fix",))
    plugin = Plugin(enabled=_bool(p["enabled"], f"{where}.plugin.enabled"),
                    allowed=_bool(p["allowed"], f"{where}.plugin.allowed"),
                    allow_list_var=_str_or_none(p["allow_list_var"], f"{where}.plugin.allow_list_var"),
                    allow_list=_str_or_none(p["allow_list"], f"{where}.plugin.allow_list"),
                    fix=_str_or_none(p.get("fix"), f"{where}.plugin.fix"))
    facts = _object(d["facts"], f"{where}.facts", required=(), optional=None)
    for k, v in facts.items():
        if v is not None and not isinstance(v, (bool, str)):
            raise DocumentError(f"{where}.facts.{k}: expected a boolean, a string or null, got {_kind(v)}")
    return EngineSection(
        version=_str_or_none(d["version"], f"{where}.version"),
        error=_str_or_none(d["error"], f"{where}.error"),
        plugin=plugin,
        patches=tuple(_patch(v, f"{where}.patches[{i}]")
                      for i, v in enumerate(_list(d["patches"], f"{where}.patches"))),
        conditions=tuple(_condition(v, f"{where}.conditions[{i}]")
                         for i, v in enumerate(_list(d["conditions"], f"{where}.conditions"))),
        facts=dict(facts),
        label=_str_or_none(d.get("label"), f"{where}.label"),
        hazards=tuple(_hazard(v, f"{where}.hazards[{i}]")
                      for i, v in enumerate(_list(d.get("hazards", []), f"{where}.hazards"))),
        proven=tuple(_str(v, f"{where}.proven[{i}]") for i, v in enumerate(_list(d.get("proven", []),
                                                                                f"{where}.proven"))),
    )


def _patch(data: object, where: str) -> PatchReport:
    d = _object(data, where, required=("name", "status", "reason", "targets", "requires"), optional=())
    raw = _str(d["status"], f"{where}.status")
    try:
        status = PatchStatus(raw)
    except ValueError:
        raise DocumentError(f"{where}.status: {raw!r} is not one of {', '.join(map(str, PatchStatus))}") from None
    return PatchReport(name=_str(d["name"], f"{where}.name"), status=status,
                       reason=_str(d["reason"], f"{where}.reason"), targets=_strings(d["targets"], f"{where}.targets"),
                       requires=_strings(d["requires"], f"{where}.requires"))


def _condition(data: object, where: str) -> Condition:
    d = _object(data, where, required=("name", "present", "detail"), optional=())
    present = d["present"]
    if present is not None and not isinstance(present, bool):
        raise DocumentError(f"{where}.present: expected a boolean or null, got {_kind(present)}")
    return Condition(name=_str(d["name"], f"{where}.name"), present=present,
                     detail=_str(d["detail"], f"{where}.detail"))


def _hazard(data: object, where: str) -> Hazard:
    d = _object(data, where, required=("name", "present", "summary", "detail", "fix", "processes", "report_absent"),
                optional=())
    processes = None
    if d["processes"] is not None:
        m = _object(d["processes"], f"{where}.processes", required=("label", "argv0_prefixes", "options"),
                    optional=())
        options = []
        for i, o in enumerate(_list(m["options"], f"{where}.processes.options")):
            pair = _strings(o, f"{where}.processes.options[{i}]")
            if len(pair) != 2:
                raise DocumentError(f"{where}.processes.options[{i}]: expected [option, value], got {len(pair)} items")
            options.append((pair[0], pair[1]))
        processes = ProcessMatch(label=_str(m["label"], f"{where}.processes.label"),
                                 argv0_prefixes=_strings(m["argv0_prefixes"], f"{where}.processes.argv0_prefixes"),
                                 options=tuple(options))
    return Hazard(name=_str(d["name"], f"{where}.name"), present=_bool(d["present"], f"{where}.present"),
                  summary=_str(d["summary"], f"{where}.summary"), detail=_str(d["detail"], f"{where}.detail"),
                  fix=_str_or_none(d["fix"], f"{where}.fix"), processes=processes,
                  report_absent=_bool(d["report_absent"], f"{where}.report_absent"))


def _object(data: object, where: str, *, required: tuple[str, ...], optional: tuple[str, ...] | None
            ) -> Mapping[str, Any]:
    """A JSON object with exactly these keys (`optional` None: any keys, as for maps keyed by name)."""
    if not isinstance(data, Mapping):
        raise DocumentError(f"{where}: expected an object, got {_kind(data)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise DocumentError(f"{where}: missing {', '.join(missing)}")
    if optional is not None:
        extra = sorted(str(k) for k in data if k not in required and k not in optional)
        if extra:
            raise DocumentError(f"{where}: unknown key {', '.join(extra)}")
    return data


def _list(data: object, where: str) -> list[Any]:
    if not isinstance(data, list):
        raise DocumentError(f"{where}: expected an array, got {_kind(data)}")
    return data


def _strings(data: object, where: str) -> tuple[str, ...]:
    return tuple(_str(v, f"{where}[{i}]") for i, v in enumerate(_list(data, where)))


def _str(data: object, where: str) -> str:
    if not isinstance(data, str):
        raise DocumentError(f"{where}: expected a string, got {_kind(data)}")
    return data


def _str_or_none(data: object, where: str) -> str | None:
    return None if data is None else _str(data, where)


def _bool(data: object, where: str) -> bool:
    if not isinstance(data, bool):
        raise DocumentError(f"{where}: expected a boolean, got {_kind(data)}")
    return data


def _kind(data: object) -> str:
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(data), type(data).__name__)
