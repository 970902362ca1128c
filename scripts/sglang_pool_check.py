"""SGLang's elastic KV pool over real pages: map, write with a kernel, read back, unmap, remap (scripts/gpu-check.sh).

    python scripts/sglang_pool_check.py [cuda|cpu]

Builds kvcached's ElasticMHATokenToKVPool and ElasticTokenAllocator (SGLang
0.5.23's own classes underneath) on the device, then: slots of two groups
allocated (their pages mapped), K and V written with SGLang's
``set_kv_buffer`` (an index_put kernel on the device) and read back; the
slots freed and the step boundary run with the scheduler idle (the groups
unmapped, only the padding slot's group left, the memory count back);
allocated again (remapped): the slots read as zeros, take new writes, and
the padding slot's group kept what it had. On CUDA the pages are VMM
allocations; on the CPU the same check runs over memfd pages, which is how
the suite checks this script without a GPU. Prints one line per check,
"PASS name", "FAIL name: why" or "SKIP name: why"; exits 1 on a failure.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

HEADS, HEAD_DIM, LAYERS = 8, 128, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(device: str, size: int) -> tuple[Any, Any]:
    import torch

    from kvcached.integration.sglang.elastic_alloc import ElasticTokenAllocator
    from kvcached.integration.sglang.elastic_buffers import ElasticMHATokenToKVPool

    pool = ElasticMHATokenToKVPool(size=size, page_size=1, dtype=torch.float16, head_num=HEADS, head_dim=HEAD_DIM,
                                   layer_num=LAYERS, device=device, enable_memory_saver=False,
                                   enable_alt_stream=False)
    if pool.elastic is None:
        raise AssertionError(f"the pool is not elastic: {pool.elastic_why}")
    alloc = ElasticTokenAllocator(size, dtype=torch.float16, device=device, kvcache=pool, need_sort=False)
    return pool, alloc


def _kv(n: int, seed: float, device: str) -> tuple[Any, Any]:
    import torch

    base = torch.arange(n * HEADS * HEAD_DIM, device=device, dtype=torch.float32).remainder_(1000.0)
    k = (base + seed).to(torch.float16).view(n, HEADS, HEAD_DIM)
    return k, -k


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _expect(pool: Any, slots: Any, k: Any, v: Any, device: str) -> None:
    import torch

    _sync(device)
    for layer in range(LAYERS):
        got_k, got_v = pool.get_key_buffer(layer)[slots].cpu(), pool.get_value_buffer(layer)[slots].cpu()
        if not (torch.equal(got_k, k.cpu()) and torch.equal(got_v, v.cpu())):
            raise AssertionError(f"layer {layer}: K/V read back differ from what was written")


class Cycle:
    """One pool and allocator, checked step by step (each method one check; state carried between them)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.pool: Any = None
        self.alloc: Any = None
        self.slots: Any = None
        self.pad: Any = None

    def map_write_read(self) -> None:
        """Slots of two groups: their pages mapped; K and V written on the device, read back."""
        self.pool, self.alloc = _build(self.device, 16 * 1024)
        g = self.alloc.ids_per_group
        buf = self.pool.elastic
        base_bytes = buf.mapped_bytes
        if buf.mapped_groups() != [0]:
            raise AssertionError(f"groups mapped at the start: {buf.mapped_groups()} (want the padding slot's)")
        # The rest of the padding slot's group first (it is handed out before any group is mapped), kept to the end.
        pad = self.alloc.alloc(g - 1)
        if pad is None or sorted(pad.tolist()) != list(range(1, g)):
            raise AssertionError("the first ids handed out are not those of the padding slot's group")
        self.pad = self._write(pad, 5.0)
        self.slots = self.alloc.alloc(2 * g)
        if self.slots is None:
            raise AssertionError("the allocator refused two groups under no limit")
        groups = sorted({int(i) // g for i in self.slots.tolist()})
        if buf.mapped_groups() != [0, *groups] or len(groups) != 2:
            raise AssertionError(f"mapped {buf.mapped_groups()} for slots in groups {groups}")
        if buf.mapped_bytes != 3 * base_bytes:
            raise AssertionError(f"{buf.mapped_bytes} bytes mapped for 3 groups of {base_bytes}")
        _, k, v = self._write(self.slots, 11.0)
        _expect(self.pool, self.slots, k, v, self.device)

    def _write(self, slots: Any, seed: float) -> tuple[Any, Any, Any]:
        k, v = _kv(len(slots), seed, self.device)
        for layer in range(LAYERS):
            self.pool.set_kv_buffer(None, slots, k, v, layer_id_override=layer)
        return slots, k, v

    def unmap(self) -> None:
        """Freed, and the step boundary with the scheduler idle: only the padding slot's group stays mapped."""
        buf = self.pool.elastic
        one = buf.mapped_bytes // 3
        self.alloc.free(self.slots)
        self.alloc.step(lambda: True)
        _sync(self.device)
        if buf.mapped_groups() != [0] or buf.mapped_bytes != one:
            raise AssertionError(f"after the idle boundary: groups {buf.mapped_groups()}, {buf.mapped_bytes} bytes")

    def remap_zeros_write_read(self) -> None:
        """Allocated again: the pages come back reading as zeros, take writes; the padding group kept its data."""
        g = self.alloc.ids_per_group
        again = self.alloc.alloc(2 * g)
        if again is None or len(self.pool.elastic.mapped_groups()) != 3:
            raise AssertionError(f"remapping gave {again} with groups {self.pool.elastic.mapped_groups()}")
        _sync(self.device)
        for layer in range(LAYERS):
            if bool(self.pool.get_key_buffer(layer)[again].ne(0).any().item()):
                raise AssertionError(f"layer {layer}: a remapped slot does not read as zero")
        slots, k, v = self._write(again, 77.0)
        _expect(self.pool, slots, k, v, self.device)
        pad_slots, pk, pv = self.pad
        _expect(self.pool, pad_slots, pk, pv, self.device)
        self.alloc.free(again)

    def memory_returned(self) -> None:
        """Everything freed: every group unmapped but the padding slot's, which is always mapped."""
        self.alloc.free(self.pad[0])
        self.alloc.step(lambda: True)
        buf = self.pool.elastic
        if buf.mapped_groups() != [0]:
            raise AssertionError(f"groups still mapped: {buf.mapped_groups()}")
        self.alloc.agreement.source.close()


def run(device: str, say: Callable[[str], None] = print) -> int:
    """Every check on `device`, one line each; the number of failures."""
    try:
        import sglang.srt.mem_cache.allocator  # noqa: F401
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
    except Exception as e:  # SGLang not installed, or it does not import on this machine
        say(f"SKIP sglang-pool: SGLang's pool does not import here ({type(e).__name__}: {str(e)[:200]})")
        return 0
    cycle = Cycle(device)
    failed = 0
    for name, check in (("sglang-pool-map-write-read", cycle.map_write_read),
                        ("sglang-pool-unmap", cycle.unmap),
                        ("sglang-pool-remap-zeros-write-read", cycle.remap_zeros_write_read),
                        ("sglang-pool-memory-returned", cycle.memory_returned)):
        try:
            check()
        except Exception as e:  # every failure becomes one FAIL line; the later checks would only repeat it
            where = traceback.extract_tb(e.__traceback__)[-1]
            say(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''} "
                f"(line {where.lineno})")
            return failed + 1
        say(f"PASS {name}")
    return failed


def main(argv: list[str]) -> int:
    device = argv[1] if len(argv) > 1 else "cuda"
    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory() as root:
        # A private node root: the allocator looks for the deployment's segment there and finds none (no limit).
        os.environ["KVCACHED_ROOT"] = root
        os.environ.setdefault("KVCACHED_IPC_NAME", "sglang-pool-check")
        os.environ["KVCACHED_ELASTIC_RELEASE_DELAY_S"] = "0"
        os.environ["KVCACHED_ELASTIC_RESERVE_PAGES"] = "0"
        return 1 if run(device) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
