"""contrib/kubernetes/: every manifest validates against Kubernetes 1.34, and kvctl accepts its command lines.

kubernetes-validate carries each Kubernetes release's OpenAPI schemas inside the
package (no network); strict mode also rejects fields the schema does not know.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

K8S_VERSION = "1.34.0"
HERE = Path(__file__).parents[2] / "contrib/kubernetes"
MANIFESTS = sorted(HERE.glob("*.yaml"))
KVCTL = os.path.join(os.path.dirname(sys.executable), "kvctl")
USAGE = 2  # kvctl's exit code for a command line it does not accept (README: exit codes)

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra (kubernetes-validate)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the test extra: pip install -e '.[test]'")


def _docs(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc["kind"] == "Pod":
                out.append((doc["metadata"]["name"], doc["spec"]))
            elif doc["kind"] == "DaemonSet":
                out.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
    return out


def _daemonset() -> dict[str, Any]:
    (spec,) = [s for name, s in _pod_specs() if name == "kvctl-gc"]
    return spec


def test_the_manifests_are_there() -> None:
    assert {p.name for p in MANIFESTS} == {"kvctl-gc-daemonset.yaml", "kvctl-inspect-pod.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_every_manifest_validates_against_kubernetes_1_34(path: Path) -> None:
    assert K8S_VERSION.rsplit(".", 1)[0] in {v.split("-")[0].lstrip("v").rsplit(".", 1)[0] for v in os.listdir(
        Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema")}, "no offline schemas for it"
    docs = _docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_an_invalid_manifest_is_caught() -> None:
    """The validator is really checking: a field the schema lacks, and a wrong type, are errors."""
    doc = _docs(HERE / "kvctl-inspect-pod.yaml")[0]
    doc["spec"]["hostPIDs"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    doc = _docs(HERE / "kvctl-inspect-pod.yaml")[0]
    doc["spec"]["hostPID"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_daemonset_sees_the_host_with_least_privilege() -> None:
    spec = _daemonset()
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False and sc["runAsUser"] == 0
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_OVERRIDE"]}
    assert c["resources"]["limits"] and c["resources"]["requests"]
    hosts = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["mountPath"]: hosts[m["name"]] for m in c["volumeMounts"]}
    # The node's own /dev/shm and /tmp, at the paths entries are reported by.
    assert mounts["/dev/shm"] == "/dev/shm" and mounts["/tmp"] == "/tmp"
    assert not any(m.get("readOnly") for m in c["volumeMounts"])
    argv = c["command"]
    metrics_file = argv[argv.index("--prometheus") + 1]
    assert os.path.dirname(metrics_file) in mounts, "the metrics file must be on the textfile hostPath"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["KVCTL_LOCK"] in mounts, "the gc lock must be the host's, shared with cron and systemd runs"


def _commands() -> list[tuple[str, list[str]]]:
    """Every kvctl command line the manifests run or tell an operator to run (kubectl exec ... -- kvctl ...)."""
    out = []
    for name, spec in _pod_specs():
        for c in spec["containers"]:
            if c["command"][0] == "kvctl":
                out.append((name, list(c["command"])))
    for path in MANIFESTS:
        for line in path.read_text().splitlines():
            m = re.match(r"#\s+kubectl exec .* -- (kvctl .*)$", line)
            if m:
                out.append((path.name, m.group(1).split()))
    return out


def test_the_command_lines_are_the_documented_ones() -> None:
    """The flags the kvctl phase implements are exactly these (docs: contrib/kubernetes/README.md)."""
    assert sorted(" ".join(argv) for _, argv in _commands()) == sorted([
        "kvctl gc --yes --engines --every 10m --json --prometheus /var/lib/node_exporter/textfile/kvctl.prom",
        "kvctl inspect",
        "kvctl inspect --pid 41237",
        "kvctl doctor node",
    ])


def _accepted(command: str) -> set[str]:
    r = subprocess.run([KVCTL, command, "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", r.stdout))


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=[" ".join(a) for _, a in _commands()])
def test_kvctl_accepts_each_command_line(where: str, argv: list[str], tmp_path: Path) -> None:
    """Run each command line for real, on an empty private root (gc as a dry run), and expect no usage error."""
    root = tmp_path / "root"
    for sub in ("tmp", "dev/shm"):
        (root / sub).mkdir(parents=True)
    args = list(argv[1:])
    accepted = _accepted(args[0])
    assert {a for a in args if a.startswith("--")} <= accepted, f"{where}: {argv} names options --help does not"
    every = None
    if "--every" in args:  # runs until SIGTERM: stop it after its first run
        every = args.index("--every")
    if "--prometheus" in args:
        args[args.index("--prometheus") + 1] = str(tmp_path / "kvctl.prom")
    if args[0] == "gc":
        args.append("--dry-run")
    cmd = [KVCTL, "--root", str(root), *args]
    env = {**os.environ, "KVCTL_LOCK": str(tmp_path / "gc.lock")}
    if every is None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tempfile.gettempdir())
        assert r.returncode != USAGE, f"{where}: kvctl rejects {argv}: {r.stderr}"
        code, out = r.returncode, r.stdout
    else:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert p.stdout is not None
        out = p.stdout.readline()
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=120)
        assert code != USAGE, f"{where}: kvctl rejects {argv}"
    if "--json" in args:
        doc = json.loads(out.strip().splitlines()[0] if every is not None else out)
        assert doc["schema"] == "kvctl.gc/1"
        assert ("--engines" in args) is ("engines" in doc["summary"])
    if "--prometheus" in args:  # written by the run before it printed its line
        assert "kvctl_gc_engine_entries" in (tmp_path / "kvctl.prom").read_text()
    if args[0] == "gc":
        assert code in (0, 3), (code, out)
