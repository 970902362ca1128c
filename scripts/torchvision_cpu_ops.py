"""Declare torchvision's two unconditional operator schemas before torchvision is imported, on a CPU torch.

scripts/install-sglang.sh installs this module into the venv's site-packages
(as `_kvcached_torchvision_cpu`, run at interpreter start by a .pth file of
the same name) because the only torchvision 0.28.0 wheel, the release built
for torch 2.13, is a CUDA build. Its C library cannot load without
libtorch_cuda, so the operators it defines are missing, and
`torchvision._meta_registrations` then fails on the two it registers
unconditionally (`torchvision::nms`, `torchvision::qnms`: "operator
torchvision::nms does not exist"). Once SGLang has put torchvision in the venv,
transformers imports it for vLLM too, so every process of the venv needs this,
not only SGLang's. Declaring the two schemas, with the signatures torchvision's
C++ gives them, is enough; neither operator has a kernel, so a call fails
loudly instead of computing anything.

Lazy: a meta-path finder that finds nothing; when something first looks up
`torchvision`, it declares the schemas (importing torch) and removes itself.
"""

from __future__ import annotations

import sys

SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
OPS = ("nms", "qnms")


def declare() -> None:
    """Declare the two schemas unless a torchvision library already defined them."""
    import torch

    for op in OPS:
        if not hasattr(torch.ops.torchvision, op):
            # torch.library.define keeps the definition alive for the process's life.
            torch.library.define(f"torchvision::{op}", SCHEMA)


class DeclareBeforeTorchvision:
    """Runs `declare()` the first time `torchvision` is looked up; never finds a module itself."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's finder protocol
        if name == "torchvision":
            sys.meta_path.remove(self)
            declare()
        return None


def install() -> None:
    """Put the finder first on sys.meta_path, once."""
    if not any(isinstance(f, DeclareBeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, DeclareBeforeTorchvision())
