"""scripts/sglang_pool_check.py, the SGLang part of scripts/gpu-check.sh, run on the CPU over memfd pages.

On a GPU node gpu-check.sh runs it with `cuda` (VMM pages); here the same checks run with `cpu`, so that what the
GPU run executes is known to work everywhere but the page backend.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.sglang, pytest.mark.ext]

from .cpu_env import REPO, child_env  # noqa: E402

SCRIPT = REPO / "scripts" / "sglang_pool_check.py"
CHECKS = ["sglang-pool-map-write-read", "sglang-pool-unmap", "sglang-pool-remap-zeros-write-read",
          "sglang-pool-memory-returned"]


def test_gpu_check_is_valid_bash_and_runs_the_pool_check_on_cuda() -> None:
    gpu_check = REPO / "scripts" / "gpu-check.sh"
    r = subprocess.run(["bash", "-n", str(gpu_check)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = gpu_check.read_text()
    assert '"$PY" scripts/sglang_pool_check.py cuda' in text and "sglang_pool_checks | record" in text


def test_the_pool_check_passes_over_memfd_pages(sgl_scratch, tmp_path) -> None:
    env = child_env(sgl_scratch, {"KVCACHED_PAGE_SIZE": str(64 << 10)})
    r = subprocess.run([sys.executable, str(SCRIPT), "cpu"], env=env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    lines = [ln for ln in r.stdout.splitlines() if ln.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert r.returncode == 0 and lines == [f"PASS {c}" for c in CHECKS], r.stdout + r.stderr[-4000:]
