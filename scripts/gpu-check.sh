#!/usr/bin/env bash
# The real-GPU check of the CUDA page backend, from a fresh checkout, offline.
#
# 1. builds kvcached.runtime._kvpages in place (setup.py build_ext: no pip, no network);
# 2. runs tests/ext/test_kvpages_cuda.py (DLPack export, close refused while
#    exported, device resolution, fork guard, no leaks, ...);
# 3. checks pages with real CUDA tensors: map, write with a kernel, read back,
#    unmap, remap, write and read again, memory returned;
# 4. checks the elastic KV buffer that vLLM's layers become views of (block-pool):
#    groups of blocks mapped, every block written by a kernel through per-layer
#    views and read back, a group unmapped and mapped again (reads as zeros,
#    takes writes, its neighbour untouched), memory returned. Needs no vLLM.
# 5. checks SGLang's elastic KV pool over real CUDA pages (scripts/sglang_pool_check.py:
#    map, write with SGLang's set_kv_buffer kernel, read back, unmap at an idle step
#    boundary, remap: zeros, new writes, the padding slot's group intact). Needs SGLang
#    0.5.23 importable; "SKIP sglang-pool: ..." otherwise. The suite runs the same
#    script on the CPU (tests/sglang/test_pool_check.py).
# 6. checks kvctl on a real GPU holder (scripts/gpu_holder_check.py): a child titled
#    VLLM::EngineCore allocates 4 GiB with torch, its parent is SIGKILLed; inspect reports
#    it as an orphan with NVML's figure; gc --engines --kill-orphans --yes ends it; NVML
#    shows the memory back. The suite runs the same path on mknod'ed nodes and a
#    stand-in NVML (tests/fs/test_gpu_holders.py, tests/cli/test_gpu_cli.py).
#
# Prints exactly one line per check, "PASS name", "FAIL name: why" or
# "SKIP name: why" (a test skipped for a stated reason), then one summary
# line; exits non-zero on any failure. With $OUT set, the same output goes to
# $OUT/gpu-check.log, and the build, pytest and pages logs beside it.
#
# Needs: python3 with a CUDA torch and pytest, a C++ compiler, cuda.h (CUDA_HOME
# or /usr/local/cuda). Runs in well under 5 minutes on one GPU.
#
# Usage: bash scripts/gpu-check.sh        (PYTHON=... to choose the interpreter)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
RESULTS=$(mktemp)

# Appends check lines to RESULTS while showing them.
record() { tee -a "$RESULTS"; }

first_error_line() { grep -m1 -iE 'error|failed|exception' "$1" || tail -n1 "$1"; }

build() {
  if KVCACHED_REQUIRE_EXT=1 "$PY" setup.py build_ext --inplace >"$LOGS/gpu-check-build.log" 2>&1; then
    echo "PASS build"
  else
    echo "FAIL build: $(first_error_line "$LOGS/gpu-check-build.log")"
    return 1
  fi
  "$PY" - <<'PY'
from kvcached.runtime import _kvpages as k
n = k.cuda_device_count()
if not k.cuda_built():
    print("FAIL extension-cuda: built without the CUDA backend (cuda.h not found: set CUDA_HOME)")
elif n == 0:
    print(f"FAIL extension-cuda: no CUDA device: {k.cuda_unavailable_reason()}")
else:
    print(f"PASS extension-cuda: {n} device(s)")
PY
}

gpu_tests() {
  local xml="$LOGS/gpu-check-pytest.xml"
  rm -f "$xml"
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/ext/test_kvpages_cuda.py \
    --junitxml="$xml" >"$LOGS/gpu-check-pytest.log" 2>&1
  "$PY" - "$xml" "$LOGS/gpu-check-pytest.log" <<'PY'
import sys
import xml.etree.ElementTree as ET

xml, log = sys.argv[1:]
try:
    cases = list(ET.parse(xml).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    tail = open(log, errors="replace").read().strip().splitlines()[-1:] or ["no output"]
    print(f"FAIL test_kvpages_cuda: pytest wrote no report: {tail[0]}")
    sys.exit()
if not cases:
    print("FAIL test_kvpages_cuda: no test collected")
for case in cases:
    name = f"test:{case.get('name')}"
    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
    skipped = case.find("skipped")
    if bad is not None:
        why = (bad.get("message") or bad.text or "failed").strip().splitlines()[0]
        print(f"FAIL {name}: {why[:300]}")
    elif skipped is not None:
        print(f"SKIP {name}: {(skipped.get('message') or 'skipped').strip()[:300]}")
    else:
        print(f"PASS {name}")
PY
}

pages_checks() {
  local log="$LOGS/gpu-check-pages.log"
  timeout 120 "$PY" - 2>"$log" <<'PY' || { local rc=$?; echo "FAIL pages: died or timed out (exit $rc): $(tail -n1 "$log")"; }
import gc
import traceback

import torch

from kvcached.runtime.pages import Pages, as_tensor

PS = 2 << 20
WORDS = PS // 4   # float32 words per page
MiB = 1 << 20


def fill(t, page, seed):
    """Writes page `page` on the device: one arange kernel, one add kernel."""
    words = t[page * WORDS:(page + 1) * WORDS]
    torch.arange(WORDS, dtype=torch.float32, device=t.device, out=words)
    words.add_(seed)


def expect(t, page, seed):
    torch.cuda.synchronize()
    got = t[page * WORDS:(page + 1) * WORDS].cpu()
    want = torch.arange(WORDS, dtype=torch.float32) + seed
    if not torch.equal(got, want):
        bad = int((got != want).nonzero()[0])
        raise AssertionError(f"page {page} word {bad}: {got[bad].item()} != {want[bad].item()}")


def check_map_write_read(ctx):
    p = ctx["pages"] = Pages(8, PS, device="cuda")
    if p.device != f"cuda:{torch.cuda.current_device()}":
        raise AssertionError(f"'cuda' resolved to {p.device}")
    p.map([0, 3, 5])
    t = ctx["t"] = as_tensor(p, dtype=torch.float32)
    if t.data_ptr() != p.address or t.device.type != "cuda":
        raise AssertionError(f"tensor at {t.device} {t.data_ptr():#x}, range at {p.address:#x}")
    for page in (0, 3, 5):
        fill(t, page, seed=1000.0 * page)
    for page in (0, 3, 5):
        expect(t, page, seed=1000.0 * page)


def check_unmap_remap_write_read(ctx):
    p, t = ctx["pages"], ctx["t"]
    p.unmap(3)
    if p.mapped_pages() != [0, 5]:
        raise AssertionError(f"mapped after unmap: {p.mapped_pages()}")
    p.map([3, 7])
    for page in (3, 7):
        fill(t, page, seed=-7.0 * (page + 1))
    for page in (3, 7):
        expect(t, page, seed=-7.0 * (page + 1))
    for page in (0, 5):   # neighbours untouched by the unmap and remap
        expect(t, page, seed=1000.0 * page)


def check_close_refused_while_exported(ctx):
    try:
        ctx["pages"].close()
    except BufferError:
        return
    raise AssertionError("close() succeeded under a live tensor")


def check_memory_returned(ctx):
    del ctx["t"]
    gc.collect()
    ctx["pages"].close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if abs(ctx["free0"] - free) > 4 * MiB:
        raise AssertionError(f"free memory {ctx['free0']} before, {free} after")


# --- Hook: later checks --------------------------------------------------------
# Each entry of LATER_CHECKS prints one PASS/FAIL line like the checks above.


def _block_pool_cycle():
    """One full cycle of the elastic KV buffer on CUDA (see check_block_pool)."""
    from kvcached.runtime.kvbuffer import KVBuffer, LocalLink
    from kvcached.runtime.kvplan import Footprint

    layers, blocks, block = 4, 256, 32 * 1024
    region = blocks * block
    fp = Footprint.build(layers * region, blocks, [(block, l * region, block) for l in range(layers)])
    buf = KVBuffer(fp, PS, device="cuda")
    link = LocalLink(buf)
    agreed = link.setup(blocks)
    if (agreed.blocks_per_page, agreed.pages_per_group) != (64, layers):
        raise AssertionError(f"geometry {agreed}")
    raw = buf.tensor()
    if raw.device.type != "cuda" or raw.data_ptr() != buf.pages.address:
        raise AssertionError(f"buffer tensor on {raw.device} at {raw.data_ptr():#x}")
    # One view per layer, [blocks, 8 heads, 16 tokens, 128 halfs], as vLLM lays them out.
    views = [raw[l * region:(l + 1) * region].view(torch.float16).view(blocks, 8, 16, 128)
             for l in range(layers)]

    def write(group, seed):
        for l, v in enumerate(views):
            for b in buf.plan.block_range(group):
                v[b].fill_(float((seed + 7 * l + b) % 1000))

    def expect(group, seed):
        torch.cuda.synchronize()
        for l, v in enumerate(views):
            got = v[buf.plan.block_range(group).start:buf.plan.block_range(group).stop].cpu()
            for i, b in enumerate(buf.plan.block_range(group)):
                want = float((seed + 7 * l + b) % 1000)
                if not bool((got[i] == want).all()):
                    raise AssertionError(f"layer {l} block {b}: {got[i].flatten()[0].item()} != {want}")

    link.map([1, 3])
    if buf.mapped_bytes != 3 * layers * PS:
        raise AssertionError(f"{buf.mapped_bytes} bytes mapped for 3 groups (with group 0)")
    write(1, 11)
    write(3, 33)
    expect(1, 11)
    expect(3, 33)
    link.unmap([1])
    link.map([1])
    torch.cuda.synchronize()
    if any(bool((v[64:128].cpu() != 0).any()) for v in views):
        raise AssertionError("a remapped page does not read as zeros")
    write(1, 55)
    expect(1, 55)
    expect(3, 33)
    # Every tensor over the range must be gone before it can be closed (an export each).
    views.clear()
    del raw
    buf._flat = None
    gc.collect()
    link.unmap([1, 3])
    buf.pages.close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # torch's own cache is not our pages' memory


def check_block_pool(ctx):
    """The elastic KV buffer (what vLLM's layers become views of) on CUDA, blocks mapped by group.

    4 layers in vLLM's layer-outer layout, blocks of 32 KiB (16 tokens x 8
    heads x 64 x fp16 x K,V), 64 blocks per 2 MiB page: a group of blocks
    costs one page in each layer. Map groups, write every block of them with
    a kernel through per-layer views, read back; unmap a group and map it
    again: its blocks read as zeros (the buffer zeroes fresh CUDA pages) and
    take writes, the other group is untouched; at the end the memory is back.
    Needs no vLLM: this is the path vLLM's tensors take, below its classes.

    Run twice, memory compared over the second run: the first loads the CUDA
    modules of every kernel it launches (tens of MiB, torch's, not ours).
    """
    _block_pool_cycle()
    torch.cuda.synchronize()
    before, _ = torch.cuda.mem_get_info()
    _block_pool_cycle()
    free, _ = torch.cuda.mem_get_info()
    if abs(before - free) > 4 * MiB:
        raise AssertionError(f"free memory {before} before the second cycle, {free} after")


LATER_CHECKS: list = [("block-pool", check_block_pool)]

CHECKS = [
    ("pages-map-write-read", check_map_write_read),
    ("pages-unmap-remap-write-read", check_unmap_remap_write_read),
    ("pages-close-refused-while-exported", check_close_refused_while_exported),
    ("pages-memory-returned", check_memory_returned),
    *LATER_CHECKS,
]

def warm_up():
    """Torch's own first-use costs (kernel modules, allocator) must not count as our pages' memory."""
    t = torch.empty(2 * WORDS, dtype=torch.float32, device="cuda")
    fill(t, 1, 3.0)
    expect(t, 1, 3.0)
    del t
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


torch.cuda.init()
warm_up()
ctx = {"free0": torch.cuda.mem_get_info()[0]}
for name, check in CHECKS:
    try:
        check(ctx)
    except Exception as e:  # noqa: BLE001 - every failure becomes one FAIL line
        where = traceback.extract_tb(e.__traceback__)[-1]
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        print(f"FAIL {name}: {why} (line {where.lineno})", flush=True)
    else:
        print(f"PASS {name}", flush=True)
PY
}

sglang_pool_checks() {
  local log="$LOGS/gpu-check-sglang.log"
  timeout 240 "$PY" scripts/sglang_pool_check.py cuda 2>"$log" \
    || { local rc=$?; [[ $rc -eq 1 ]] || echo "FAIL sglang-pool: died or timed out (exit $rc): $(tail -n1 "$log")"; }
}

gpu_holder_checks() {
  local log="$LOGS/gpu-check-holders.log"
  timeout 240 "$PY" scripts/gpu_holder_check.py 4 2>"$log" \
    || { local rc=$?; [[ $rc -eq 1 ]] || echo "FAIL gpu-holders: died or timed out (exit $rc): $(tail -n1 "$log")"; }
}

main() {
  echo "# gpu-check $(git rev-parse --short HEAD 2>/dev/null || echo '?') on" \
       "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n1 || echo 'no nvidia-smi')"
  if build | record && ! grep -q '^FAIL' "$RESULTS"; then
    gpu_tests | record
    pages_checks | record
    sglang_pool_checks | record
    gpu_holder_checks | record
  fi
  local passed failed skipped
  passed=$(grep -c '^PASS ' "$RESULTS")
  failed=$(grep -c '^FAIL ' "$RESULTS")
  skipped=$(grep -c '^SKIP ' "$RESULTS")
  echo "gpu-check: $passed passed, $failed failed, $skipped skipped"
  [[ $failed -eq 0 ]]
}

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  main 2>&1 | tee "$OUT/gpu-check.log"
  status=${PIPESTATUS[0]}
else
  main 2>&1
  status=$?
fi
rm -f "$RESULTS"
exit "$status"
