"""`kvctl doctor engine` on a node with SGLang 0.5.23: the `sglang` check, read from the installed code.

doctor runs `python -m kvcached.integration.detect --json` in this venv's
interpreter, which imports the installed SGLang (and vLLM); each case is the
real kvctl in a child process, with the environment a serve would have.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping

import pytest

from kvcached.integration.sglang.patches import REGISTRY
from tests.conftest import KVCTL

pytestmark = pytest.mark.sglang

HAZARDS = ("scheduler-sigterm-default", "kill-tree-kills-main", "offline-shutdown-sigkills")


def _doctors(layout, envs: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, dict]]:
    """`kvctl doctor engine --json` once per environment, all at once (each imports SGLang): checks by name."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_") and k != "SGLANG_PLUGINS"}
    runs = {key: subprocess.Popen([KVCTL, "--root", layout.root, "doctor", "engine", "--json"], text=True,
                                  env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for key, env in envs.items()}
    out = {}
    for key, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=400)
        assert proc.returncode == 0, (key, stderr[-3000:])
        out[key] = {c["name"]: c for c in json.loads(stdout)["checks"]}
    return out


def test_doctor_says_the_plugin_is_active_which_hooks_apply_and_the_stop_hazards(layout) -> None:
    """Enabled and allowed: `sglang` ok, every patch active; SGLANG_PLUGINS without kvcached: why not, the fix."""
    runs = _doctors(layout, {"on": {"KVCACHED_ENABLE": "1"},
                             "excluded": {"KVCACHED_ENABLE": "1", "SGLANG_PLUGINS": "lora, other"},
                             "rust": {"KVCACHED_ENABLE": "1", "SGLANG_RUST_SERVER": "1"}})
    on, excluded, rust = runs["on"], runs["excluded"], runs["rust"]

    check = on["sglang"]
    assert (check["group"], check["status"]) == ("engine", "ok"), check
    assert check["summary"] == "SGLang 0.5.23 installed; kvcached integration enabled"
    detect = check["details"]["detect"]
    assert detect["plugin"] == {"enabled": True, "allowed": True, "allow_list_var": "SGLANG_PLUGINS",
                                "allow_list": None}
    assert [p["name"] for p in detect["patches"]] == [p.name for p in REGISTRY.patches]
    for patch in REGISTRY.patches:  # each hook recognised in the installed SGLang, and active
        line = on[f"sglang-patch:{patch.name}"]
        if patch.name == "sglang-elastic-kv":  # its own switch, off here: it says so and how to turn it on
            assert line["status"] == "skip" and "set KVCACHED_ELASTIC=1" in line["summary"], line
            continue
        assert line["status"] == "ok" and line["summary"].startswith(f"kvcached patch {patch.name}: active"), line
    for name in HAZARDS:  # present in 0.5.23's code, and worked around
        line = on[f"sglang:{name}"]
        assert line["status"] == "ok" and ": present (" in line["summary"], line
        assert line["summary"].endswith("kvcached's patches work around it")
    assert "SIGKILLs the children, then main itself" in on["sglang:kill-tree-kills-main"]["summary"]
    assert detect["facts"]["kill_tree_waits"] is True and detect["facts"]["scheduler_exit_timeout_s"] == "15"
    assert on["sglang-shapes"]["status"] == "skip" and "Ray (--use-ray)" in on["sglang-shapes"]["summary"]
    assert "sglang-plugins" not in on
    assert not [c for c in on.values() if c["name"].startswith("sglang") and c["fix"]]  # active: nothing to fix
    # The shapes hazard is SGLang's integration's, read from its section: SGLANG_RUST_SERVER set makes it a warning.
    shapes = rust["sglang-shapes"]
    assert shapes["status"] == "warn" and shapes["under"] == "sglang", shapes
    assert shapes["summary"].startswith("SGLANG_RUST_SERVER is set in this environment: kvcached stands aside")
    assert shapes["fix"].startswith("serve without them") and "kvctl --root" in shapes["fix"]

    check = excluded["sglang"]
    assert check["status"] == "warn"
    assert check["summary"] == "SGLang 0.5.23 installed; kvcached integration enabled, but inactive: " \
                               "SGLANG_PLUGINS excludes it"
    assert excluded["sglang-plugins"]["status"] == "warn"
    assert "SGLANG_PLUGINS='lora, other' does not list kvcached" in excluded["sglang-plugins"]["summary"]
    assert excluded["sglang-plugins"]["fix"].startswith("export SGLANG_PLUGINS=lora,other,kvcached")
    said = [c["name"] for c in excluded.values() if "SGLANG_PLUGINS=lora,other,kvcached" in (c["fix"] or "")]
    assert said == ["sglang-plugins"]  # once for the engine, not once per patch
    for patch in REGISTRY.patches:  # ready, but SGLang never loads us (elastic: off by its own switch first)
        want = "skip" if patch.name == "sglang-elastic-kv" else "warn"
        assert excluded[f"sglang-patch:{patch.name}"]["status"] == want
        assert excluded[f"sglang-patch:{patch.name}"]["under"] == "sglang"
    for name in HAZARDS:
        assert excluded[f"sglang:{name}"]["status"] == "warn"
        assert "fix: " not in excluded[f"sglang:{name}"]["summary"]
        assert "kvctl --root" in excluded[f"sglang:{name}"]["fix"]
