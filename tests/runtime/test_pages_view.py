"""kvcached.runtime.pages: the typed wrapper and the zero-copy torch view (CPU)."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

from kvcached.runtime.pages import DEFAULT_PAGE_SIZE, Pages, as_tensor  # noqa: E402

pytestmark = pytest.mark.ext

PS = 64 * 1024


def test_wrapper_reports_state():
    with Pages(4, PS) as p:
        assert (p.num_pages, p.page_size, p.size, p.device) == (4, PS, 4 * PS, "cpu")
        p.map([1, 3])
        assert p.mapped_pages() == [1, 3]
        assert p.num_mapped == 2 and p.mapped_bytes == 2 * PS
        assert p.is_mapped(3) and not p.is_mapped(0)
        assert p.page_offset(3) == 3 * PS
        with pytest.raises(IndexError):
            p.page_offset(4)
        p.unmap(1)
        assert p.mapped_pages() == [3]
    assert p.closed
    assert DEFAULT_PAGE_SIZE == 2 << 20


def test_tensor_view_is_zero_copy():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    with Pages(4, PS) as p:
        p.map(2)
        t = as_tensor(p, dtype=torch.float16, shape=(4, PS // 2))
        assert t.shape == (4, PS // 2) and t.dtype == torch.float16
        assert t.data_ptr() == p.address
        t[2, :3] = torch.tensor([1.5, 2.5, 3.5])
        raw = p.buffer()
        assert bytes(raw[2 * PS:2 * PS + 6]) == struct.pack("=3e", 1.5, 2.5, 3.5)
        raw.release()
        # The tensor pins a buffer view, so the range cannot close under it.
        with pytest.raises(BufferError):
            p.close()
        p.unmap(2)
        p.map(2)
        assert torch.count_nonzero(t[2]).item() == 0
        del t
        p.close()



def test_tensor_keeps_the_range_alive_and_closed_only_after_it():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    p = Pages(2, PS)
    p.map(0)
    t = torch.from_dlpack(p)          # the wrapper exports like the raw range
    assert (t.device.type, t.dtype, t.shape, t.data_ptr()) == ("cpu", torch.uint8, (2 * PS,), p.address)
    view = t[8:16].view(torch.int64)
    del t
    with pytest.raises(BufferError, match="export"):
        p.close()                     # a view of the tensor still holds the export
    view[0] = 42
    del p                             # the range must outlive its last tensor
    assert view[0].item() == 42
    del view
