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

from kvcached.integration.vllm.detect import LABEL, RAY_PROCESSES, plugin, ray_hazard
from kvcached.node.ops.detectdoc import (
    SCHEMA,
    Condition,
    DetectDocument,
    DocumentError,
    EngineSection,
    PatchReport,
    PatchStatus,
    parse,
)
from kvcached.node.ops.diagnostics import Context, Status, check_engines, engine_results

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "kvcached" / "schemas" / "detect.json"


def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def section(**over: Any) -> EngineSection:
    fields: dict[str, Any] = dict(
        version="0.33.0", error=None, label=LABEL,
        plugin=plugin({}),  # as the vLLM integration reports it where kvcached is not switched on
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
        facts={"ray_installed": True},
        hazards=(ray_hazard(True),),
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
    "label a number": (_set((*V, "label"), 1), "engines.vllm.label: expected a string"),
    "plugin fix a list": (_set((*V, "plugin", "fix"), ["export X=1"]), "engines.vllm.plugin.fix: expected a string"),
    "hazards an object": (_set((*V, "hazards"), {"ray": {}}), "engines.vllm.hazards: expected an array"),
    "hazard without summary": (_drop((*V, "hazards", 0, "summary")), "engines.vllm.hazards[0]: missing summary"),
    "hazard present null": (_set((*V, "hazards", 0, "present"), None), "engines.vllm.hazards[0].present"),
    "unknown hazard key": (_set((*V, "hazards", 0, "severity"), "warn"), "engines.vllm.hazards[0]: unknown key"),
    "option not a pair": (_set((*V, "hazards", 0, "processes", "options", 0), ["--ray"]),
                          "engines.vllm.hazards[0].processes.options[0]: expected [option, value]"),
    "prefix not a string": (_set((*V, "hazards", 0, "processes", "argv0_prefixes"), [None]),
                            "engines.vllm.hazards[0].processes.argv0_prefixes[0]"),
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
    return check_engines(Context(layout, python=python, environ=dict(os.environ), timeout=60))


def test_a_malformed_document_fails_with_where_and_a_fix(layout, tmp_path) -> None:
    doc = full()
    doc["engines"]["vllm"]["patches"][0]["status"] = "active"
    (line,) = doctor(layout, printing(tmp_path, json.dumps(doc)))
    assert line.status is Status.FAIL and line.name == "engines"  # the entry failed, not an engine: one line
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
    (line,) = doctor(layout, python)  # no section, so no engine name: doctor knows engines from the document only
    assert line.status is Status.SKIP and line.summary == "no engine kvcached integrates with is installed here"


def test_a_good_document_becomes_doctor_lines(layout, tmp_path) -> None:
    lines = {r.name: r for r in doctor(layout, printing(tmp_path, json.dumps(full())))}
    assert lines["vllm"].status is Status.WARN and "0.33.0" in lines["vllm"].summary
    assert set(lines) >= {"vllm-patch:owner_cleanup", "vllm:shutdown_timeout_zero"}


# The lines themselves (from the section the integration reports) -------------------------------------


def test_doctor_lines_from_the_vllm_section() -> None:
    lines = {r.name: r for r in engine_results("vllm", section())}
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
    on = section(plugin=plugin({"ENABLE_KVCACHED": "true"}))
    lines = {r.name: r for r in engine_results("vllm", on)}
    assert lines["vllm"].status is Status.OK and lines["vllm-patch:owner_cleanup"].status is Status.OK
    assert lines["vllm:shutdown_timeout_zero"].status is Status.OK
    assert "work around" in lines["vllm:shutdown_timeout_zero"].summary
    assert engine_results("vllm", section(error="vLLM not importable"))[0].status is Status.WARN


def test_an_allow_list_without_kvcached_names_the_fix() -> None:
    off = section(plugin=plugin({"ENABLE_KVCACHED": "true", "VLLM_PLUGINS": "lora"}))
    lines = {r.name: r for r in engine_results("vllm", off)}
    assert lines["vllm"].status is Status.WARN and "VLLM_PLUGINS excludes it" in lines["vllm"].summary
    assert (lines["vllm-plugins"].fix or "").startswith("export VLLM_PLUGINS=lora,kvcached")


def test_a_document_without_the_later_fields_still_reads(layout, tmp_path) -> None:
    """label, plugin.fix, hazards and proven came later: an older kvcached's document is valid, and doctor judges it."""
    doc = full()
    eng = doc["engines"]["vllm"]
    del eng["label"], eng["hazards"], eng["plugin"]["fix"], eng["proven"]
    jsonschema.validate(doc, schema())
    read = parse(doc).engines["vllm"]
    assert (read.label, read.hazards, read.plugin.fix, read.proven) == (None, (), None, ())
    lines = {r.name: r for r in doctor(layout, printing(tmp_path, json.dumps(doc)))}
    assert lines["vllm"].status is Status.WARN and lines["vllm"].summary.startswith("vllm 0.33.0 installed")
    assert lines["vllm"].fix  # a generic one: the document does not say how this engine is switched on
    assert "vllm-ray" not in lines and "vllm-proven" not in lines


def test_a_version_outside_the_proven_range_is_unproven_whatever_the_shapes_say() -> None:
    """Every patch ready and active: still, a version kvcached was not proven on is named as such, with a fix."""
    ready = tuple(PatchReport(name=n, status=PatchStatus.READY, reason="shape found")
                  for n in ("owner_cleanup", "elastic_kv"))
    on = dict(plugin=plugin({"ENABLE_KVCACHED": "true"}), patches=ready, proven=("0.33.0", "0.34.0"))
    lines = {r.name: r for r in engine_results("vllm", section(version="0.34.0", **on))}
    assert lines["vllm-proven"].status is Status.OK and lines["vllm-proven"].under == "vllm"
    assert lines["vllm-proven"].summary == "vLLM 0.34.0 is proven: this kvcached was proven on vLLM 0.33.0, 0.34.0"
    lines = {r.name: r for r in engine_results("vllm", section(version="0.35.0", **on))}
    assert all(lines[f"vllm-patch:{p.name}"].status is Status.OK for p in ready)
    assert lines["vllm-proven"].status is Status.WARN
    assert lines["vllm-proven"].summary.startswith("vLLM 0.35.0 is unproven: this kvcached was proven on vLLM "
                                                   "0.33.0, 0.34.0 only")
    assert lines["vllm-proven"].fix == "install one of vLLM 0.33.0, 0.34.0, or a kvcached proven on vLLM 0.35.0"
    unread = {r.name: r for r in engine_results("vllm", section(version=None, **on))}
    assert unread["vllm-proven"].status is Status.WARN  # a version that cannot be read is not a proven one


def test_the_proven_range_is_what_the_install_script_installs_and_what_is_installed() -> None:
    """One list: the integration's PROVEN_VERSIONS, install-vllm.sh's VERSIONS; the installed vLLM is in it."""
    import vllm

    from kvcached.integration.vllm.common import PROVEN_VERSIONS
    from kvcached.integration.vllm.detect import section as vllm_section

    from ..sglang.cpu_env import VLLM_SCRIPT, shell_array

    assert tuple(shell_array(VLLM_SCRIPT, "VERSIONS")) == PROVEN_VERSIONS
    assert vllm.__version__ in PROVEN_VERSIONS
    eng = vllm_section()
    assert eng.proven == PROVEN_VERSIONS and not eng.unproven


def _fixes(lines: list[Any], text: str) -> list[str]:
    return [r.name for r in lines if text in (r.fix or "")]


def test_what_makes_kvcached_active_is_said_once_for_the_engine() -> None:
    """Not enabled: the engine's line has the fix; its inactive patches are listed under it, with none of their own."""
    lines = engine_results("vllm", section(), kvctl="kvctl --root /r")
    by = {r.name: r for r in lines}
    assert _fixes(lines, "ENABLE_KVCACHED=true") == ["vllm"]
    assert lines[0].name == "vllm" and lines[0].under is None
    assert all(r.under == "vllm" for r in lines[1:])
    inactive = by["vllm-patch:owner_cleanup"]
    assert inactive.status is Status.WARN and inactive.fix is None
    for name in ("vllm:shutdown_timeout_zero", "vllm:lmcache_shutdown_not_forwarded"):  # still say what to do
        assert by[name].status is Status.WARN and (by[name].fix or "").endswith("kvctl --root /r gc --yes")
    assert "kvcached release" in (by["vllm-patch:worker_listener"].fix or "")  # a different fix: its own

    # Excluded by VLLM_PLUGINS (and not switched on): said once, on the line that says why.
    lines = engine_results("vllm", section(plugin=plugin({"VLLM_PLUGINS": "lora"})))
    assert _fixes(lines, "VLLM_PLUGINS=lora,kvcached") == ["vllm-plugins"]
    assert _fixes(lines, "ENABLE_KVCACHED=true") == ["vllm-plugins"]  # both switches, in one fix
    assert {r.name: r for r in lines}["vllm"].fix is None

    # Active: nothing to fix anywhere.
    lines = engine_results("vllm", section(plugin=plugin({"ENABLE_KVCACHED": "1"})))
    assert _fixes(lines, "export ") == []


def test_an_engine_section_that_could_not_be_read_keeps_its_hazards() -> None:
    lines = engine_results("vllm", section(error="vLLM not importable: boom", patches=(), conditions=()))
    assert [r.name for r in lines] == ["vllm", "vllm-ray"]
    assert lines[0].summary == "could not inspect the installed vLLM: vLLM not importable: boom"


def test_sglangs_shapes_are_reported_by_its_section_and_rendered_by_doctor() -> None:
    """The shapes SGLang's integration stands aside from: present by the facts it reads, a note otherwise."""
    from kvcached.integration.sglang import detect as sg

    def shapes(facts: dict[str, Any]) -> Any:
        eng = EngineSection(version="0.5.23", error=None, plugin=sg.plugin({"KVCACHED_ENABLE": "1"}), label=sg.LABEL,
                            facts=facts, hazards=(sg.shapes_hazard(facts),))
        doc = parse(json.loads(json.dumps(DetectDocument(engines={"sglang": eng}).to_dict())))
        (line,) = [r for r in engine_results("sglang", doc.engines["sglang"], kvctl="kvctl --root /r")
                   if r.name == "sglang-shapes"]
        assert line.under == "sglang"
        return line

    rust = shapes({sg.RUST_SERVER: True, sg.PLATFORM: "cuda", sg.PLATFORM_COVERED: True})
    assert rust.status is Status.WARN and rust.summary.startswith("SGLANG_RUST_SERVER is set in this environment: ")
    assert (rust.fix or "").startswith("serve without them") and rust.fix.endswith("kvctl --root /r gc --yes")
    npu = shapes({sg.RUST_SERVER: False, sg.PLATFORM: "npu", sg.PLATFORM_COVERED: False, sg.RAY_INSTALLED: True})
    assert npu.status is Status.WARN and npu.summary.startswith("SGLang's platform here is 'npu': ")
    quiet = shapes({sg.RUST_SERVER: False, sg.PLATFORM: "unknown", sg.PLATFORM_COVERED: None, sg.RAY_INSTALLED: True})
    assert quiet.status is Status.SKIP and "Ray (--use-ray)" in quiet.summary
    assert quiet.summary.endswith("; Ray is installed here")


def test_a_ray_backed_serve_on_the_node_is_named_by_doctor(layout, tmp_path) -> None:
    """A real process with a Ray-backed vLLM command line, found by doctor's /proc pass from the document's matcher."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--distributed-executor-backend",
                              "ray"], stdin=subprocess.DEVNULL)
    try:
        assert RAY_PROCESSES.matches([sys.executable, "-c", "x", "--distributed-executor-backend", "ray"])
        doc = DetectDocument(engines={"vllm": section(hazards=(ray_hazard(False),))}).to_dict()
        lines = {r.name: r for r in doctor(layout, printing(tmp_path, json.dumps(doc)))}
    finally:
        child.kill()
        child.wait()
    ray = lines["vllm-ray"]
    assert ray.status is Status.WARN and ray.under == "vllm"
    assert child.pid in ray.details["pids"] and f"PID {child.pid}" in ray.summary
    assert "Ray-backed vLLM process(es) here" in ray.summary and "not covered" in ray.summary
