"""The CUDA backend's plumbing against a strict stand-in libcuda.so.1 (csrc/testing/fake_libcuda.c).

The fake is as strict as the driver API documentation (alignment, allocation
properties, access descriptors, ordinals vs handles, fork) and as permissive
as the real driver (release while mapped). This proves what can be proved
without a GPU: libcuda is loaded at run time, the right symbols are called
with the right arguments, failures unwind or are reported exactly, and
nothing leaks. tests/ext/test_kvpages_cuda.py proves the backend on a GPU.

Each test runs in a child process: the fake is loaded once per process, and
its counters and injected faults must not leak between tests.
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
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

pytestmark = [
    pytest.mark.ext,
    pytest.mark.skipif(not kvpages.cuda_built(),
                       reason="extension built without the CUDA backend (no cuda.h at build time)"),
]

FAKE_SRC = Path(__file__).resolve().parents[2] / "csrc" / "testing" / "fake_libcuda.c"
PS = 2 << 20
CLEAN = {"handles": 0, "allocations": 0, "reservations": 0, "ctx_refs": 0, "push_depth": 0,
         "violations": 0}


@pytest.fixture(scope="module")
def fake_lib_dir(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    out = tmp_path_factory.mktemp("fakecuda")
    subprocess.run([cc, "-shared", "-fPIC", "-pthread", "-O1", "-o", str(out / "libcuda.so.1"),
                    str(FAKE_SRC)], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture
def gpu_listing(tmp_path):
    """A /proc/driver/nvidia/gpus look-alike with two GPUs."""
    root = tmp_path / "gpus"
    for bus, uuid in (("0000:17:00.0", "GPU-aaaa1111-0000"), ("0000:65:00.0", "GPU-bbbb2222-0000")):
        (root / bus).mkdir(parents=True)
        (root / bus / "information").write_text(f"Model: \t\t Fake H200\nGPU UUID: \t {uuid}\n")
    return root


def _run(lib_dir: Path, code: str, **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    # No GPU listing unless a test gives one: this machine's own must not count.
    full_env.update({"LD_LIBRARY_PATH": str(lib_dir),
                     "KVCACHED_NVIDIA_GPUS_DIR": str(lib_dir / "no-such-dir"), **env})
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=60, env=full_env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


_PRELUDE = """
    import ctypes, gc, json, os, sys, threading, time
    from kvcached.runtime import _kvpages as k
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_cuda_stat.restype = ctypes.c_longlong
    def stat(name):
        return fake.fake_cuda_stat(name.encode())
    def counters():
        return {n: stat(n) for n in ("handles", "allocations", "reservations", "ctx_refs",
                                     "push_depth", "violations")}
    def fail(fn, rc, after=0, times=1):
        fake.fake_cuda_fail(fn.encode(), after, times, rc)
    def hold(fn):
        # The next call of `fn` stops inside the driver until release(fn); a hold nobody
        # releases ends after 20 s and counts in stat("hold_timeouts").
        fake.fake_cuda_hold(fn.encode(), 20000)
    def wait_held(fn):
        # Returns once a thread is held inside `fn` (waiting in C, without the GIL).
        assert fake.fake_cuda_wait_held(fn.encode(), 30000) == 1, f"no thread entered {fn} within 30 s"
    def release(fn):
        fake.fake_cuda_release(fn.encode())
    def err(fn):
        try:
            fn()
        except k.CudaError as e:
            return [type(e).__name__, e.name, e.code]
        except Exception as e:
            return [type(e).__name__, str(e)]
        return None
    def push_primary(ordinal):
        # What torch leaves behind on its current device: that device's
        # primary context, current on this thread.
        fake.cuInit(0)
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        assert fake.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
        assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
        assert fake.cuCtxPushCurrent_v2(ctx) == 0
    out = {}
"""

INVALID_VALUE = 1


def test_map_unmap_close_through_the_driver(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(4, {PS}, device="cuda")
    out["device"] = r.device
    out["aligned"] = r.address % {PS} == 0
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
    assert out["device"] == "cuda:0" and out["aligned"]
    assert out["after_map"] == {**CLEAN, "allocations": 2, "reservations": 1, "ctx_refs": 1}
    assert out["byte"] == "5a"
    assert out["after_unmap"]["allocations"] == 1
    assert out["mapped"] == [2]
    assert out["double_map"] == ["ValueError", "page 2 is already mapped"]
    assert out["buffer"][0] == "BufferError"
    assert out["after_close"] == CLEAN


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
    assert out["counters"] == {**CLEAN, "allocations": 2, "reservations": 1, "ctx_refs": 1}
    assert out["after_close"] == CLEAN


def test_bad_device_and_granularity(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    out["ordinal"] = err(lambda: k.PageRange(1, {PS}, device="cuda:3"))
    out["granularity"] = err(lambda: k.PageRange(1, 4096, device="cuda"))
    out["counters"] = counters()
    print(json.dumps(out))
    """)
    assert out["ordinal"] == ["CudaError", "CUDA_ERROR_INVALID_DEVICE", 101]
    assert out["granularity"][0] == "ValueError" and "granularity" in out["granularity"][1]
    assert out["counters"] == CLEAN


def test_driver_without_a_device(fake_lib_dir):
    # Without a GPU listing to count, counting falls back to cuInit, which fails.
    out = _run(fake_lib_dir, _PRELUDE + f"""
    out["count"] = k.cuda_device_count()
    out["reason"] = k.cuda_unavailable_reason()
    out["create"] = err(lambda: k.PageRange(1, {PS}, device="cuda"))
    print(json.dumps(out))
    """, FAKE_CUDA_NO_DEVICE="1")
    assert out["count"] == 0
    assert "CUDA_ERROR_NO_DEVICE" in out["reason"]
    assert out["create"] == ["CudaError", "CUDA_ERROR_NO_DEVICE", 100]


# --- 8: reservation alignment, device ordinals -----------------------------------


def test_pages_map_on_a_second_device_at_aligned_addresses(fake_lib_dir):
    # cuMemMap wants granularity-aligned addresses, which alignment 0 does not
    # promise; allocation locations take ordinals, not CUdevice handles.
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(3, {PS}, device="cuda:1")
    out["aligned"] = r.address % {PS} == 0
    out["map"] = err(lambda: r.map([0, 2]))
    out["mapped"] = r.mapped_pages()
    r.close()
    out["after_close"] = counters()
    print(json.dumps(out))
    """, FAKE_CUDA_DEVICES="2")
    assert out == {"aligned": True, "map": None, "mapped": [0, 2], "after_close": CLEAN}


# --- 1 and 4: the DLPack export ------------------------------------------------

_DLPACK = """
    class Device(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int32), ("id", ctypes.c_int32)]
    class DType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]
    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32),
                    ("dtype", DType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]
    class Managed(ctypes.Structure):
        pass
    Managed._fields_ = [("dl_tensor", Tensor), ("manager_ctx", ctypes.c_void_p),
                        ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(Managed)))]
    class Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]
    class Versioned(ctypes.Structure):
        pass
    Versioned._fields_ = [("version", Version), ("manager_ctx", ctypes.c_void_p),
                          ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(Versioned))),
                          ("flags", ctypes.c_uint64), ("dl_tensor", Tensor)]
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    def managed(capsule, kind=Managed):
        name = api.PyCapsule_GetName(capsule)
        return name.decode(), kind.from_address(api.PyCapsule_GetPointer(capsule, name))
    def describe(t):
        return {"data": t.data, "device": [t.device.type, t.device.id], "ndim": t.ndim,
                "dtype": [t.dtype.code, t.dtype.bits, t.dtype.lanes], "shape": t.shape[0],
                "stride": t.strides[0], "offset": t.byte_offset}
    def consume(capsule, kind=Managed):
        # What torch does: take the tensor, rename the capsule, call the deleter later.
        name, m = managed(capsule, kind)
        api.PyCapsule_SetName(capsule, ("used_" + name).encode())
        return m
"""


def test_dlpack_export_describes_the_range_on_its_device(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + _DLPACK + f"""
    r = k.PageRange(3, {PS}, device="cuda:1")
    out["device"] = list(r.__dlpack_device__())
    cap = r.__dlpack__(stream=1)
    name, m = managed(cap)
    out["legacy"] = [name, describe(m.dl_tensor), r.address, r.size]
    cap2 = r.__dlpack__(max_version=(1, 3), dl_device=(2, 1), copy=False)
    name, v = managed(cap2, Versioned)
    out["versioned"] = [name, v.version.major, v.version.minor, v.flags, describe(v.dl_tensor)["device"]]
    out["wrong_device"] = err(lambda: r.__dlpack__(dl_device=(2, 0)))
    out["copy"] = err(lambda: r.__dlpack__(copy=True))
    out["close_refused"] = err(r.close)
    del cap, cap2   # never consumed: the capsules release their exports
    r.close()
    out["after_close"] = counters()
    out["closed"] = err(r.__dlpack__)
    print(json.dumps(out))
    """, FAKE_CUDA_DEVICES="2")
    assert out["device"] == [2, 1]   # kDLCUDA, ordinal 1
    name, desc, address, size = out["legacy"]
    assert name == "dltensor"
    assert desc == {"data": address, "device": [2, 1], "ndim": 1, "dtype": [1, 8, 1],
                    "shape": size, "stride": 1, "offset": 0}
    assert out["versioned"] == ["dltensor_versioned", 1, 0, 0, [2, 1]]
    assert out["wrong_device"][0] == "BufferError"
    assert out["copy"][0] == "BufferError"
    assert out["close_refused"][0] == "BufferError" and "2 export(s)" in out["close_refused"][1]
    assert out["after_close"] == CLEAN
    assert out["closed"][0] == "BufferError"


def test_a_consumed_export_keeps_the_range_until_its_deleter_runs(fake_lib_dir):
    # A stale tensor over freed addresses would write into the next range
    # reserved there: the range must outlive every consumer.
    out = _run(fake_lib_dir, _PRELUDE + _DLPACK + f"""
    r = k.PageRange(2, {PS}, device="cuda")
    r.map(0)
    m = consume(r.__dlpack__())          # the capsule is gone; the consumer holds m
    out["close"] = err(r.close)
    del r
    gc.collect()
    out["after_del"] = counters()        # still reserved and mapped: m can reach it
    m.deleter(ctypes.pointer(m))          # the consumer frees its tensor
    out["after_deleter"] = counters()
    vm = consume(k.PageRange(1, {PS}, device="cuda").__dlpack__(max_version=(1, 0)), Versioned)
    out["versioned_alive"] = counters()["reservations"]
    vm.deleter(ctypes.pointer(vm))
    out["versioned_freed"] = counters()
    print(json.dumps(out))
    """)
    assert out["close"][0] == "BufferError"
    assert out["after_del"] == {**CLEAN, "allocations": 1, "reservations": 1, "ctx_refs": 1}
    assert out["after_deleter"] == CLEAN
    assert out["versioned_alive"] == 1
    assert out["versioned_freed"] == CLEAN


# --- 2: fork --------------------------------------------------------------------


def test_forked_child_makes_no_driver_call_on_the_parents_range(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + _DLPACK + f"""
    r = k.PageRange(4, {PS}, device="cuda")
    r.map(0)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        child = {{"map": err(lambda: r.map(1)), "unmap": err(lambda: r.unmap(0)),
                  "close": err(r.close), "dlpack": err(r.__dlpack__),
                  "mapped": r.mapped_pages(), "count": k.cuda_device_count(),
                  "reason": k.cuda_unavailable_reason()}}
        del r
        gc.collect()
        child["foreign_calls"] = stat("foreign_calls")
        os.write(wfd, json.dumps(child).encode())
        os._exit(0)
    os.close(wfd)
    out["child"] = json.loads(os.read(rfd, 65536))
    os.waitpid(pid, 0)
    out["parent_before"] = counters()
    r.unmap(0)
    r.close()
    out["parent_after"] = counters()
    print(json.dumps(out))
    """)
    child = out["child"]
    for op in ("map", "unmap", "close", "dlpack"):
        assert child[op][0] == "ForkedError", (op, child[op])
        assert "forked" in child[op][1]
    assert child["mapped"] == [0]
    assert child["count"] == 0 and "forked" in child["reason"]
    assert child["foreign_calls"] == 0   # not even the destructor called the driver
    assert out["parent_before"] == {**CLEAN, "allocations": 1, "reservations": 1, "ctx_refs": 1}
    assert out["parent_after"] == CLEAN


def test_counting_devices_does_not_initialise_the_driver(fake_lib_dir, gpu_listing):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    seen = {{}}
    for cvd in (None, "1", "GPU-bbbb", "0,7,1", "1,1", "", "MIG-0e0f", "junk"):
        if cvd is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = cvd
        seen[str(cvd)] = [k.cuda_device_count(), k.cuda_unavailable_reason()]
    os.environ.pop("CUDA_VISIBLE_DEVICES")
    out["seen"] = seen
    out["current"] = k.cuda_current_device()
    out["init_calls"] = stat("init_calls")
    r = k.PageRange(1, {PS}, device="cuda")
    # Initialised now: the driver itself answers (three devices, the listing says two).
    out["after_init"] = [k.cuda_device_count(), stat("init_calls")]
    r.close()
    print(json.dumps(out))
    """, KVCACHED_NVIDIA_GPUS_DIR=str(gpu_listing), FAKE_CUDA_DEVICES="3")
    seen = out["seen"]
    assert seen["None"] == [2, None]
    assert seen["1"] == [1, None]
    assert seen["GPU-bbbb"] == [1, None]       # a unique UUID prefix, as CUDA accepts
    assert seen["0,7,1"] == [1, None]          # the list ends at the first invalid entry
    assert seen["1,1"] == [1, None]
    assert seen[""][0] == 0 and "CUDA_VISIBLE_DEVICES=" in seen[""][1]
    assert seen["MIG-0e0f"] == [1, None]
    assert seen["junk"][0] == 0
    assert out["current"] is None
    assert out["init_calls"] == 0
    assert out["after_init"] == [3, 1]


def test_counting_devices_without_a_listing_falls_back_to_cuinit(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + """
    out["count"] = k.cuda_device_count()
    out["init_calls"] = stat("init_calls")
    print(json.dumps(out))
    """)
    assert out == {"count": 1, "init_calls": 1}


# --- 3: "cuda" is the caller's current device -----------------------------------

def test_cuda_means_the_current_contexts_device(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    from kvcached.runtime.pages import Pages
    out["none_current"] = [k.cuda_current_device(), k.PageRange(1, {PS}, device="cuda").device]
    push_primary(1)
    out["current"] = k.cuda_current_device()
    out["raw"] = k.PageRange(1, {PS}, device="cuda").device
    out["wrapper"] = Pages(1, {PS}, device="cuda").device
    out["explicit"] = Pages(1, {PS}, device="cuda:0").device
    # Another thread has no context current: device 0 there.
    res = {{}}
    th = threading.Thread(target=lambda: res.update(d=Pages(1, {PS}, device="cuda").device))
    th.start(); th.join()
    out["other_thread"] = res["d"]
    out["torch_loaded"] = "torch" in sys.modules
    gc.collect()
    out["depth"] = stat("push_depth")
    print(json.dumps(out))
    """, FAKE_CUDA_DEVICES="2")
    assert out["none_current"] == [None, "cuda:0"]
    assert out["current"] == 1
    assert out["raw"] == out["wrapper"] == "cuda:1"
    assert out["explicit"] == "cuda:0"
    assert out["other_thread"] == "cuda:0"
    assert out["torch_loaded"] is False
    assert out["depth"] == 1   # our pushes popped; the test's own push remains


def test_cuda_falls_back_to_torchs_current_device(fake_lib_dir):
    # Where no context is current, a torch that is imported and has CUDA
    # initialised decides. A stand-in torch keeps this to the decision itself;
    # tests/ext/test_kvpages_cuda.py does it with the real torch on a GPU.
    out = _run(fake_lib_dir, _PRELUDE + f"""
    import types
    from kvcached.runtime.pages import Pages, resolve_device
    state = {{"init": False}}
    cuda = types.SimpleNamespace(is_initialized=lambda: state["init"], current_device=lambda: 1)
    sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)
    out["uninitialised"] = resolve_device("cuda")
    state["init"] = True
    out["initialised"] = Pages(1, {PS}, device="cuda").device
    push_primary(0)
    out["context_wins"] = resolve_device("cuda")
    out["others"] = [resolve_device("cpu"), resolve_device("cuda:0")]
    print(json.dumps(out))
    """, FAKE_CUDA_DEVICES="2")
    assert out["uninitialised"] == "cuda:0"
    assert out["initialised"] == "cuda:1"
    assert out["context_wins"] == "cuda:0"
    assert out["others"] == ["cpu", "cuda:0"]


# --- 5: a failed unmap reports what happened ------------------------------------


def test_failed_unmap_reports_the_pages_it_did_and_did_not_unmap(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(4, {PS}, device="cuda")
    r.map([0, 1, 2, 3])
    fail("cuMemUnmap", {INVALID_VALUE}, after=1)    # the second page fails
    try:
        r.unmap([0, 1, 2, 3])
    except k.PartialUnmapError as e:
        out["error"] = [e.unmapped, e.failed, type(e.__cause__).__name__, e.__cause__.name, str(e)]
    out["mapped"] = r.mapped_pages()
    out["num_mapped"] = r.num_mapped
    out["driver_mapped"] = stat("mapped")
    r.close()
    out["after_close"] = counters()
    print(json.dumps(out))
    """)
    unmapped, failed, cause, name, message = out["error"]
    assert (unmapped, failed) == ([0, 2, 3], [1])
    assert (cause, name) == ("CudaError", "CUDA_ERROR_INVALID_VALUE")
    assert "page(s) [1] stay mapped" in message and "cuMemUnmap (page 1)" in message
    assert out["mapped"] == [1] and out["num_mapped"] == 1 and out["driver_mapped"] == 1
    assert out["after_close"] == CLEAN


# --- 6: the allocation handle is released once mapped ---------------------------


def test_mapped_pages_hold_no_allocation_handle(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(4, {PS}, device="cuda")
    r.map([0, 1])
    out["after_map"] = [stat("handles"), stat("allocations")]
    # A release that would fail can no longer strand a page: unmap does not release.
    fail("cuMemRelease", {INVALID_VALUE}, times=100)
    r.unmap([0, 1])
    out["after_unmap"] = [r.mapped_pages(), stat("allocations")]
    # A release failing right after a map undoes the map and says so.
    out["map_release_fails"] = err(lambda: r.map(2))
    out["after_failed_map"] = [r.mapped_pages(), stat("mapped")]
    fail("cuMemRelease", {INVALID_VALUE}, times=0)
    r.close()
    out["after_close"] = {{n: v for n, v in counters().items() if n != "handles"}}
    print(json.dumps(out))
    """)
    assert out["after_map"] == [0, 2]
    assert out["after_unmap"] == [[], 0]
    assert out["map_release_fails"] == ["CudaError", "CUDA_ERROR_INVALID_VALUE", 1]
    assert out["after_failed_map"] == [[], 0]
    # The one handle the driver refused to release is the only thing left.
    assert out["after_close"] == {**{n: v for n, v in CLEAN.items() if n != "handles"},
                                  "allocations": 1}


# --- 7: teardown ---------------------------------------------------------------


def test_close_pops_the_context_before_releasing_it(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(2, {PS}, device="cuda")
    r.map(1)
    r.close()
    out["after_close"] = counters()
    r2 = k.PageRange(2, {PS}, device="cuda")
    r2.map(0)
    del r2
    gc.collect()
    out["after_del"] = counters()
    print(json.dumps(out))
    """)
    assert out["after_close"] == CLEAN
    assert out["after_del"] == CLEAN


def test_close_keeps_a_range_whose_page_cannot_be_unmapped(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(3, {PS}, device="cuda")
    r.map([0, 1, 2])
    fail("cuMemUnmap", {INVALID_VALUE}, after=1)
    out["close"] = err(r.close)
    out["closed"] = r.closed
    out["after_close"] = counters()
    print(json.dumps(out))
    """)
    assert out["close"] == ["CudaError", "CUDA_ERROR_INVALID_VALUE", 1]
    assert out["closed"] is True
    # Page 1 is still mapped: its reservation and context are kept, never freed under it.
    assert out["after_close"] == {**CLEAN, "allocations": 1, "reservations": 1, "ctx_refs": 1}


def test_close_message_names_the_leak(fake_lib_dir):
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(2, {PS}, device="cuda")
    r.map([0, 1])
    fail("cuMemUnmap", {INVALID_VALUE})
    try:
        r.close()
    except k.CudaError as e:
        out["message"] = str(e)
    print(json.dumps(out))
    """)
    assert "leaked" in out["message"] and "[0]" in out["message"]


def test_teardown_never_holds_the_gil_through_driver_calls(fake_lib_dir):
    # close() while another thread is inside unmap: the teardown waits for that thread
    # and gives the GIL up meanwhile, so Python keeps running. Once the unmap is held in
    # the driver, threads switch only where one gives the GIL up (a huge switch interval):
    # this thread runs again only when close() waits without it. A close() that waited
    # holding the GIL would keep this thread from releasing the hold until it timed out.
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(3, {PS}, device="cuda")
    r.map([0, 1, 2])
    hold("cuMemUnmap")
    t = threading.Thread(target=lambda: out.update(unmap=err(lambda: r.unmap(0))))
    t.start()
    wait_held("cuMemUnmap")        # inside the driver, holding the range's lock
    sys.setswitchinterval(100)
    c = threading.Thread(target=lambda: out.update(close=err(r.close)))
    c.start()                      # returns once c gives the GIL up: inside close()
    out["ran_while_close_waited"] = r.closed and "close" not in out
    release("cuMemUnmap")
    t.join()
    c.join()
    out["hold_timeouts"] = stat("hold_timeouts")
    out["after"] = counters()
    print(json.dumps(out))
    """)
    assert out["unmap"] is None and out["close"] is None
    assert out["ran_while_close_waited"] is True, out
    assert out["hold_timeouts"] == 0, "close() kept the GIL while it waited for the unmap"
    assert out["after"] == CLEAN


# --- 8: getters never wait for the range's lock holding the GIL -----------------


def test_getters_do_not_stall_python_while_a_map_is_in_the_driver(fake_lib_dir):
    # As above: num_mapped and repr read at once, without the range's lock; is_mapped and
    # mapped_pages wait for the unmap in the driver, without the GIL.
    out = _run(fake_lib_dir, _PRELUDE + f"""
    r = k.PageRange(2, {PS}, device="cuda")
    r.map(0)
    hold("cuMemUnmap")
    t = threading.Thread(target=lambda: r.unmap(0))
    t.start()
    wait_held("cuMemUnmap")        # inside the driver, holding the range's lock
    out["at_once"] = [r.num_mapped, repr(r)]
    sys.setswitchinterval(100)
    q = threading.Thread(target=lambda: out.update(waited=[r.is_mapped(0), r.mapped_pages()]))
    q.start()                      # returns once q gives the GIL up: waiting for the lock
    out["ran_while_getter_waited"] = q.is_alive() and "waited" not in out
    release("cuMemUnmap")
    q.join()
    t.join()
    out["hold_timeouts"] = stat("hold_timeouts")
    r.close()
    print(json.dumps(out))
    """)
    num_mapped, rep = out["at_once"]
    assert num_mapped == 1 and "mapped=1" in rep, out   # read at once, while the unmap is in the driver
    assert out["waited"] == [False, []], out           # waited for the unmap to end
    assert out["ran_while_getter_waited"] is True, out
    assert out["hold_timeouts"] == 0, "a getter kept the GIL while it waited for the range's lock"


def test_strict_fake_rejects_what_the_driver_rejects(fake_lib_dir):
    # The double itself: a test passing against it must mean something.
    out = _run(fake_lib_dir, _PRELUDE + f"""
    P = ctypes.c_void_p
    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", Loc),
                    ("win32", P), ("flags", ctypes.c_ubyte * 8)]
    class Access(ctypes.Structure):
        _fields_ = [("location", Loc), ("flags", ctypes.c_int)]
    u64 = ctypes.c_ulonglong
    fake.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64]
    fake.cuMemMap.argtypes = [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64]
    fake.cuMemUnmap.argtypes = [u64, ctypes.c_size_t]
    fake.cuMemSetAccess.argtypes = [u64, ctypes.c_size_t, P, ctypes.c_size_t]
    fake.cuMemCreate.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, P, u64]
    fake.cuMemRelease.argtypes = [u64]
    fake.cuMemAddressFree.argtypes = [u64, ctypes.c_size_t]
    rc = {{}}
    rc["before_init"] = fake.cuDeviceGetCount(ctypes.byref(ctypes.c_int()))
    push_primary(0)
    base, h = u64(), u64()
    rc["reserve_default"] = fake.cuMemAddressReserve(ctypes.byref(base), 4 * {PS}, 0, 0, 0)
    rc["default_aligned"] = base.value % {PS} == 0
    rc["reserve_aligned"] = fake.cuMemAddressReserve(ctypes.byref(base), 4 * {PS}, {PS}, 0, 0)
    prop = Prop(1, 0, Loc(1, 0x100))          # a device handle where an ordinal is due
    rc["create_handle_id"] = fake.cuMemCreate(ctypes.byref(h), {PS}, ctypes.byref(prop), 0)
    prop.location.id = 0
    rc["create"] = fake.cuMemCreate(ctypes.byref(h), {PS}, ctypes.byref(prop), 0)
    rc["map_offset"] = fake.cuMemMap(base.value, {PS}, {PS}, h.value, 0)
    rc["map_unaligned"] = fake.cuMemMap(base.value + 4096, {PS}, 0, h.value, 0)
    rc["map_outside"] = fake.cuMemMap(base.value + 4 * {PS}, {PS}, 0, h.value, 0)
    acc = Access(Loc(1, 0), 3)
    rc["access_unmapped"] = fake.cuMemSetAccess(base.value, {PS}, ctypes.byref(acc), 1)
    rc["map"] = fake.cuMemMap(base.value, {PS}, 0, h.value, 0)
    rc["release_while_mapped"] = fake.cuMemRelease(h.value)
    rc["alive_after_release"] = stat("allocations")
    acc.location.id = 5
    rc["access_bad_device"] = fake.cuMemSetAccess(base.value, {PS}, ctypes.byref(acc), 1)
    rc["free_while_mapped"] = fake.cuMemAddressFree(base.value, 4 * {PS})
    rc["unmap"] = fake.cuMemUnmap(base.value, {PS})
    rc["freed_on_unmap"] = stat("allocations")
    rc["free"] = fake.cuMemAddressFree(base.value, 4 * {PS})
    print(json.dumps(rc))
    """, FAKE_CUDA_DEVICES="2")
    assert out == {
        "before_init": 3, "reserve_default": 0, "default_aligned": False, "reserve_aligned": 0,
        "create_handle_id": 101, "create": 0, "map_offset": 1, "map_unaligned": 1,
        "map_outside": 1, "access_unmapped": 1, "map": 0, "release_while_mapped": 0,
        "alive_after_release": 1, "access_bad_device": 101, "free_while_mapped": 1, "unmap": 0,
        "freed_on_unmap": 0, "free": 0,
    }
