"""doctor and the integrations talk through one document: kvcached.detect/1.

The schema file, the types the integrations build it from, and the strict
reader doctor uses agree: whatever the schema rejects the reader rejects,
naming where. doctor runs the integrations' entry in the serve's interpreter;
here that interpreter is a real executable (a script standing in for
`python`, printing what a broken or foreign kvcached would print), so doctor's
handling of each answer runs through a real child process.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvcached.node.detectdoc import (
    SCHEMA,
    Condition,
    DetectDocument,
    DocumentError,
    EngineSection,
    PatchReport,
    PatchStatus,
    Plugin,
    parse,
)
from kvcached.node.diagnostics import Context, Status, check_vllm, vllm_results

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "kvcached" / "schemas" / "detect.json"


def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def section(**over: Any) -> EngineSection:
    fields: dict[str, Any] = dict(
        version="0.33.0", error=None,
        plugin=Plugin(enabled=False, allowed=True, allow_list_var="VLLM_PLUGINS", allow_list=None),
        patches=(
            PatchReport(name="owner_cleanup", status=PatchStatus.READY, reason="shape found", targets=("x",)),
            PatchReport(name="lmcache_shutdown", status=PatchStatus.NOT_NEEDED, reason="already forwards"),
            PatchReport(name="worker_listener", status=PatchStatus.UNKNOWN_SHAPE, reason="shutdown(timeout)"),
            PatchReport(name="elastic_kv", status=PatchStatus.DISABLED, reason="off (set KVCACHED_ELASTIC=1)",
                        requires=("worker_listener",)),
        ),
        conditions=(
            Condition(name="shutdown_timeout_zero", present=True, detail="default 0"),
            Condition(name="sigterm_reset_before_teardown", present=True, detail=""),
            Condition(name="lmcache_shutdown_not_forwarded", present=None, detail="cannot inspect"),
        ),
        facts={"ray_installed": False},
    )
    fields.update(over)
    return EngineSection(**fields)


def full() -> dict[str, Any]:
    return DetectDocument(engines={"vllm": section()}).to_dict()


def test_the_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(schema())


@pytest.mark.parametrize("doc", [
    full(),
    DetectDocument().to_dict(),  # no engine installed: still a document
    DetectDocument(engines={"vllm": section(), "sglang": section(version=None)}).to_dict(),  # a second engine
    DetectDocument(engines={"vllm": section(version=None, error="vLLM not importable: boom", patches=(),
                                            conditions=())}).to_dict(),
], ids=["full", "no-engine", "two-engines", "engine-error"])
def test_what_the_types_build_is_valid_and_reads_back_the_same(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, schema())
    assert parse(json.loads(json.dumps(doc))).to_dict() == doc


def _set(path: tuple[Any, ...], value: Any):
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _drop(path: tuple[Any, ...]):
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


V = ("engines", "vllm")
MALFORMED = {
    "wrong schema": (_set(("schema",), "kvcached.vllm-detect/1"), "schema"),
    "no engines": (_drop(("engines",)), "document: missing engines"),
    "extra top-level key": (_set(("patches",), {}), "document: unknown key patches"),
    "engines a list": (_set(("engines",), []), "engines: expected an object"),
    "section a string": (_set(V, "0.33.0"), "engines.vllm: expected an object"),
    "no plugin": (_drop((*V, "plugin")), "engines.vllm: missing plugin"),
    "enabled a string": (_set((*V, "plugin", "enabled"), "true"), "engines.vllm.plugin.enabled: expected a boolean"),
    "patches keyed by name": (_set((*V, "patches"), {"owner_cleanup": {}}), "engines.vllm.patches: expected an array"),
    "unknown status": (_set((*V, "patches", 0, "status"), "active"),
                       "engines.vllm.patches[0].status: 'active' is not one of applied, ready"),
    "old patch keys": (_set((*V, "patches", 1), {"name": "x", "applicable": True, "applied": False, "active": False,
                                                  "detail": "", "targets": []}), "engines.vllm.patches[1]: missing"),
    "target not a string": (_set((*V, "patches", 0, "targets"), [1]), "engines.vllm.patches[0].targets[0]"),
    "present a string": (_set((*V, "conditions", 0, "present"), "yes"), "engines.vllm.conditions[0].present"),
    "fact a number": (_set((*V, "facts", "ray_installed"), 1), "engines.vllm.facts.ray_installed"),
    "version a number": (_set((*V, "version"), 0.33), "engines.vllm.version: expected a string"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_reader_rejects_what_the_schema_rejects_and_says_where(case: str) -> None:
    mutate, where = MALFORMED[case]
    doc = copy.deepcopy(full())
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema())
    with pytest.raises(DocumentError) as e:
        parse(doc)
    assert where in str(e.value)


# doctor, through a real child process standing in for the serve's interpreter ------------------------


def interpreter(tmp_path: Path, body: str) -> str:
    """An executable that doctor runs as the serve's `python`: a shell script doing `body`."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def printing(tmp_path: Path, out: str, code: int = 0) -> str:
    (tmp_path / "out").write_text(out)
    return interpreter(tmp_path, f"cat '{tmp_path / 'out'}'; echo 'a line on stderr' >&2; exit {code}")


def doctor(layout, python: str) -> list[Any]:
    return check_vllm(Context(layout, python=python, environ=dict(os.environ), timeout=60))


def test_a_malformed_document_fails_with_where_and_a_fix(layout, tmp_path) -> None:
    doc = full()
    doc["engines"]["vllm"]["patches"][0]["status"] = "active"
    (line,) = doctor(layout, printing(tmp_path, json.dumps(doc)))
    assert line.status is Status.FAIL and line.name == "vllm"
    assert line.summary.startswith("kvcached.integration.detect printed a malformed document: "
                                   "engines.vllm.patches[0].status: 'active' is not one of")
    assert line.fix and "install the same kvcached" in line.fix


def test_no_json_at_all_fails(layout, tmp_path) -> None:
    (line,) = doctor(layout, printing(tmp_path, "INFO vllm says hello\n{}"))
    assert line.status is Status.FAIL and "printed no JSON document" in line.summary


def test_an_entry_that_exits_non_zero_is_a_warning_naming_its_last_line(layout, tmp_path) -> None:
    (line,) = doctor(layout, printing(tmp_path, "", code=1))
    assert line.status is Status.WARN and line.summary.endswith("a line on stderr")


def test_without_vllm_the_real_entry_prints_an_empty_document_and_doctor_skips(layout, tmp_path) -> None:
    """The real `python -m kvcached.integration.detect --json`, in an interpreter where no engine can be found."""
    hide = ("import sys; sys.modules['vllm'] = sys.modules['sglang'] = None; sys.argv = ['detect', '--json']; "
            "from kvcached.integration.detect import main; sys.exit(main())")
    python = interpreter(tmp_path, f'exec "{sys.executable}" -c "{hide}"')
    out = subprocess.run([python, "-m", "kvcached.integration.detect", "--json"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    jsonschema.validate(data, schema())
    assert data == {"schema": SCHEMA, "engines": {}}
    (line,) = doctor(layout, python)
    assert line.status is Status.SKIP and line.summary == "vLLM is not installed here"


def test_a_good_document_becomes_doctor_lines(layout, tmp_path) -> None:
    lines = {r.name: r for r in doctor(layout, printing(tmp_path, json.dumps(full())))}
    assert lines["vllm"].status is Status.WARN and "0.33.0" in lines["vllm"].summary
    assert set(lines) >= {"vllm-patch:owner_cleanup", "vllm:shutdown_timeout_zero"}


# The lines themselves (from the section the integration reports) -------------------------------------


def test_doctor_lines_from_the_vllm_section() -> None:
    lines = {r.name: r for r in vllm_results(section())}
    assert lines["vllm"].status is Status.WARN and "0.33.0" in lines["vllm"].summary
    assert "ENABLE_KVCACHED=true" in (lines["vllm"].fix or "")
    assert lines["vllm-patch:owner_cleanup"].status is Status.WARN  # ready, but kvcached is not enabled
    assert "inactive" in lines["vllm-patch:owner_cleanup"].summary
    assert lines["vllm-patch:lmcache_shutdown"].status is Status.SKIP
    assert "not needed" in lines["vllm-patch:lmcache_shutdown"].summary
    assert lines["vllm-patch:worker_listener"].status is Status.WARN  # an unknown shape is worth a warning
    assert "unknown vLLM shape" in lines["vllm-patch:worker_listener"].summary
    assert lines["vllm-patch:elastic_kv"].status is Status.SKIP and "off" in lines["vllm-patch:elastic_kv"].summary
    assert lines["vllm:shutdown_timeout_zero"].status is Status.WARN
    assert lines["vllm:lmcache_shutdown_not_forwarded"].status is Status.WARN
    on = section(plugin=Plugin(enabled=True, allowed=True, allow_list_var="VLLM_PLUGINS", allow_list=None))
    lines = {r.name: r for r in vllm_results(on)}
    assert lines["vllm"].status is Status.OK and lines["vllm-patch:owner_cleanup"].status is Status.OK
    assert lines["vllm:shutdown_timeout_zero"].status is Status.OK
    assert "work around" in lines["vllm:shutdown_timeout_zero"].summary
    assert vllm_results(section(error="vLLM not importable"))[0].status is Status.WARN


def test_an_allow_list_without_kvcached_names_the_fix() -> None:
    off = section(plugin=Plugin(enabled=True, allowed=False, allow_list_var="VLLM_PLUGINS", allow_list="lora"))
    lines = {r.name: r for r in vllm_results(off)}
    assert lines["vllm"].status is Status.WARN and "VLLM_PLUGINS excludes it" in lines["vllm"].summary
    assert (lines["vllm-plugins"].fix or "").startswith("export VLLM_PLUGINS=lora,kvcached")
