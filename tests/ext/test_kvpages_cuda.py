"""The compiled page extension, CUDA (driver VMM) backend, on a real device.

Skipped with "no CUDA device" where none is usable. Memory and data checks go
through torch when it has CUDA; the mapping bookkeeping needs only the driver.
Checks that must start from a process in which CUDA is untouched (fork,
counting without cuInit, device resolution) run in a child process.

Not covered here: a driver failure part way through an unmap (PartialUnmapError)
cannot be provoked on a real driver; tests/ext/test_kvpages_fakecuda.py
injects it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

kvpages = pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

pytestmark = [
    pytest.mark.ext,
    pytest.mark.skipif(kvpages.cuda_device_count() == 0, reason="no CUDA device"),
]

PS = 2 << 20
MiB = 1 << 20


def _torch_cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA support")
    return torch


def _run_child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


@pytest.fixture
def rng():
    r = kvpages.PageRange(8, PS, device="cuda:0")
    yield r
    r.close()


def test_reserve_map_unmap_bookkeeping(rng):
    assert rng.device == "cuda:0"
    assert rng.address % PS == 0
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


def test_data_reads_back_through_tensor_view():
    torch = _torch_cuda()
    from kvcached.runtime.pages import Pages, as_tensor

    with Pages(4, PS, device="cuda:0") as pages:
        pages.map(2)
        t = as_tensor(pages, dtype=torch.float32)
        assert t.device == torch.device("cuda:0") and t.data_ptr() == pages.address
        off = 2 * PS // 4
        t[off:off + 4] = torch.arange(4, dtype=torch.float32, device="cuda:0")
        torch.cuda.synchronize()
        assert t[off:off + 4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        del t


def test_dlpack_export_is_counted_and_keeps_the_range():
    torch = _torch_cuda()
    r = kvpages.PageRange(2, PS, device="cuda:0")
    assert r.__dlpack_device__() == (2, 0)   # kDLCUDA, ordinal 0
    r.map(0)
    t = torch.from_dlpack(r)
    assert (t.device, t.dtype, t.shape, t.data_ptr()) == (torch.device("cuda:0"), torch.uint8,
                                                          (2 * PS,), r.address)
    with pytest.raises(BufferError, match="1 export"):
        r.close()
    view = t[:PS].view(torch.int32)
    del t, r                                  # the view must keep the range mapped
    view.fill_(7)
    assert int(view.sum().item()) == 7 * (PS // 4)
    del view
    torch.cuda.synchronize()


def test_as_tensor_needs_no_numpy():
    _torch_cuda()
    res = _run_child(f"""
        import sys
        sys.modules["numpy"] = None   # torch's __cuda_array_interface__ path would need it
        import torch
        from kvcached.runtime.pages import Pages, as_tensor
        p = Pages(2, {PS}, device="cuda:0")
        p.map(1)
        t = as_tensor(p, dtype=torch.float16)
        t[{PS} // 2:].fill_(1.5)
        print(float(t[{PS} // 2:].float().sum().item()))  # in float32: a float16 sum of 1M values overflows
    """)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout.split()[-1]) == 1.5 * (PS // 2)


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


def test_no_device_memory_leaks_across_ranges_and_exports():
    torch = _torch_cuda()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info(0)
    for _ in range(10):
        r = kvpages.PageRange(16, PS, device="cuda:0")
        r.map(range(16))
        t = torch.from_dlpack(r)
        t.fill_(1)
        torch.cuda.synchronize()
        del t
        r.close()   # pages still mapped: close unmaps them
    free1, _ = torch.cuda.mem_get_info(0)
    assert abs(free0 - free1) <= 4 * MiB, (free0, free1)


def test_cuda_means_the_current_device_per_worker():
    # With one GPU this can only show cuda:0; with more, the last one too.
    torch = _torch_cuda()
    n = torch.cuda.device_count()
    code = f"""
        import sys, torch
        from kvcached.runtime.pages import Pages
        torch.cuda.set_device(int(sys.argv[1]))
        torch.zeros(1, device="cuda")   # a worker that has used its device
        p = Pages(1, {PS}, device="cuda")
        print(p.device, torch.cuda.current_device())
    """
    for dev in sorted({0, n - 1}):
        res = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(dev)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == [f"cuda:{dev}", str(dev)]


def test_counting_devices_leaves_the_driver_uninitialised_for_forked_workers():
    if not os.path.isdir("/proc/driver/nvidia/gpus"):
        pytest.skip("no /proc/driver/nvidia/gpus here: counting falls back to cuInit by design")
    torch = _torch_cuda()
    res = _run_child("""
        import os
        from kvcached.runtime import _kvpages as k
        n = k.cuda_device_count()
        # Counting must not even load libcuda: a child forked from a process that loaded it
        # crashed in its first CUDA call (SIGSEGV, first H200 run). Loading it here to ask
        # whether it is initialised would itself be the problem.
        rc = 3 if "libcuda" not in open("/proc/self/maps").read() else -1
        pid = os.fork()
        if pid == 0:   # what vLLM does with its workers
            import torch
            ok = torch.ones(4, device="cuda").sum().item() == 4
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print(n, rc, os.waitstatus_to_exitcode(status))
    """)
    assert res.returncode == 0, res.stderr
    count, rc, child = res.stdout.split()
    assert int(count) == torch.cuda.device_count()
    assert (int(rc), int(child)) == (3, 0)


def test_forked_child_cannot_touch_the_parents_range():
    _torch_cuda()
    res = _run_child(f"""
        import gc, os, torch
        from kvcached.runtime import _kvpages as k
        r = k.PageRange(2, {PS}, device="cuda:0")
        r.map(0)
        t = torch.from_dlpack(r)
        t[:{PS}].fill_(3)
        torch.cuda.synchronize()
        del t
        pid = os.fork()
        if pid == 0:
            codes = 0
            for i, op in enumerate((lambda: r.map(1), lambda: r.unmap(0), r.close, r.__dlpack__)):
                try:
                    op()
                except k.ForkedError:
                    codes |= 1 << i
            del r
            gc.collect()     # dropping it must make no driver call
            os._exit(0 if codes == 0b1111 else 10 + codes)
        _, status = os.waitpid(pid, 0)
        t = torch.from_dlpack(r)
        print(os.waitstatus_to_exitcode(status), int(t[:{PS}].sum().item()))
        del t
        r.close()
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", str(3 * PS)]


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
    res = _run_child(code)
    assert "mapped page ok" in res.stdout
    assert "unreachable" not in res.stdout
    # An illegal address on the device surfaces as a CUDA error, not SIGSEGV.
    assert res.returncode != 0 and res.returncode != -signal.SIGSEGV
    assert "illegal" in res.stderr.lower() or "CUDA" in res.stderr
