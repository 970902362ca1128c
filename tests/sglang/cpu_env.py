"""How the SGLang tests run SGLang: its real modules, in real child processes, on this CPU machine.

SGLang changes the process that imports it (it sets cache variables in
os.environ, patches transformers, forces the multiprocessing start method to
spawn, installs SIGQUIT handlers), so anything that launches or signals runs
in a child interpreter of its own, as SGLang's main process would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "scripts" / "torchvision_cpu_ops.py"
INSTALL_SCRIPT = REPO / "scripts" / "install-sglang.sh"
VLLM_SCRIPT = REPO / "scripts" / "install-vllm.sh"


def child_env(scratch: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an SGLang child: this repository importable (tests.sglang), SGLang's caches in `scratch`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["SGLANG_CACHE_DIR"] = scratch
    # SGLang names its ZMQ IPC paths with NamedTemporaryFile(delete=False) in tempfile's directory: empty
    # files (sockets once bound) that nothing removes after a kill. In the session's scratch, they go with it.
    tmp = os.path.join(scratch, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env["TMPDIR"] = tmp
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("SGLANG_PLUGINS", None)
    if extra:
        env.update(extra)
    return env


class Child:
    """A fresh interpreter running `code`, started now; its output read when a test asks for it.

    For what only a fresh interpreter shows (tests/sglang/test_install.py: its
    imports); a snippet that needs only a process of its own forks from the
    zygote instead (tests/sglang/serves.py's Forked).

    Each one that imports SGLang takes about 20 CPU seconds: a module starts
    its children together, so that both cores import while its first test
    waits. Output goes to unlinked files, not pipes: a child nobody reads yet
    must never block on a full pipe.
    """

    def __init__(self, code: str, scratch: str, *, extra: Mapping[str, str] | None = None,
                 timeout: float = 400.0) -> None:
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=child_env(scratch, extra),
                                     stdout=self._out, stderr=self._err, text=True, cwd=scratch)
        self.timeout = timeout
        self._done: subprocess.CompletedProcess[str] | None = None

    def result(self) -> subprocess.CompletedProcess[str]:
        """What it printed and its exit status, once it exited (up to `timeout` from now; then it is killed)."""
        if self._done is None:
            try:
                self.proc.wait(timeout=self.timeout)
            finally:
                self.close()
            self._out.seek(0)
            self._err.seek(0)
            self._done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self._out.read(),
                                                     self._err.read())
            self._out.close()
            self._err.close()
        return self._done

    def close(self) -> None:
        """Kill it if it still runs (a test that failed before reading it), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    """The last line of the child's stdout that is a JSON object (its report); fails with its output otherwise."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no report from the child (rc {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def shell_array(script: Path, name: str) -> list[str]:
    """The words of bash array `name=( ... )` in `script`: the tests check what the install script names."""
    text = script.read_text()
    match = re.search(rf"^{name}=\((.*?)^\)", text, re.S | re.M)
    assert match, f"{name}=( ... ) not found in {script}"
    return [w.strip('"') for line in match.group(1).splitlines() for w in line.split("#")[0].split()]


def shell_pins(script: Path) -> dict[str, str]:
    """The `name==version` lines of the PINS='...' block of an install script, by normalised name."""
    text = script.read_text()
    block = re.search(r"^PINS='(.*?)^'", text, re.S | re.M)
    assert block, f"PINS block not found in {script}"
    pins = {}
    for line in block.group(1).split():
        name, version = line.split("==")
        pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def shell_value(script: Path, name: str) -> str:
    """The value of `name=...` in `script`."""
    match = re.search(rf"^{name}=(\S+)$", script.read_text(), re.M)
    assert match, f"{name}= not found in {script}"
    return match.group(1)
