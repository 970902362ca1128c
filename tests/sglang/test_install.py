"""scripts/install-sglang.sh's promises, checked on the installed venv: SGLang 0.5.23 on the CPU torch, next to vLLM."""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from tests.sglang.cpu_env import (
    INSTALL_SCRIPT,
    REPO,
    SHIM,
    VLLM_SCRIPT,
    Child,
    last_json,
    shell_array,
    shell_pins,
    shell_value,
)

SGLANG_MODULES = shell_array(INSTALL_SCRIPT, "MODULES")
VLLM_MODULES = shell_array(VLLM_SCRIPT, "MODULES")

# Each a fresh interpreter of this venv: the module starts them together (tests/sglang/cpu_env.py's Child).
CHILDREN = {
    "sglang": f"""
        import importlib, json, sys
        for m in {SGLANG_MODULES!r}:
            importlib.import_module(m)
        import torch
        print(json.dumps({{"torchvision": "torchvision" in sys.modules, "torch": torch.__version__}}))
    """,
    "vllm": f"""
        import importlib, json
        for m in {VLLM_MODULES!r}:
            importlib.import_module(m)
        import vllm
        print(json.dumps({{"vllm": vllm.__version__}}))
    """,
    "disarmed": """
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "DeclareBeforeTorchvision"]
        import torchvision
    """,
    "armed": """
        import json, sys
        import torchvision, torch
        print(json.dumps({"version": torchvision.__version__, "nms": hasattr(torch.ops.torchvision, "nms"),
                          "finder_left": any(type(f).__name__ == "DeclareBeforeTorchvision" for f in sys.meta_path)}))
    """,
}


@pytest.fixture(scope="module")
def children(sgl_scratch) -> Iterator[dict[str, Child]]:
    """The module's fresh interpreters, started at once; each test reads its own."""
    started = {key: Child(code, sgl_scratch) for key, code in CHILDREN.items()}
    yield started
    for child in started.values():
        child.close()


def test_sglang_is_the_pinned_release_on_the_cpu_torch() -> None:
    """The release the script pins and pyproject records, on torch 2.13.0's CPU build (SGLang asks for 2.14.1)."""
    import torch

    want = shell_value(INSTALL_SCRIPT, "SGLANG_VERSION")
    assert version("sglang") == want == "0.5.23"
    assert re.search(rf'^sglang = \["sglang=={re.escape(want)}"\]$', (REPO / "pyproject.toml").read_text(), re.M)
    assert torch.__version__ == "2.13.0+cpu"
    assert not torch.cuda.is_available()
    nodeps = dict(w.split("==") for w in shell_array(INSTALL_SCRIPT, "NODEPS") if "$" not in w)
    assert version("torchvision") == nodeps["torchvision"] == "0.28.0"
    assert version("triton") == nodeps["triton"] == "3.7.1"


def test_every_pin_of_the_script_is_what_is_installed() -> None:
    """Both scripts' pins hold together: SGLang's additions and vLLM's set, none upgraded by the other."""
    pins = shell_pins(VLLM_SCRIPT) | shell_pins(INSTALL_SCRIPT)
    assert not shell_pins(VLLM_SCRIPT).keys() & shell_pins(INSTALL_SCRIPT).keys(), "a package pinned twice"
    wrong = {}
    for name, want in pins.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have != want:
            wrong[name] = (want, have)
    assert not wrong, f"pinned vs installed: {wrong}"


def test_every_module_the_script_checks_imports_in_a_fresh_interpreter(children) -> None:
    """The modules the tests drive and the integration hooks, imported the way a spawned SGLang process imports them."""
    assert "sglang.srt.entrypoints.engine" in SGLANG_MODULES and "sglang.srt.managers.scheduler" in SGLANG_MODULES
    proc = children["sglang"].result()
    report = last_json(proc)
    assert report == {"torchvision": True, "torch": "2.13.0+cpu"}, proc.stderr[-3000:]


def test_vllm_modules_still_import_next_to_sglang(children) -> None:
    """Installing SGLang after vLLM leaves every module install-vllm.sh checks importable."""
    assert last_json(children["vllm"].result()) == {"vllm": shell_value(VLLM_SCRIPT, "VLLM_DEFAULT")}


def test_the_torchvision_shim_is_installed_needed_and_enough(children) -> None:
    """The one stub, armed in every process of the venv: without it torchvision fails on `nms`; with it, it imports.

    Every process: once torchvision is installed, transformers imports it in
    vLLM's processes too, so vLLM's tests need it as much as SGLang's.
    """
    site = sysconfig.get_paths()["purelib"]
    assert Path(site, "_kvcached_torchvision_cpu.py").read_text() == SHIM.read_text()
    assert Path(site, "_kvcached_torchvision_cpu.pth").read_text().startswith("import _kvcached_torchvision_cpu;")
    disarmed = children["disarmed"].result()
    assert disarmed.returncode != 0
    assert "operator torchvision::nms does not exist" in disarmed.stderr
    armed = children["armed"].result()
    assert last_json(armed) == {"version": "0.28.0+cu130", "nms": True, "finder_left": False}  # the CUDA 13 build
