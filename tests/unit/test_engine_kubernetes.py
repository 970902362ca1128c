"""contrib/kubernetes/: every manifest validates offline, its parts fit together, and kvctl accepts its command lines.

kubernetes-validate carries each Kubernetes release's OpenAPI schemas inside the
package (no network); strict mode also rejects fields the schema does not know.
The Prometheus Operator's kinds (ServiceMonitor, PrometheusRule) are custom
resources it has no schema for: their metadata is checked as Kubernetes'
ObjectMeta, their spec against the monitoring.coreos.com/v1 fields we use
(unknown fields rejected), and what they select and name against the other
manifests and against the metrics a real gc run writes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvcached.node.base.units import parse_duration

K8S_VERSION = "1.34.0"
HERE = Path(__file__).parents[2] / "contrib/kubernetes"
MANIFESTS = sorted(HERE.glob("*.yaml"))
KVCTL = os.path.join(os.path.dirname(sys.executable), "kvctl")
USAGE = 2  # kvctl's exit code for a command line it does not accept (README: exit codes)
UNHEALTHY = 8  # gc --check-heartbeat: the heartbeat is too old or absent
MONITORING = "monitoring.coreos.com/v1"

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra (kubernetes-validate)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the test extra: pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")


def _docs(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _all_docs() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in _docs(p)]


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _all_docs() if d["kind"] == kind]
    return doc


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for doc in _all_docs():
        if doc["kind"] == "Pod":
            out.append((doc["metadata"]["name"], doc["spec"]))
        elif doc["kind"] == "DaemonSet":
            out.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
    return out


def _spec(name: str) -> dict[str, Any]:
    (spec,) = [s for n, s in _pod_specs() if n == name]
    return spec


def _daemonset() -> dict[str, Any]:
    return _spec("kvctl-gc")


def test_the_manifests_are_there() -> None:
    assert {p.name for p in MANIFESTS} == {
        "kvctl-gc-daemonset.yaml", "kvctl-inspect-pod.yaml", "kvctl-gc-service.yaml",
        "kvctl-gc-servicemonitor.yaml", "kvctl-gc-prometheusrule.yaml"}


def _core(doc: dict[str, Any]) -> bool:
    return doc["apiVersion"] != MONITORING


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_every_manifest_validates_against_kubernetes_1_34(path: Path) -> None:
    assert K8S_VERSION.rsplit(".", 1)[0] in {v.split("-")[0].lstrip("v").rsplit(".", 1)[0] for v in os.listdir(
        Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema")}, "no offline schemas for it"
    docs = _docs(path)
    assert docs
    for doc in docs:
        if _core(doc):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        else:
            _validate_monitoring(doc)


@pytest.mark.parametrize("name", ["kvctl-gc", "kvctl-inspect"])
def test_apparmor_profile_needs_kubernetes_1_30_as_the_readme_says(name: str) -> None:
    """The minimum version the README states is the schemas': 1.29's rejects the field, 1.30's takes it."""
    (doc,) = [d for d in _all_docs() if d["kind"] in ("Pod", "DaemonSet") and d["metadata"]["name"] == name]
    with pytest.raises(kubernetes_validate.ValidationError, match="appArmorProfile"):
        kubernetes_validate.validate(doc, "1.29.0", strict=True)
    kubernetes_validate.validate(doc, "1.30.0", strict=True)
    readme = " ".join((HERE / "README.md").read_text().split())
    assert "The field needs **Kubernetes 1.30** or later" in readme
    assert "container.apparmor.security.beta.kubernetes.io/kvctl: unconfined" in readme


def test_the_agent_is_ready_once_its_endpoint_serves_a_run() -> None:
    """readiness: /metrics on the agent's own port, which answers 503 until the first run has finished."""
    (c,) = _daemonset()["containers"]
    probe = c["readinessProbe"]["httpGet"]
    (port,) = c["ports"]
    assert probe == {"path": "/metrics", "port": port["name"]}
    assert port["containerPort"] == int(_flag(c["command"], "--metrics-port"))


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


# The monitoring.coreos.com/v1 fields these manifests use, as the Prometheus Operator's API reference defines
# them (ServiceMonitorSpec, Endpoint, RelabelConfig, PrometheusRuleSpec, RuleGroup, Rule); anything else is an
# error, so a misspelt field cannot pass as an unknown one.
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}
_RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string"}}, "targetLabel": {"type": "string"},
    "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
    "regex": {"type": "string"}, "replacement": {"type": "string"}}}
_CRD_SPECS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                       "properties": {
        "selector": {"type": "object", "additionalProperties": False, "properties": {"matchLabels": _STRINGS}},
        "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
            "matchNames": {"type": "array", "items": {"type": "string"}}, "any": {"type": "boolean"}}},
        "jobLabel": {"type": "string"},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "properties": {
                "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                "relabelings": {"type": "array", "items": _RELABEL}}}}}},
    "PrometheusRule": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
        "groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "rules"], "properties": {
                "name": {"type": "string"}, "interval": _DURATION,
                "rules": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["expr"], "properties": {
                        "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                        "record": {"type": "string"}, "expr": {"type": "string", "minLength": 1},
                        "for": _DURATION, "keep_firing_for": _DURATION,
                        "labels": _STRINGS, "annotations": _STRINGS}}}}}}}},
}


def _validate_monitoring(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == MONITORING and doc["kind"] in _CRD_SPECS, (doc["apiVersion"], doc["kind"])
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    # Their metadata is Kubernetes' ObjectMeta: checked by the real schema, on an object that has nothing else.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                 K8S_VERSION, strict=True)
    jsonschema.validate(doc["spec"], _CRD_SPECS[doc["kind"]])


def test_an_invalid_monitoring_manifest_is_caught() -> None:
    doc = _one("ServiceMonitor")
    doc["spec"]["endpoints"][0]["intervall"] = "60s"
    with pytest.raises(jsonschema.ValidationError):
        _validate_monitoring(doc)
    doc = _one("PrometheusRule")
    doc["spec"]["groups"][0]["rules"][0]["for"] = "half an hour"
    with pytest.raises(jsonschema.ValidationError):
        _validate_monitoring(doc)
    doc = _one("ServiceMonitor")
    doc["metadata"]["labels"] = {"app": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_monitoring(doc)


def _hosts(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in spec["volumes"]}


def _mounts(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (c,) = spec["containers"]
    return {m["mountPath"]: m for m in c["volumeMounts"]}


# Where the runtimes mount a sandbox's /dev/shm, and the kubelet its pods' volumes (the DaemonSet's comments
# say where each comes from).
PLACES = ["/var/lib/kubelet/pods", "/run/containerd/io.containerd.grpc.v1.cri/sandboxes",
          "/run/containers/storage/overlay-containers", "/var/lib/docker/containers"]


def test_the_daemonset_sees_the_host_with_least_privilege() -> None:
    spec = _daemonset()
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False and sc["runAsUser"] == 0
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_OVERRIDE"]}
    # containerd's default profile denies the ptrace reads that SYS_PTRACE is there for.
    assert sc["appArmorProfile"] == {"type": "Unconfined"}
    hosts = _hosts(spec)
    mounts = {path: hosts[m["name"]] for path, m in _mounts(spec).items()}
    # The node's own /dev/shm and /tmp, at the paths entries are reported by.
    assert mounts["/dev/shm"]["hostPath"]["path"] == "/dev/shm" and mounts["/tmp"]["hostPath"]["path"] == "/tmp"
    assert not any(m.get("readOnly") for m in c["volumeMounts"])
    argv = c["command"]
    metrics_file = argv[argv.index("--prometheus") + 1]
    assert os.path.dirname(metrics_file) in mounts, "the metrics file must be on the textfile hostPath"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["KVCTL_LOCK"] in mounts, "the gc lock must be the host's, shared with cron and systemd runs"


def test_the_daemonset_is_the_last_pod_a_node_loses() -> None:
    """system-node-critical, Guaranteed QoS, and no taint keeps it out or evicts it."""
    spec = _daemonset()
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    # The GPU node selector is a documented option, not a default that could leave a cluster with no pod.
    assert "nodeSelector" not in spec and "affinity" not in spec
    assert "nodeSelector" in (HERE / "README.md").read_text()
    for c in spec["containers"]:
        res = c["resources"]
        assert res["requests"] == res["limits"] and set(res["limits"]) == {"cpu", "memory"}, "Guaranteed QoS"


@pytest.mark.parametrize("name", ["kvctl-gc", "kvctl-inspect"])
def test_the_pods_volumes_and_sandboxes_are_mounted_where_the_host_has_them(name: str) -> None:
    spec = _spec(name)
    hosts, mounts = _hosts(spec), _mounts(spec)
    for path in PLACES:
        m = mounts[path]
        assert hosts[m["name"]]["hostPath"]["path"] == path
        # tmpfs mounts made and unmounted on the host after the pod started must appear and go inside it.
        assert m["mountPropagation"] == "HostToContainer"
        assert m.get("readOnly", False) is (name == "kvctl-inspect"), "the cleaner removes, the inspect pod reads"
    assert hosts[mounts["/var/lib/kubelet/pods"]["name"]]["hostPath"]["type"] == "Directory"
    for path in PLACES[1:]:  # a node runs one runtime: the others' directories must not stop the pod
        assert hosts[mounts[path]["name"]]["hostPath"]["type"] == "DirectoryOrCreate"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    (c,) = spec["containers"]
    assert c["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_probes_read_the_heartbeat_the_loop_writes() -> None:
    spec = _daemonset()
    (c,) = spec["containers"]
    argv = c["command"]
    heartbeat = _flag(argv, "--heartbeat")
    every = parse_duration(_flag(argv, "--every"))
    time_limit = parse_duration(_flag(argv, "--time-limit")) if "--time-limit" in argv else 300.0
    mounts = _mounts(spec)
    volume = _hosts(spec)[mounts[os.path.dirname(heartbeat)]["name"]]
    assert volume["emptyDir"]["medium"] == "Memory", "the heartbeat is the pod's own, not a file of the node"
    for probe in ("startupProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:3] == ["kvctl", "gc", "--check-heartbeat"] and cmd[3] == heartbeat
        # A healthy loop's beat is at most a pause (every + 10%) and a whole run old.
        assert parse_duration(_flag(cmd, "--max-age")) > every * 1.1 + time_limit
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > time_limit, "the first run must fit"


def test_the_service_and_servicemonitor_reach_the_daemonsets_port() -> None:
    ds = _one("DaemonSet")
    svc, sm = _one("Service"), _one("ServiceMonitor")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    (port,) = c["ports"]
    argv = c["command"]
    assert port["containerPort"] == int(_flag(argv, "--metrics-port"))
    assert _flag(argv, "--metrics-address") == "0.0.0.0", "a pod's endpoint must listen on the pod's address"
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] == port["name"] and svc_port["port"] == port["containerPort"]
    ns = ds["metadata"]["namespace"]
    assert svc["metadata"]["namespace"] == ns and sm["metadata"]["namespace"] == ns
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [ns]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"] and endpoint["path"] == "/metrics"


# Written by the agent's runs only (gc --every): tests/cli/test_metrics_report.py runs one.
LOOP_ONLY = {"kvctl_gc_every_seconds"}


def _written_metrics(tmp_path: Path) -> set[str]:
    """What a clean run writes (a clean run that removed, so its last success too), on an empty private root."""
    root = tmp_path / "root"
    for sub in ("tmp", "dev/shm"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    prom = tmp_path / "m.prom"
    r = subprocess.run([KVCTL, "--root", str(root), "gc", "--engines", "--yes", "--prometheus", str(prom)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVCTL_LOCK": str(tmp_path / "gc.lock")})
    assert r.returncode == 0, r.stderr
    return {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", prom.read_text(), re.M)}


def test_every_alert_names_metrics_a_run_writes(tmp_path: Path) -> None:
    rules = [r for g in _one("PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    written = _written_metrics(tmp_path)
    named = {m for r in rules for m in re.findall(r"\bkvctl_[a-z_]+\b", r["expr"])}
    assert named - written <= LOOP_ONLY - written, named - written
    alerts = {r["alert"]: r for r in rules}
    # The four the agent needs: bytes it cannot free, no clean run, a blind run, no engine metrics.
    assert {"KvctlGcStaleBytes", "KvctlGcNoRecentSuccess", "KvctlGcBlind", "KvctlGcEngineMetricsAbsent"} <= set(alerts)
    assert "kvctl_gc_engine_stale_bytes" in alerts["KvctlGcStaleBytes"]["expr"]
    assert "kvctl_gc_last_success_timestamp_seconds" in alerts["KvctlGcNoRecentSuccess"]["expr"]
    assert "kvctl_gc_blind" in alerts["KvctlGcBlind"]["expr"]
    assert "kvctl_gc_engine_entries" in alerts["KvctlGcEngineMetricsAbsent"]["expr"]
    for r in rules:
        assert r["labels"]["severity"] in {"warning", "critical"} and r["annotations"]["summary"]


def _commands() -> list[tuple[str, list[str]]]:
    """Every kvctl command line the manifests run or tell an operator to run (kubectl exec ... -- kvctl ...)."""
    out = []
    for name, spec in _pod_specs():
        for c in spec["containers"]:
            if c["command"][0] == "kvctl":
                out.append((name, list(c["command"])))
            for probe in ("startupProbe", "livenessProbe"):
                if probe in c:
                    out.append((f"{name} {probe}", list(c[probe]["exec"]["command"])))
    for path in MANIFESTS:
        for line in path.read_text().splitlines():
            m = re.match(r"#\s+kubectl exec .* -- (kvctl .*)$", line)
            if m:
                out.append((path.name, m.group(1).split()))
    return out


GC_AGENT = ("kvctl gc --yes --engines --all-namespaces --every 10m --json --prometheus "
            "/var/lib/node_exporter/textfile/kvctl.prom --heartbeat /run/kvctl/heartbeat --metrics-port 9407 "
            "--metrics-address 0.0.0.0")
PROBE = "kvctl gc --check-heartbeat /run/kvctl/heartbeat --max-age 20m"


def test_the_command_lines_are_the_documented_ones() -> None:
    """The flags the kvctl phase implements are exactly these (docs: contrib/kubernetes/README.md)."""
    assert sorted(" ".join(argv) for _, argv in _commands()) == sorted([
        GC_AGENT, PROBE, PROBE,
        "kvctl inspect --all-namespaces",
        "kvctl gc --engines --all-namespaces --dry-run",
        "kvctl doctor sight",
        "kvctl inspect --pid 41237",
        "kvctl doctor node",
    ])
    readme = (HERE / "README.md").read_text()
    assert GC_AGENT in " ".join(readme.split()) and PROBE in readme


def _help(command: str) -> str:
    r = subprocess.run([KVCTL, command, "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def _accepted(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _help(command)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _localised(args: list[str], tmp_path: Path) -> list[str]:
    """The command line with its node paths and port moved into the test's own (same flags, same values' kinds)."""
    args = list(args)
    for flag, value in (("--prometheus", str(tmp_path / "kvctl.prom")), ("--heartbeat", str(tmp_path / "hb")),
                        ("--check-heartbeat", str(tmp_path / "hb")), ("--metrics-address", "127.0.0.1"),
                        ("--metrics-port", str(_free_port()))):
        if flag in args:
            args[args.index(flag) + 1] = value
    return args


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=[" ".join(a) for _, a in _commands()])
def test_kvctl_accepts_each_command_line(where: str, argv: list[str], tmp_path: Path) -> None:
    """Run each command line for real, on an empty private root (gc as a dry run), and expect no usage error."""
    root = tmp_path / "root"
    for sub in ("tmp", "dev/shm"):
        (root / sub).mkdir(parents=True)
    args = list(argv[1:])
    accepted = _accepted(args[0])
    assert {a for a in args if a.startswith("--")} <= accepted, f"{where}: {argv} names options --help does not"
    every = "--every" in args  # runs until SIGTERM: stop it after its first run
    args = _localised(args, tmp_path)
    if args[0] == "gc" and "--check-heartbeat" not in args and "--dry-run" not in args:
        args.append("--dry-run")
    cmd = [KVCTL, "--root", str(root), *args]
    env = {**os.environ, "KVCTL_LOCK": str(tmp_path / "gc.lock")}
    if not every:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tempfile.gettempdir())
        assert r.returncode != USAGE, f"{where}: kvctl rejects {argv}: {r.stderr}"
        if "--check-heartbeat" in args:  # no loop ran here: no heartbeat, said as a failed check
            assert r.returncode == UNHEALTHY and "no heartbeat" in r.stderr, r.stderr
        return
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        out = p.stdout.readline()
        doc = json.loads(out)
        assert doc["schema"] == "kvctl.gc/1" and "engines" in doc["summary"]
        # Written by the run before it printed its line: the textfile, the endpoint and the heartbeat.
        text = (tmp_path / "kvctl.prom").read_text()
        assert "kvctl_gc_engine_entries" in text
        url = f"http://127.0.0.1:{_flag(args, '--metrics-port')}/metrics"
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.read().decode() == text
        probe = [KVCTL, "gc", "--check-heartbeat", str(tmp_path / "hb"), "--max-age", "20m"]
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    finally:
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=120)
    assert code in (0, 3), (code, p.stderr.read() if p.stderr else "")
