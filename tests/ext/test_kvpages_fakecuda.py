"""The CUDA backend's plumbing against a stand-in libcuda.so.1 (csrc/testing/fake_libcuda.c).

This proves what can be proved without a GPU: libcuda is loaded at run time,
the right (versioned) symbols are resolved, pages are mapped at the right
addresses, failures unwind and surface as CudaError with the CUresult name,
and nothing leaks (handles, retained and pushed contexts). It does not prove
the backend on a real driver: tests/ext/test_kvpages_cuda.py does, on a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

kvpages = pytest.importorskip(
    "kvcached._kvpages",
    reason="kvcached._kvpages is not built (pip install -e . compiles it from csrc/)",
)

pytestmark = [
    pytest.mark.ext,
    pytest.mark.skipif(not kvpages.cuda_built(),
                       reason="extension built without the CUDA backend (no cuda.h at build time)"),
]

FAKE_SRC = Path(__file__).resolve().parents[2] / "csrc" / "testing" / "fake_libcuda.c"
PS = 2 << 20


@pytest.fixture(scope="module")
def fake_lib_dir(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    out = tmp_path_factory.mktemp("fakecuda")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out / "libcuda.so.1"), str(FAKE_SRC)],
                   check=True, capture_output=True, timeout=120)
    return out


def _run(lib_dir: Path, code: str, **env: str) -> dict:
    full_env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir), **env}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=60, env=full_env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


_PRELUDE = """
    import ctypes, json
    from kvcached import _kvpages as k
    fake = ctypes.CDLL("libcuda.so.1")
    def counters():
        vals = [ctypes.c_int() for _ in range(3)]
        fake.fake_cuda_counters(*[ctypes.byref(v) for v in vals])
        return dict(zip(("handles", "ctx_refs", "push_depth"), (v.value for v in vals)))
    def err(fn):
        try:
            fn()
        except k.CudaError as e:
            return [type(e).__name__, e.name, e.code]
        except Exception as e:
            return [type(e).__name__, str(e)]
        return None
    out = {}
"""


def test_map_unmap_release_through_the_driver(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    out["count"] = k.cuda_device_count()
    out["reason"] = k.cuda_unavailable_reason()
    r = k.PageRange(4, {PS}, device="cuda")
    out["device"] = r.device
    r.map([0, 2])
    out["after_map"] = counters()
    # The fake backs device pages with host memory: page 2 is where we put it.
    ctypes.memset(r.address + 2 * {PS}, 0x5A, {PS})
    out["byte"] = ctypes.string_at(r.address + 3 * {PS} - 1, 1).hex()
    r.unmap(0)
    out["after_unmap"] = counters()
    out["mapped"] = r.mapped_pages()
    out["double_map"] = err(lambda: r.map(2))
    out["buffer"] = err(lambda: memoryview(r))
    r.close()
    out["after_close"] = counters()
    print(json.dumps(out))
    """)
    assert out["count"] == 1 and out["reason"] is None
    assert out["device"] == "cuda:0"
    assert out["after_map"] == {"handles": 2, "ctx_refs": 1, "push_depth": 0}
    assert out["byte"] == "5a"
    assert out["after_unmap"]["handles"] == 1
    assert out["mapped"] == [2]
    assert out["double_map"] == ["ValueError", "page 2 is already mapped"]
    assert out["buffer"][0] == "BufferError"
    assert out["after_close"] == {"handles": 0, "ctx_refs": 0, "push_depth": 0}


def test_out_of_memory_rolls_back_and_names_the_error(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(8, {PS}, device="cuda:0")
    r.map([0, 1])
    out["oom"] = err(lambda: r.map([4, 5, 6]))   # budget: 3 pages in all
    out["mapped"] = r.mapped_pages()
    out["counters"] = counters()
    r.close()
    out["after_close"] = counters()
    print(json.dumps(out))
    """, FAKE_CUDA_MEM_BYTES=str(3 * PS))
    assert out["oom"] == ["CudaError", "CUDA_ERROR_OUT_OF_MEMORY", 2]
    assert out["mapped"] == [0, 1]                  # all or nothing: page 4 was unmapped again
    assert out["counters"] == {"handles": 2, "ctx_refs": 1, "push_depth": 0}
    assert out["after_close"] == {"handles": 0, "ctx_refs": 0, "push_depth": 0}


def test_bad_device_and_granularity(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    out["ordinal"] = err(lambda: k.PageRange(1, {PS}, device="cuda:3"))
    out["granularity"] = err(lambda: k.PageRange(1, 4096, device="cuda"))
    out["counters"] = counters()
    print(json.dumps(out))
    """)
    assert out["ordinal"] == ["CudaError", "CUDA_ERROR_INVALID_DEVICE", 101]
    assert out["granularity"][0] == "ValueError" and "granularity" in out["granularity"][1]
    assert out["counters"] == {"handles": 0, "ctx_refs": 0, "push_depth": 0}


def test_driver_without_a_device(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    out["count"] = k.cuda_device_count()
    out["reason"] = k.cuda_unavailable_reason()
    out["create"] = err(lambda: k.PageRange(1, {PS}, device="cuda"))
    print(json.dumps(out))
    """, FAKE_CUDA_NO_DEVICE="1")
    assert out["count"] == 0
    assert "CUDA_ERROR_NO_DEVICE" in out["reason"]
    assert out["create"] == ["CudaError", "CUDA_ERROR_NO_DEVICE", 100]
