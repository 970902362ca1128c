"""Map+unmap throughput of kvcached.runtime._kvpages against a bare mmap/munmap loop, and pool cost per block.

    python bench/bench_pages.py [--pages 64] [--page-size 2097152] [--rounds 7]

The bare loop is the fairest baseline we know for what the CPU backend does:
ctypes `mmap(MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE)` of one page, then
`munmap`. Shared anonymous memory is shmem, the same kernel backing as the
extension's memfd; MAP_POPULATE commits the page at map time as the extension
does (MADV_POPULATE_WRITE); each loop touches every page once through the same
ctypes store and both make one Python call per map and one per unmap. Rounds
alternate between the two loops and the median round is reported, so that
noise from other work on the machine falls on both.

For context only, two more rows: the extension mapping every page in one call
(all pages are committed before any is returned, so it touches 64 fresh pages
where the one-page loops keep reusing the same few, hot in cache), and the bare
loop over *private* anonymous memory, cheaper in the kernel (no page cache) but
unable to back a shared range.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from kvcached.node.state.segment import create_segment
from kvcached.runtime import _kvpages
from kvcached.runtime.pool import Geometry, KVPool, LocalMapper

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _touch(addr: int) -> None:
    ctypes.c_char.from_address(addr).value = b"\x01"


def bare_loop(pages: int, page_size: int, flags: int) -> float:
    """Seconds per page for mmap + touch + munmap of one page at a time."""
    mmap_, munmap, touch = _libc.mmap, _libc.munmap, _touch
    t0 = time.perf_counter()
    for _ in range(pages):
        addr = mmap_(None, page_size, _RW, flags, -1, 0)
        if addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap")
        touch(addr)
        munmap(addr, page_size)
    return (time.perf_counter() - t0) / pages


def ext_loop(rng: _kvpages.PageRange) -> float:
    """Seconds per page for map + touch + unmap of one page at a time."""
    base, ps, touch = rng.address, rng.page_size, _touch
    map_, unmap = rng.map, rng.unmap
    t0 = time.perf_counter()
    for i in range(rng.num_pages):
        map_(i)
        touch(base + i * ps)
        unmap(i)
    return (time.perf_counter() - t0) / rng.num_pages


def ext_batch(rng: _kvpages.PageRange) -> float:
    """Seconds per page for one map call over every page, touches, one unmap call."""
    base, ps, touch = rng.address, rng.page_size, _touch
    every = range(rng.num_pages)
    t0 = time.perf_counter()
    rng.map(every)
    for i in every:
        touch(base + i * ps)
    rng.unmap(every)
    return (time.perf_counter() - t0) / rng.num_pages


def _sample(fn: Callable[[], float], samples: list[float]) -> None:
    samples.append(fn())


def bench_pages(pages: int, page_size: int, rounds: int) -> float:
    shared = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    res: dict[str, list[float]] = {"ext": [], "ext_batch": [], "bare": [], "bare_private": []}
    with _kvpages.PageRange(pages, page_size) as rng:
        ext_loop(rng)                      # warm up: page tables, the memfd, the allocator
        bare_loop(pages, page_size, shared)
        for _ in range(rounds):
            _sample(lambda: ext_loop(rng), res["ext"])
            _sample(lambda: bare_loop(pages, page_size, shared), res["bare"])
            _sample(lambda: ext_batch(rng), res["ext_batch"])
            _sample(lambda: bare_loop(pages, page_size, private), res["bare_private"])
    med = {k: statistics.median(v) for k, v in res.items()}
    mib = page_size / (1 << 20)
    print(f"map+touch+unmap, {pages} pages of {page_size} bytes ({mib:g} MiB), median of {rounds} rounds")
    rows = [
        ("extension, one call per page", "ext"),
        ("extension, one call per batch", "ext_batch"),
        ("bare mmap/munmap, MAP_SHARED", "bare"),
        ("bare mmap/munmap, MAP_PRIVATE (context)", "bare_private"),
    ]
    for label, key in rows:
        t = med[key]
        print(f"  {label:<42} {t * 1e6:9.1f} us/page  {1 / t:9.0f} pages/s  {mib / t / 1024:6.2f} GiB/s")
    ratio = med["ext"] / med["bare"]
    verdict = "within" if ratio <= 1.3 else "OVER"
    print(f"  ratio extension / bare MAP_SHARED loop: {ratio:.2f}x ({verdict} the 1.3x target)")
    print(f"  ratio extension batch / bare MAP_SHARED loop: {med['ext_batch'] / med['bare']:.2f}x")
    return ratio


def bench_pool(page_size: int, rounds: int) -> None:
    block = 64 * 1024
    geo = Geometry(num_pages=32, page_size=page_size, num_tensors=2)
    bpp = page_size // block
    with tempfile.TemporaryDirectory() as tmp:
        seg = os.path.join(tmp, "bench_seg")
        create_segment(seg, geo.num_pages * geo.page_bytes)
        mapper = LocalMapper(geo)
        try:
            # Warm: a page already mapped and kept (prealloc 1), so alloc/free never map.
            with KVPool(mapper, geo, block, segment_path=seg, prealloc_pages=1) as pool:
                pool.step()
                n = 20000
                warm: list[float] = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        pool.free(pool.alloc(1))
                    warm.append((time.perf_counter() - t0) / n)
            # Cold: every page is mapped by the allocation that first needs it and
            # unmapped by the free that empties it (2 tensors, segment published).
            cold: list[float] = []
            with KVPool(mapper, geo, block, segment_path=seg) as pool:
                total = geo.num_pages * bpp
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    blocks = [pool.alloc(1)[0] for _ in range(total)]
                    pool.free(blocks)
                    cold.append((time.perf_counter() - t0) / total)
        finally:
            mapper.close()
    print(f"KV pool, blocks of {block} bytes, {bpp} blocks per page, 2 tensors, segment published")
    print(f"  alloc+free of one block in a mapped page      {statistics.median(warm) * 1e6:9.2f} us/block")
    print("  alloc one at a time, mapping pages on demand,")
    print(f"  then free all (pages unmapped when empty)     {statistics.median(cold) * 1e6:9.2f} us/block"
          f"  ({statistics.median(cold) * bpp * 1e3:.2f} ms per page of {bpp} blocks)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=_kvpages.DEFAULT_PAGE_SIZE)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    bench_pages(args.pages, args.page_size, args.rounds)
    bench_pool(args.page_size, max(3, args.rounds // 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
