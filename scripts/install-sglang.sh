#!/usr/bin/env bash
# Make SGLang 0.5.23 importable without a GPU, in the *current* Python (activate
# the venv first), next to vLLM 0.33 (scripts/install-vllm.sh runs first). Used
# by the Makefile's test target and by developers before the SGLang tests
# (tests/sglang).
#
# SGLang's own dependency set wants a CUDA torch 2.14.1 and a pile of GPU
# kernels, so SGLang goes in with --no-deps and we add only what the modules we
# drive import at import time. Every version is pinned; torch==2.13.0 is on
# every install line so that nothing can replace the local CPU build; the
# packages vLLM's script pinned keep vLLM's versions (its PINS block is read
# from scripts/install-vllm.sh and used as constraints here too), so this
# script adds packages and never changes one vLLM's modules use.
#
# Two wheels are CUDA builds with no CPU twin on the index:
# - torchvision 0.28.0 (the release built against torch 2.13) goes in --no-deps
#   (its metadata pulls a CUDA torch and its nvidia-* packages otherwise). Its
#   _C library cannot load without libtorch_cuda, and then its import fails on
#   two operator schemas it never defines (torchvision::nms, ::qnms). Once it
#   is installed, transformers imports it in vLLM's processes too; so this
#   script puts scripts/torchvision_cpu_ops.py into the venv's site-packages
#   with a .pth file that arms it at interpreter start: it declares the two
#   schemas when torchvision is first imported (the one stub; docs/SGLANG.md).
# - triton 3.7.1 (what torch 2.14.1 brings with SGLang) goes in --no-deps: it
#   imports on a CPU machine, and SGLang's kernel modules decorate with it at
#   import time; nothing here launches a kernel.
#
# Idempotent: exits at once when the modules already import. Fast when warm:
# the wheels are kept in the same wheelhouse as vLLM's (KVCACHED_WHEELHOUSE,
# default ~/.cache/kvcached/wheels) and installed from it offline. Quiet: pip's
# output is shown only when a step fails.
#
# Usage: bash scripts/install-sglang.sh [--force]
set -euo pipefail

PY=${PYTHON:-python}
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
WHEELHOUSE=${KVCACHED_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcached/wheels}
HERE=$(cd "$(dirname "$0")" && pwd)

# What the tests drive and the integration will hook (docs/SGLANG.md says why each).
MODULES=(
    sglang.srt.plugins
    sglang.srt.plugins.hook_registry
    sglang.srt.platforms
    sglang.srt.utils
    sglang.srt.utils.watchdog
    sglang.srt.utils.stale_shm_cleanup
    sglang.srt.server_args
    sglang.srt.distributed.parallel_state
    sglang.srt.mem_cache.memory_pool
    sglang.srt.mem_cache.allocator
    sglang.srt.mem_cache.radix_cache
    sglang.srt.mem_cache.kv_cache_configurator
    sglang.srt.model_executor.model_runner
    sglang.srt.managers.scheduler
    sglang.srt.managers.tokenizer_manager
    sglang.srt.managers.data_parallel_controller
    sglang.srt.managers.detokenizer_manager
    sglang.srt.entrypoints.engine
    sglang.srt.entrypoints.http_server
    sglang.launch_server
)

NODEPS=(
    "sglang==$SGLANG_VERSION"
    torchvision==0.28.0
    triton==3.7.1
)

# The import-time packages SGLang's modules need beyond what vLLM's script
# installed (IPython: `import sglang` reaches sglang.lang's notebook helpers;
# dill, sentencepiece, gguf, compressed-tensors: the model and quantization
# modules the scheduler imports; setproctitle: every process titles itself (its pin is vLLM's);
# uvicorn and python-multipart: the HTTP server module, whose form routes
# FastAPI refuses to build without it; soundfile: the multimodal processors).
TOP=(
    orjson IPython dill sentencepiece compressed-tensors gguf uvicorn
    python-multipart setproctitle soundfile
)

# The versions tested together: SGLang's own pin where its metadata has one
# (compressed-tensors, sentencepiece, soundfile), else the release current when
# this was written. Everything vLLM's script pins is added from that script.
PINS='
asttokens==3.0.2
cffi==2.1.1
compressed-tensors==0.18.0
dill==0.4.1
executing==2.3.0
gguf==0.19.0
ipython==9.18.1
ipython_pygments_lexers==1.1.1
jedi==0.20.1
loguru==0.7.3
matplotlib-inline==0.2.2
orjson==3.13.0
parso==0.8.7
pexpect==4.9.0
prompt_toolkit==3.0.53
ptyprocess==0.7.0
pure_eval==0.2.4
python-multipart==0.0.34
pycparser==3.12
sentencepiece==0.2.1
soundfile==0.13.1
stack-data==0.6.3
traitlets==5.16.1
uvicorn==0.54.0
wcwidth==0.9.4
'

FORCE=0
[[ ${1:-} == --force ]] && FORCE=1

importable() {
    WANT_SGLANG=$SGLANG_VERSION "$PY" - "${MODULES[@]}" >/dev/null 2>&1 <<'EOF'
import importlib, os, sys, warnings
warnings.simplefilter("ignore")
import torch
for m in sys.argv[1:]:
    importlib.import_module(m)
from importlib.metadata import version
assert version("sglang") == os.environ["WANT_SGLANG"], version("sglang")
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
EOF
}

LOG=$(mktemp -t install-sglang.XXXXXX)
CONSTRAINTS=$(mktemp -t install-sglang-pins.XXXXXX)
SCRATCH=$(mktemp -d -t install-sglang-scratch.XXXXXX)
trap 'rm -rf "$LOG" "$CONSTRAINTS" "$SCRATCH"' EXIT
# Importing SGLang points torch's, triton's and flashinfer's caches under
# SGLANG_CACHE_DIR (~/.cache/sglang) unless set: the checks keep them in a
# directory removed on exit, so an install leaves nothing behind.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$SCRATCH/inductor}
export SGLANG_CACHE_DIR=${SGLANG_CACHE_DIR:-$SCRATCH/sglang}

# vLLM's pins first, then ours: a package in both would be a conflict pip reports.
sed -n "/^PINS='/,/^'/p" "$HERE/install-vllm.sh" | sed '1d;$d' >"$CONSTRAINTS"
printf '%s\n' "$PINS" >>"$CONSTRAINTS"
sed -i '/^$/d' "$CONSTRAINTS"
if ! grep -q '^numpy==' "$CONSTRAINTS"; then
    echo "install-sglang: could not read vLLM's pins from $HERE/install-vllm.sh" >&2
    exit 1
fi

# The torchvision shim: a module and the .pth line that arms it, refreshed on every run (cheap, idempotent).
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
install_shim() {
    cp "$HERE/torchvision_cpu_ops.py" "$SITE/_kvcached_torchvision_cpu.py"
    echo "import _kvcached_torchvision_cpu; _kvcached_torchvision_cpu.install()" >"$SITE/_kvcached_torchvision_cpu.pth"
}
install_shim

step() {
    local what=$1
    shift
    if ! "$@" >>"$LOG" 2>&1; then
        echo "install-sglang: $what failed:" >&2
        grep -v 'is ignored: it is neither a file nor a directory' "$LOG" | tail -40 >&2
        return 1
    fi
}

pipq() { "$PY" -m pip -q --disable-pip-version-check "$@"; }

if [[ $FORCE == 0 ]] && importable; then
    echo "install-sglang: SGLang $SGLANG_VERSION already importable"
    exit 0
fi

start=$SECONDS

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "install-sglang: torch $TORCH_VERSION is not installed here; run scripts/install-vllm.sh first" >&2
    exit 1
fi

# Our pins are the whole closure (what the TOP packages resolve to, less what
# vLLM's script already installed): downloaded one by one without dependencies,
# so that nothing pulls a second copy of torch into the wheelhouse.
OURS=()
while read -r pin; do [[ -n $pin ]] && OURS+=("$pin"); done <<<"$PINS"

install_offline() {
    pipq install --no-index --find-links "$WHEELHOUSE" --no-deps "${NODEPS[@]}" "torch==$TORCH_VERSION" &&
        pipq install --no-index --find-links "$WHEELHOUSE" -c "$CONSTRAINTS" "${TOP[@]}" "torch==$TORCH_VERSION"
}

mkdir -p "$WHEELHOUSE"
if ! install_offline >>"$LOG" 2>&1; then
    step "downloading wheels into $WHEELHOUSE" pipq download -d "$WHEELHOUSE" --no-deps "${NODEPS[@]}" "${OURS[@]}"
    step "installing from $WHEELHOUSE" install_offline
fi

if ! importable; then
    echo "install-sglang: installed, but the SGLang modules still do not import:" >&2
    "$PY" - "${MODULES[@]}" 2>&1 <<'EOF' | sed 's/^/  /' >&2
import importlib, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except BaseException as e:
        print(f"{m}: {type(e).__name__}: {e}")
EOF
    exit 1
fi
echo "install-sglang: SGLang $SGLANG_VERSION importable ($((SECONDS - start))s)"
