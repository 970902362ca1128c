"""scripts/install-sglang.sh's promises, checked on the installed venv: SGLang 0.5.23 on the CPU torch, next to vLLM."""

from __future__ import annotations

import re
import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tests.sglang.cpu_env import (
    INSTALL_SCRIPT,
    REPO,
    SHIM,
    VLLM_SCRIPT,
    last_json,
    run_python,
    shell_array,
    shell_pins,
    shell_value,
)


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


def test_every_module_the_script_checks_imports_in_a_fresh_interpreter(sgl_scratch) -> None:
    """The modules the tests drive and the integration hooks, imported the way a spawned SGLang process imports them."""
    modules = shell_array(INSTALL_SCRIPT, "MODULES")
    assert "sglang.srt.entrypoints.engine" in modules and "sglang.srt.managers.scheduler" in modules
    proc = run_python(f"""
        import importlib, json, sys
        for m in {modules!r}:
            importlib.import_module(m)
        import torch
        print(json.dumps({{"torchvision": "torchvision" in sys.modules, "torch": torch.__version__}}))
    """, sgl_scratch)
    report = last_json(proc)
    assert report == {"torchvision": True, "torch": "2.13.0+cpu"}, proc.stderr[-3000:]


def test_vllm_modules_still_import_next_to_sglang(sgl_scratch) -> None:
    """Installing SGLang after vLLM leaves every module install-vllm.sh checks importable."""
    modules = shell_array(VLLM_SCRIPT, "MODULES")
    proc = run_python(f"""
        import importlib, json
        for m in {modules!r}:
            importlib.import_module(m)
        import vllm
        print(json.dumps({{"vllm": vllm.__version__}}))
    """, sgl_scratch)
    assert last_json(proc) == {"vllm": shell_value(VLLM_SCRIPT, "VLLM_VERSION")}


def test_the_torchvision_shim_is_installed_needed_and_enough(sgl_scratch) -> None:
    """The one stub, armed in every process of the venv: without it torchvision fails on `nms`; with it, it imports.

    Every process: once torchvision is installed, transformers imports it in
    vLLM's processes too, so vLLM's tests need it as much as SGLang's.
    """
    site = sysconfig.get_paths()["purelib"]
    assert Path(site, "_kvcached_torchvision_cpu.py").read_text() == SHIM.read_text()
    assert Path(site, "_kvcached_torchvision_cpu.pth").read_text().startswith("import _kvcached_torchvision_cpu;")
    disarmed = run_python("""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "DeclareBeforeTorchvision"]
        import torchvision
    """, sgl_scratch)
    assert disarmed.returncode != 0
    assert "operator torchvision::nms does not exist" in disarmed.stderr
    armed = run_python("""
        import json, sys
        import torchvision, torch
        print(json.dumps({"version": torchvision.__version__, "nms": hasattr(torch.ops.torchvision, "nms"),
                          "finder_left": any(type(f).__name__ == "DeclareBeforeTorchvision" for f in sys.meta_path)}))
    """, sgl_scratch)
    assert last_json(armed) == {"version": "0.28.0+cu130", "nms": True, "finder_left": False}  # the CUDA 13 build
