"""The compiled page extension, CUDA (driver VMM) backend, on a real device.

Skipped with "no CUDA device" where none is usable. Memory and data checks go
through torch when it has CUDA; the mapping bookkeeping needs only the driver.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

kvpages = pytest.importorskip(
    "kvcached._kvpages",
    reason="kvcached._kvpages is not built (pip install -e . compiles it from csrc/)",
)

pytestmark = [
    pytest.mark.ext,
    pytest.mark.skipif(kvpages.cuda_device_count() == 0, reason="no CUDA device"),
]

PS = 2 << 20


def _torch_cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA support")
    return torch


@pytest.fixture
def rng():
    r = kvpages.PageRange(8, PS, device="cuda:0")
    yield r
    r.close()


def test_reserve_map_unmap_bookkeeping(rng):
    assert rng.device == "cuda:0"
    rng.map([0, 5])
    assert rng.mapped_pages() == [0, 5] and rng.num_mapped == 2
    rng.unmap(0)
    assert rng.mapped_pages() == [5]


def test_no_host_buffer(rng):
    with pytest.raises(BufferError, match="CUDA"):
        memoryview(rng)


def test_bad_arguments_raise(rng):
    rng.map(1)
    with pytest.raises(ValueError, match="already mapped"):
        rng.map(1)
    with pytest.raises(ValueError, match="not mapped"):
        rng.unmap(2)
    with pytest.raises(IndexError):
        rng.map(8)
    with pytest.raises(ValueError, match="granularity"):
        kvpages.PageRange(4, 4096, device="cuda:0")


def test_bad_device_ordinal_names_the_cuda_error():
    with pytest.raises(kvpages.CudaError) as info:
        kvpages.PageRange(1, PS, device=f"cuda:{kvpages.cuda_device_count() + 7}")
    assert info.value.name == "CUDA_ERROR_INVALID_DEVICE"
    assert isinstance(info.value.code, int)


def test_data_reads_back_through_tensor_view(rng):
    torch = _torch_cuda()
    from kvcached.runtime.pages import Pages, as_tensor

    with Pages(4, PS, device="cuda:0") as pages:
        pages.map(2)
        t = as_tensor(pages, dtype=torch.float32)
        assert t.device.type == "cuda"
        off = 2 * PS // 4
        t[off:off + 4] = torch.arange(4, dtype=torch.float32, device="cuda:0")
        torch.cuda.synchronize()
        assert t[off:off + 4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        del t


def test_device_memory_drops_on_map_and_returns_on_unmap():
    torch = _torch_cuda()
    pages = 64  # 128 MiB: well above allocator noise
    r = kvpages.PageRange(pages, PS, device="cuda:0")
    try:
        free0, _ = torch.cuda.mem_get_info(0)
        r.map(range(pages))
        free1, _ = torch.cuda.mem_get_info(0)
        r.unmap(range(pages))
        free2, _ = torch.cuda.mem_get_info(0)
        assert free0 - free1 >= pages * PS * 0.95
        assert free2 - free1 >= pages * PS * 0.95
    finally:
        r.close()


def test_touching_unmapped_page_faults_child():
    _torch_cuda()
    code = f"""
        import torch
        from kvcached.runtime.pages import Pages, as_tensor
        p = Pages(4, {PS}, device="cuda:0")
        p.map(0)
        t = as_tensor(p)
        t[:{PS}].fill_(1); torch.cuda.synchronize()
        print("mapped page ok", flush=True)
        t[{PS}:].fill_(1); torch.cuda.synchronize()
        print("unreachable", flush=True)
    """
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=120)
    assert "mapped page ok" in res.stdout
    assert "unreachable" not in res.stdout
    # An illegal address on the device surfaces as a CUDA error, not SIGSEGV.
    assert res.returncode != 0 and res.returncode != -signal.SIGSEGV
    assert "illegal" in res.stderr.lower() or "CUDA" in res.stderr
