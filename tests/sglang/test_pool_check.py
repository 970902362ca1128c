"""scripts/sglang_pool_check.py, the SGLang part of scripts/gpu-check.sh, run on the CPU over memfd pages (64 KiB).

On a GPU node gpu-check.sh runs it with `cuda` (VMM pages); here the same checks run with `cpu`, so that what the
GPU run executes is known to work everywhere but the page backend.
"""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.sglang, pytest.mark.ext]

from .cpu_env import REPO  # noqa: E402

SCRIPT = REPO / "scripts" / "sglang_pool_check.py"
CHECKS = ["sglang-pool-map-write-read", "sglang-pool-unmap", "sglang-pool-remap-zeros-write-read",
          "sglang-pool-memory-returned"]


def test_gpu_check_is_valid_bash_and_runs_the_pool_check_on_cuda() -> None:
    gpu_check = REPO / "scripts" / "gpu-check.sh"
    r = subprocess.run(["bash", "-n", str(gpu_check)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = gpu_check.read_text()
    assert '"$PY" scripts/sglang_pool_check.py cuda' in text and "sglang_pool_checks | record" in text


@pytest.mark.usefixtures("sgl", "elastic_env")
def test_the_pool_check_passes_over_memfd_pages() -> None:
    """The script's checks, in this process (SGLang is imported here already), on the CPU device."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_pool_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lines: list[str] = []
    assert script.run("cpu", say=lines.append) == 0, lines
    assert lines == [f"PASS {c}" for c in CHECKS]
