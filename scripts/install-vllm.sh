#!/usr/bin/env bash
# Make vLLM importable without a GPU, in the *current* Python (activate the
# venv first): VERSION, one of VERSIONS below (default VLLM_DEFAULT). Used by
# the Makefile (0.34.0 in .venv, 0.33.0 in .venv-vllm033), .ci/run through it,
# and by developers before the vLLM integration tests (tests/vllm).
#
# vLLM's own dependency set wants a CUDA torch 2.14 and a pile of GPU kernels,
# so vLLM goes in with --no-deps and we add only what its modules import at
# import time. Every version is pinned (tested together); torch comes from the
# machine's local CPU wheel (a range would pull a multi-GB CUDA build).
#
# Idempotent: exits at once when the modules already import. Fast when warm:
# wheels are kept in a wheelhouse (KVCACHED_WHEELHOUSE, default
# ~/.cache/kvcached/wheels) and installed from it offline, because pip's own
# HTTP cache is not reliable on every machine. Quiet: pip's output is shown
# only when a step fails.
#
# The import-time set below holds for every version in VERSIONS: each was
# installed with it and its tests/vllm run (docs/VLLM.md, "Versions"). Their
# declared requirements differ only in packages we do not install (0.34 raises
# its lower bounds of filelock, mistral_common, opentelemetry; its transformers
# range, <5.23, contains 0.33's, <5.21, and the pin).
#
# Usage: bash scripts/install-vllm.sh [--force] [VERSION]
# Exit status: 0 importable; 1 an install step failed; 2 usage (an unknown VERSION).
set -euo pipefail

PY=${PYTHON:-python}
TORCH_VERSION=2.13.0
VLLM_DEFAULT=0.34.0
# The proven range: kvcached.integration.vllm.common.PROVEN_VERSIONS is the same list.
VERSIONS=(
    0.33.0
    0.34.0
)

FORCE=0
VLLM_VERSION=$VLLM_DEFAULT
for arg in "$@"; do
    case $arg in
        --force) FORCE=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            if [[ " ${VERSIONS[*]} " != *" $arg "* ]]; then
                echo "install-vllm: unknown version '$arg' (this script knows ${VERSIONS[*]})" >&2
                exit 2
            fi
            VLLM_VERSION=$arg
            ;;
    esac
done
WHEELHOUSE=${KVCACHED_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcached/wheels}

# What the integration needs to import (see docs/VLLM.md for why each).
MODULES=(
    vllm.v1.engine.core_client
    vllm.v1.engine.utils
    vllm.v1.engine.core
    vllm.v1.executor.multiproc_executor
    vllm.engine.arg_utils
    vllm.distributed.kv_transfer
    vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector
    vllm.plugins
    vllm.v1.worker.utils
    vllm.v1.worker.gpu.attn_utils
    vllm.v1.core.sched.scheduler
)

# xgrammar is imported by vllm.parser at import time, but its metadata pulls
# triton (about 1 GB, useless without a GPU): install it and its FFI runtime
# without dependencies.
NODEPS=(
    "vllm==$VLLM_VERSION"
    xgrammar==0.2.8
    apache-tvm-ffi==0.1.15.post2
)

# The import-time packages vLLM's modules need (einops: the worker's KV cache
# allocation, vllm.v1.worker.utils, which the elastic KV tests drive). oss-harmony is vLLM 0.33's own
# declared dependency (a fork of openai-harmony); it provides `openai_harmony`. setproctitle:
# vLLM titles its processes (VLLM::EngineCore, VLLM::Worker_TP<r>) only where it imports, and
# kvctl finds a serve's processes by those titles (tests/vllm/test_published.py).
TOP=(
    packaging msgspec regex cbor2 pyzmq urllib3 transformers aiohttp requests
    oss-harmony openai pillow pybase64 cachetools prometheus_client cloudpickle
    uvloop py-cpuinfo fastapi partial_json_parser llguidance psutil numpy
    einops setproctitle
)

# The versions tested together (everything those resolve to, less torch's own
# dependencies, which come with the torch wheel).
PINS='
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
cachetools==8.0.2
cbor2==6.3.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
einops==0.8.2
click==8.5.1
cloudpickle==3.1.3
fastapi==0.136.3
frozenlist==1.8.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
jiter==0.19.0
llguidance==1.7.6
markdown-it-py==4.3.0
mdurl==0.1.2
msgspec==0.23.0
multidict==7.2.1
numpy==2.4.6
openai==3.57.0
oss-harmony==0.0.11
packaging==26.4
partial-json-parser==0.2.1.1.post7
pillow==13.0.0
prometheus_client==0.26.0
propcache==0.5.4
psutil==7.2.2
py-cpuinfo==9.0.0
pybase64==1.5.1
pydantic==2.14.4
pydantic_core==2.50.5
PyYAML==6.0.4
pyzmq==27.3.0
regex==2026.11.19
requests==2.34.2
safetensors==0.8.0
setproctitle==1.3.8
sniffio==1.3.1
starlette==1.10.0
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.20.2
truststore==0.10.5
typing-inspection==0.4.5
urllib3==2.8.0
uvloop==0.23.0
yarl==1.25.1
'

importable() {
    WANT_VLLM=$VLLM_VERSION "$PY" - "${MODULES[@]}" >/dev/null 2>&1 <<'EOF'
import importlib, os, sys, warnings
warnings.simplefilter("ignore")
for m in sys.argv[1:]:
    importlib.import_module(m)
import vllm
assert vllm.__version__ == os.environ["WANT_VLLM"], vllm.__version__
EOF
}

LOG=$(mktemp -t install-vllm.XXXXXX)
CONSTRAINTS=$(mktemp -t install-vllm-pins.XXXXXX)
SCRATCH=$(mktemp -d -t install-vllm-scratch.XXXXXX)
trap 'rm -rf "$LOG" "$CONSTRAINTS" "$SCRATCH"' EXIT
# Importing vLLM makes torch create its inductor cache (/tmp/torchinductor_<user>): the
# checks below keep it in a directory removed on exit, so an install leaves nothing in /tmp.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$SCRATCH/inductor}
printf '%s\n' "$PINS" | sed '/^$/d' >"$CONSTRAINTS"

# Run a step with its output kept aside; print it only when the step fails.
step() {
    local what=$1
    shift
    if ! "$@" >>"$LOG" 2>&1; then
        echo "install-vllm: $what failed:" >&2
        grep -v 'is ignored: it is neither a file nor a directory' "$LOG" | tail -40 >&2
        return 1
    fi
}

pipq() { "$PY" -m pip -q --disable-pip-version-check "$@"; }

if [[ $FORCE == 0 ]] && importable; then
    echo "install-vllm: vLLM $VLLM_VERSION already importable"
    exit 0
fi

start=$SECONDS

# torch: the local CPU wheel. A torch already at this version is kept.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    step "torch==$TORCH_VERSION" pipq install "torch==$TORCH_VERSION"
    if ! "$PY" -c "import torch, sys; sys.exit('+cpu' not in torch.__version__)" 2>/dev/null; then
        echo "install-vllm: warning: torch is not a +cpu build; this machine has no local CPU wheel" >&2
    fi
fi

# Install from the wheelhouse offline; fill it from the index only when a
# wheel is missing (first run, or after a pin changed).
install_offline() {
    pipq install --no-index --find-links "$WHEELHOUSE" --no-deps "${NODEPS[@]}" &&
        pipq install --no-index --find-links "$WHEELHOUSE" -c "$CONSTRAINTS" "${TOP[@]}"
}

mkdir -p "$WHEELHOUSE"
if ! install_offline >>"$LOG" 2>&1; then
    step "downloading wheels into $WHEELHOUSE" pipq download -d "$WHEELHOUSE" --no-deps "${NODEPS[@]}"
    step "downloading wheels into $WHEELHOUSE" pipq download -d "$WHEELHOUSE" -c "$CONSTRAINTS" "${TOP[@]}"
    step "installing from $WHEELHOUSE" install_offline
fi

if ! importable; then
    echo "install-vllm: installed, but the vLLM modules still do not import:" >&2
    for m in "${MODULES[@]}"; do
        "$PY" -c "import $m" 2>&1 | tail -1 | sed "s/^/  $m: /" >&2
    done
    exit 1
fi
echo "install-vllm: vLLM $VLLM_VERSION importable ($((SECONDS - start))s)"
