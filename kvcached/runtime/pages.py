"""Typed wrapper over the compiled page extension, and a zero-copy tensor view.

A `Pages` object is one reserved virtual range of ``num_pages`` pages of
``page_size`` bytes (default 2 MiB) on the CPU (memfd backend) or a CUDA
device (driver VMM backend). Pages are mapped and unmapped by index; touching
an unmapped page faults. CPU pages read as zeros each time they are mapped;
CUDA pages are not zeroed. Map and unmap are thread-safe (the extension
releases the GIL and locks the range).

The range exports itself through DLPack (`as_tensor`, ``torch.from_dlpack``):
each tensor made from it counts as an export, `Pages.close` is refused while
one lives, and the range stays reserved until the last one is freed, so a
stale tensor can never reach addresses that a later range was given.

Processes: a CUDA range belongs to the process that created it. In a forked
child, mapping, unmapping, closing or exporting it raises `ForkedError`, and
dropping it makes no driver call. A CPU range is MAP_SHARED over a memfd: a
forked child shares its pages, so mapping or unmapping in the child would
change the parent's memory: don't.

torch is imported only by `as_tensor`; `resolve_device` only looks at a torch
that is imported already.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvcached.runtime import _kvpages

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_SIZE: int = _kvpages.DEFAULT_PAGE_SIZE

#: A CUDA driver call failed; ``.name`` is the CUresult name, ``.code`` its number.
CudaError = _kvpages.CudaError
#: The CUDA backend cannot run here (built without cuda.h, or no libcuda.so.1).
CudaUnavailableError = _kvpages.CudaUnavailableError
#: A CUDA range was used in a process other than its creator (a forked child).
ForkedError = _kvpages.ForkedError
#: unmap failed for some pages: ``.unmapped`` lost their contents, ``.failed`` stay mapped.
PartialUnmapError = _kvpages.PartialUnmapError


def cuda_built() -> bool:
    """Whether the extension was compiled with the CUDA backend."""
    return bool(_kvpages.cuda_built())


def cuda_device_count() -> int:
    """CUDA devices visible here; 0 without a driver, a device or CUDA support.

    It does not initialise the CUDA driver (cuInit), which torch could not
    see and which would leave workers forked afterwards unable to use CUDA:
    it asks the driver only if this process initialised it already, and
    otherwise counts the GPUs the NVIDIA kernel module lists in
    /proc/driver/nvidia/gpus (``$KVCACHED_NVIDIA_GPUS_DIR`` overrides),
    narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA does. Only where that listing
    is missing (some sandboxes) does it fall back to cuInit: after that, fork
    no CUDA workers from this process (use the spawn start method).
    """
    return int(_kvpages.cuda_device_count())


def cuda_unavailable_reason() -> str | None:
    """Why ``device="cuda"`` cannot work here, or None; initialises CUDA only as `cuda_device_count`."""
    return _kvpages.cuda_unavailable_reason()


def resolve_device(device: str) -> str:
    """``"cuda"`` as the caller's current device, ``"cuda:N"``; other devices unchanged.

    The current device is, in order: the device of the CUDA context current
    on the calling thread; torch's current device, if torch is imported
    already and has initialised CUDA (never imported for this); else 0. So
    each tensor-parallel worker, given the same ``"cuda"``, maps on its own GPU.
    """
    if device != "cuda":
        return device
    current = _kvpages.cuda_current_device()
    if current is None:
        current = _torch_current_device()
    return f"cuda:{0 if current is None else current}"


def _torch_current_device() -> int | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.current_device())
    except (AttributeError, RuntimeError):  # a torch without CUDA, or in a bad fork
        return None


def os_page_size() -> int:
    """The kernel page size: CPU page sizes must be a multiple of it."""
    return int(_kvpages.os_page_size())


class Pages:
    """A reserved range of pages mapped and unmapped by index."""

    __slots__ = ("_range",)

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, *,
                 device: str = "cpu") -> None:
        """Reserve the range; ``device`` is ``"cpu"``, ``"cuda:N"`` or ``"cuda"`` (see `resolve_device`)."""
        self._range = _kvpages.PageRange(num_pages, page_size, device=resolve_device(device))

    @property
    def raw(self) -> _kvpages.PageRange:
        """The extension's PageRange (DLPack export; the buffer protocol on the CPU)."""
        return self._range

    @property
    def num_pages(self) -> int:
        """Number of pages in the range."""
        return int(self._range.num_pages)

    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return int(self._range.page_size)

    @property
    def size(self) -> int:
        """Bytes in the whole range."""
        return int(self._range.size)

    @property
    def address(self) -> int:
        """Start of the range: a host address, or a CUDA device address."""
        return int(self._range.address)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return str(self._range.device)

    @property
    def num_mapped(self) -> int:
        """Number of pages mapped now."""
        return int(self._range.num_mapped)

    @property
    def mapped_bytes(self) -> int:
        """Physical memory held by mapped pages, in bytes."""
        return self.num_mapped * self.page_size

    @property
    def closed(self) -> bool:
        """Whether `close` has run."""
        return bool(self._range.closed)

    def map(self, pages: int | Iterable[int]) -> None:
        """Map one page or several, all or nothing (ValueError if one is mapped already)."""
        self._range.map(pages)

    def unmap(self, pages: int | Iterable[int]) -> None:
        """Unmap one page or several and return their memory.

        A bad request (a page not mapped, a repeat) changes nothing. A driver
        failure part way does not roll back, since a page mapped again would
        come back with other memory anyway: the other pages are unmapped all
        the same and `PartialUnmapError` says which were (``.unmapped``) and
        which stay mapped (``.failed``); `mapped_pages` agrees with it.
        """
        self._range.unmap(pages)

    def is_mapped(self, index: int) -> bool:
        """Whether page `index` is mapped."""
        return bool(self._range.is_mapped(index))

    def mapped_pages(self) -> list[int]:
        """The mapped page indices, ascending."""
        return self._range.mapped_pages()

    def page_offset(self, index: int) -> int:
        """Byte offset of page `index` in the range (upstream's IPC offsets)."""
        if not 0 <= index < self.num_pages:
            raise IndexError(f"page index {index} out of range for {self.num_pages} pages")
        return index * self.page_size

    def buffer(self) -> memoryview:
        """A writable byte view of the whole range (CPU only); unmapped pages fault."""
        return memoryview(self._range)

    def close(self) -> None:
        """Unmap every page and release the range; idempotent.

        Refused (BufferError) while a tensor or buffer view of the range lives.
        A CUDA page that cannot be unmapped keeps the whole range reserved
        (leaked, not freed under a live mapping) and raises `CudaError`.
        """
        self._range.close()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """The range as a DLPack capsule (1-D uint8), for ``torch.from_dlpack(pages)``."""
        return self._range.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(device_type, device_id)``: (1, 0) for the CPU, (2, N) for ``cuda:N``."""
        return self._range.__dlpack_device__()

    def __enter__(self) -> Pages:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._range)


def as_tensor(pages: Pages, dtype: torch.dtype | None = None,
              shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A zero-copy torch tensor over the whole range (default: flat uint8).

    Made through DLPack on both devices (no numpy needed): the tensor, and
    every view of it, holds an export of the range, so `Pages.close` is
    refused while it lives and the range is freed only after the last one
    goes. Touching an unmapped page through the tensor faults like any other
    access.
    """
    import torch

    dtype = torch.uint8 if dtype is None else dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    if pages.size % itemsize:
        raise ValueError(f"range of {pages.size} bytes is not a whole number of {dtype}")
    flat = torch.from_dlpack(pages.raw).view(dtype)
    return flat if shape is None else flat.view(shape)
