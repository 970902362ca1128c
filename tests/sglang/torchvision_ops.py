"""The one stub SGLang 0.5.23 needs on this CPU machine: two torchvision operator schemas.

`import sglang` reaches torchvision (through transformers' image utilities, and
directly from sglang.srt.configs). The only torchvision 0.28.0 wheel built for
torch 2.13 is a CUDA build: its C library cannot load without libtorch_cuda, so
the operators it defines are missing, and `torchvision._meta_registrations`
then fails on the two it registers unconditionally (`torchvision::nms`,
`torchvision::qnms`: "operator torchvision::nms does not exist"). Declaring
those two schemas, the signatures torchvision's C++ gives them, is enough for
the import; nothing here calls either operator (neither has a kernel, so a
call would fail loudly rather than compute something wrong).
tests/sglang/test_install.py shows the import failing without it.
"""

from __future__ import annotations

SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
OPS = ("nms", "qnms")


def declare() -> None:
    """Declare the two schemas unless a torchvision library already defined them."""
    import torch

    for op in OPS:
        if not hasattr(torch.ops.torchvision, op):
            # torch.library.define keeps the definition alive for the process's life.
            torch.library.define(f"torchvision::{op}", SCHEMA)
