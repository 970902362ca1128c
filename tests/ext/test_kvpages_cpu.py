"""The compiled page extension, CPU (memfd) backend: real mappings, real faults."""

from __future__ import annotations

import ctypes
import errno
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

kvpages = pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

pytestmark = pytest.mark.ext

MiB = 1 << 20
PS = 2 * MiB


def _status_kib(field: str) -> int:
    """A `field:  N kB` line of /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def _run_child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def rng():
    r = kvpages.PageRange(8, PS)
    yield r
    r.close()


def test_defaults_and_geometry(rng):
    assert kvpages.DEFAULT_PAGE_SIZE == PS
    assert rng.num_pages == 8 and rng.page_size == PS and rng.size == 8 * PS
    assert rng.device == "cpu"
    assert rng.num_mapped == 0 and rng.mapped_pages() == []
    # Aligned to the page size, so a page can be a huge page where enabled.
    assert rng.address % PS == 0
    assert kvpages.PageRange(3).page_size == PS


def test_written_data_reads_back(rng):
    rng.map(2)
    view = memoryview(rng)
    view[2 * PS:2 * PS + 5] = b"hello"
    view[3 * PS - 1] = 0xAB
    assert bytes(view[2 * PS:2 * PS + 5]) == b"hello"
    assert view[3 * PS - 1] == 0xAB
    # The same bytes through the raw address: the view is zero-copy.
    assert ctypes.string_at(rng.address + 2 * PS, 5) == b"hello"
    view.release()


def test_remapped_page_is_zeroed(rng):
    rng.map(1)
    view = memoryview(rng)
    view[PS:2 * PS] = b"\xff" * PS
    rng.unmap(1)
    rng.map(1)
    assert bytes(view[PS:2 * PS]) == bytes(PS)
    view.release()


def test_map_state_reporting(rng):
    rng.map([5, 0, 3])
    assert rng.mapped_pages() == [0, 3, 5]
    assert rng.num_mapped == 3
    assert rng.is_mapped(3) and not rng.is_mapped(4)
    rng.unmap([0, 5])
    assert rng.mapped_pages() == [3]
    assert "mapped=1" in repr(rng)


def test_touching_unmapped_page_segfaults_child():
    code = f"""
        import ctypes
        from kvcached.runtime import _kvpages
        r = _kvpages.PageRange(4, {PS})
        r.map(0)
        ctypes.memset(r.address, 1, {PS})   # mapped: fine
        print("mapped page ok", flush=True)
        ctypes.memset(r.address + {PS}, 1, 1)   # never mapped
        print("unreachable", flush=True)
    """
    res = _run_child(code)
    assert "mapped page ok" in res.stdout
    assert "unreachable" not in res.stdout
    assert res.returncode == -signal.SIGSEGV, res.stderr


def test_touching_page_after_unmap_segfaults_child():
    code = f"""
        from kvcached.runtime import _kvpages
        r = _kvpages.PageRange(2, {PS})
        v = memoryview(r)
        r.map(1)
        v[{PS}] = 7
        r.unmap(1)
        print("unmapped", flush=True)
        v[{PS}]
        print("unreachable", flush=True)
    """
    res = _run_child(code)
    assert "unmapped" in res.stdout and "unreachable" not in res.stdout
    assert res.returncode == -signal.SIGSEGV, res.stderr


def test_resident_memory_rises_on_map_and_falls_on_unmap():
    pages = 16
    r = kvpages.PageRange(pages, PS)
    try:
        shmem0, rss0 = _status_kib("RssShmem"), _status_kib("VmRSS")
        r.map(range(pages))
        shmem1, rss1 = _status_kib("RssShmem"), _status_kib("VmRSS")
        expected_kib = pages * PS // 1024
        # Committed on map, before anything touches the pages.
        assert shmem1 - shmem0 >= expected_kib * 0.95
        assert rss1 - rss0 >= expected_kib * 0.95
        r.unmap(range(pages))
        shmem2, rss2 = _status_kib("RssShmem"), _status_kib("VmRSS")
        assert shmem1 - shmem2 >= expected_kib * 0.95
        assert rss1 - rss2 >= expected_kib * 0.95
    finally:
        r.close()


def test_close_returns_memory_and_is_idempotent():
    r = kvpages.PageRange(8, PS)
    r.map(range(8))
    shmem1 = _status_kib("RssShmem")
    r.close()
    assert shmem1 - _status_kib("RssShmem") >= 8 * PS // 1024 * 0.95
    r.close()
    assert r.closed
    with pytest.raises(ValueError, match="closed"):
        r.map(0)
    with pytest.raises(BufferError):
        memoryview(r)


def test_context_manager_closes():
    with kvpages.PageRange(2, PS) as r:
        r.map(0)
    assert r.closed


def test_close_refused_while_a_view_is_alive(rng):
    view = memoryview(rng)
    with pytest.raises(BufferError, match="1 export"):
        rng.close()
    view.release()
    rng.close()
    assert rng.closed


def test_dlpack_export_is_counted_until_the_consumer_frees_it(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    assert rng.__dlpack_device__() == (1, 0)   # kDLCPU
    rng.map(1)
    t = torch.from_dlpack(rng)
    assert t.data_ptr() == rng.address and t.shape == (rng.size,) and t.dtype == torch.uint8
    t[PS:PS + 3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert ctypes.string_at(rng.address + PS, 3) == b"\x01\x02\x03"
    legacy = torch.utils.dlpack.from_dlpack(rng.__dlpack__())
    with pytest.raises(BufferError, match="2 export"):
        rng.close()
    del t, legacy
    rng.close()
    with pytest.raises(BufferError, match="closed"):
        rng.__dlpack__()


def test_small_page_size_is_allowed():
    with kvpages.PageRange(3, kvpages.os_page_size()) as r:
        r.map(1)
        v = memoryview(r)
        v[r.page_size] = 1
        assert v[r.page_size] == 1
        v.release()


@pytest.mark.parametrize("index", [8, 100, -1, 2**70])
def test_out_of_range_index_raises(rng, index):
    with pytest.raises(IndexError, match="out of range for 8 pages"):
        rng.map(index)
    with pytest.raises(IndexError):
        rng.unmap(index)
    assert rng.num_mapped == 0


def test_double_map_raises(rng):
    rng.map(4)
    with pytest.raises(ValueError, match="page 4 is already mapped"):
        rng.map(4)


def test_unmap_of_unmapped_raises(rng):
    with pytest.raises(ValueError, match="page 6 is not mapped"):
        rng.unmap(6)


def test_batch_is_all_or_nothing(rng):
    rng.map(3)
    with pytest.raises(ValueError, match="page 3 is already mapped"):
        rng.map([0, 1, 3])
    assert rng.mapped_pages() == [3]
    with pytest.raises(ValueError, match="more than once"):
        rng.map([0, 0])
    with pytest.raises(IndexError):
        rng.map([0, 9])
    assert rng.mapped_pages() == [3]


def test_bad_index_types_raise(rng):
    with pytest.raises(TypeError, match="must be an int or an iterable of ints"):
        rng.map(1.0)
    with pytest.raises(TypeError, match="must be an int"):
        rng.map(True)
    with pytest.raises(TypeError, match="must be an int"):
        rng.map(["1"])
    with pytest.raises(TypeError):
        rng.is_mapped([1])


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, "num_pages must be positive"),
        ((-3,), {}, "num_pages must be positive"),
        ((4, 0), {}, "page_size must be positive"),
        ((4, 4097), {}, "not a positive multiple of the OS page size"),
        ((2**62, PS), {}, "overflows"),
        ((4,), {"device": "tpu"}, "device must be"),
        ((4,), {"device": "cuda:x"}, "device must be"),
    ],
)
def test_bad_constructor_arguments_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvpages.PageRange(*args, **kwargs)


def test_os_errors_carry_errno():
    # Cap the address space so that reserving 2 GiB fails with ENOMEM.
    code = """
        import resource
        from kvcached.runtime import _kvpages
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        try:
            _kvpages.PageRange(1024, 2 << 20)
        except OSError as e:
            print("errno", e.errno, e.strerror)
    """
    res = _run_child(code)
    assert f"errno {errno.ENOMEM}" in res.stdout, res.stdout + res.stderr
    assert "reserve" in res.stdout


def test_cuda_request_without_device_raises_cuda_error():
    if kvpages.cuda_device_count() > 0:
        pytest.skip("a CUDA device is present; tests/ext/test_kvpages_cuda.py covers it")
    reason = kvpages.cuda_unavailable_reason()
    assert reason
    with pytest.raises(kvpages.CudaError) as info:
        kvpages.PageRange(1, PS, device="cuda")
    err = info.value
    if isinstance(err, kvpages.CudaUnavailableError):
        assert err.name is None and err.code is None
    else:  # a driver but no usable device, e.g. CUDA_ERROR_NO_DEVICE
        assert err.name.startswith("CUDA_ERROR_")


def test_threads_map_and_unmap_concurrently():
    r = kvpages.PageRange(32, 64 * 1024)
    errors: list[BaseException] = []

    def churn(pages: range) -> None:
        try:
            for _ in range(50):
                r.map(pages)
                r.unmap(pages)
            r.map(pages)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(range(i, i + 8),)) for i in (0, 8, 16, 24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert r.mapped_pages() == list(range(32))
    r.close()


def test_kvcached_import_does_not_load_extension():
    code = """
        import sys
        import kvcached, kvcached.runtime
        assert "kvcached.runtime._kvpages" not in sys.modules, "loaded by import kvcached"
        assert "torch" not in sys.modules
        from kvcached.runtime import Pages
        assert "kvcached.runtime._kvpages" in sys.modules
        assert "torch" not in sys.modules, "torch loaded without as_tensor"
        print("ok")
    """
    res = _run_child(code)
    assert res.stdout.strip() == "ok", res.stderr
