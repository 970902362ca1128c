"""Typed wrapper over the compiled page extension, and a zero-copy tensor view.

A `Pages` object is one reserved virtual range of ``num_pages`` pages of
``page_size`` bytes (default 2 MiB) on the CPU (memfd backend) or a CUDA
device (driver VMM backend). Pages are mapped and unmapped by index; touching
an unmapped page faults. CPU pages read as zeros each time they are mapped;
CUDA pages are not zeroed. Map and unmap are thread-safe (the extension
releases the GIL and locks the range). A CPU range is MAP_SHARED over a memfd:
a forked child shares its pages, so mapping or unmapping in the child would
change the parent's memory: don't.

torch is imported only by `as_tensor`.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from kvcached import _kvpages

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_SIZE: int = _kvpages.DEFAULT_PAGE_SIZE

#: A CUDA driver call failed; ``.name`` is the CUresult name, ``.code`` its number.
CudaError = _kvpages.CudaError
#: The CUDA backend cannot run here (built without cuda.h, or no libcuda.so.1).
CudaUnavailableError = _kvpages.CudaUnavailableError


def cuda_built() -> bool:
    """Whether the extension was compiled with the CUDA backend."""
    return bool(_kvpages.cuda_built())


def cuda_device_count() -> int:
    """CUDA devices usable now; 0 without a driver, a device or CUDA support."""
    return int(_kvpages.cuda_device_count())


def cuda_unavailable_reason() -> str | None:
    """Why ``device="cuda"`` cannot work here, or None when it can."""
    return _kvpages.cuda_unavailable_reason()


def os_page_size() -> int:
    """The kernel page size: CPU page sizes must be a multiple of it."""
    return int(_kvpages.os_page_size())


class Pages:
    """A reserved range of pages mapped and unmapped by index."""

    __slots__ = ("_range",)

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, *,
                 device: str = "cpu") -> None:
        self._range = _kvpages.PageRange(num_pages, page_size, device=device)

    @property
    def raw(self) -> _kvpages.PageRange:
        """The extension's PageRange (supports the buffer protocol on the CPU)."""
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
        """Unmap one page or several and return their memory, all or nothing."""
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
        """Unmap every page and release the range; idempotent."""
        self._range.close()

    def __enter__(self) -> Pages:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._range)


class _CudaArray:
    """Exposes a CUDA range through ``__cuda_array_interface__`` (v3) for torch."""

    def __init__(self, pages: Pages, nbytes: int) -> None:
        # Held so that the range outlives every tensor made from this view.
        self._pages = pages
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pages.address, False),
            "version": 3,
            # No stream: the range is memory, not work; callers order their own.
            "stream": None,
        }


def as_tensor(pages: Pages, dtype: torch.dtype | None = None,
              shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A zero-copy torch tensor over the whole range (default: flat uint8).

    On the CPU the tensor holds a buffer view, so `Pages.close` is refused
    while the tensor lives. On CUDA the tensor keeps the range object alive but
    close() is not prevented: do not close a CUDA range under live tensors.
    Touching an unmapped page through the tensor faults like any other access.
    """
    import torch

    dtype = torch.uint8 if dtype is None else dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    if pages.size % itemsize:
        raise ValueError(f"range of {pages.size} bytes is not a whole number of {dtype}")
    if pages.device == "cpu":
        flat = torch.frombuffer(pages.buffer(), dtype=dtype)
    else:
        raw = torch.as_tensor(_CudaArray(pages, pages.size), device=pages.device)
        flat = raw.view(dtype)
    return flat if shape is None else flat.view(shape)
