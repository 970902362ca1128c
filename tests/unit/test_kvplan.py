"""The page plan as tables: which physical pages each group of blocks needs, for the layouts vLLM 0.33 uses."""

from __future__ import annotations

import pytest

from kvcached.runtime.kvplan import (
    Footprint,
    PagePlan,
    agree_blocks_per_page,
    merge_runs,
    min_blocks_per_page,
)

P = 64 * 1024  # page size in these tables


def layer_outer(layers: int, blocks: int, page: int, heads: int = 1) -> Footprint:
    """LBHNC/LBNHC: each layer a region of `blocks` pages of `page` bytes (block stride = page)."""
    region = blocks * page
    return Footprint.build(layers * region, blocks, [(page, layer * region, page) for layer in range(layers)])


def block_outer(layers: int, blocks: int, page: int) -> Footprint:
    """BLHNC: every block holds all layers' pages side by side (block stride = layers * page)."""
    return Footprint.build(
        layers * blocks * page, blocks, [(layers * page, layer * page, page) for layer in range(layers)]
    )


def head_outer(layers: int, blocks: int, heads: int, row: int) -> Footprint:
    """LHBNC: per layer, per head, a region of `blocks` rows of `row` bytes."""
    head_region = blocks * row
    layer_region = heads * head_region
    runs = [(row, layer * layer_region + h * head_region, row) for layer in range(layers) for h in range(heads)]
    return Footprint.build(layers * layer_region, blocks, runs)


def bytes_of_block(fp: Footprint, b: int) -> set[int]:
    """Every page touched by block `b`, computed byte-run by byte-run (the brute-force truth)."""
    pages: set[int] = set()
    for stride, runs in fp.runs.items():
        for start, length in runs:
            lo = start + b * stride
            pages.update(range(lo // P, (lo + length - 1) // P + 1))
    return pages


CASES = {
    "layer-outer, 4 blocks a page": layer_outer(3, 40, 16 * 1024),
    "layer-outer, odd block count": layer_outer(2, 37, 16 * 1024),
    "block-outer": block_outer(4, 50, 4 * 1024),
    "head-outer": head_outer(2, 64, 3, 4 * 1024),
    "MLA-like rows (not a divisor of the page)": layer_outer(3, 60, 18_432),
    "padded pages": Footprint.build(2 * 30 * 20_480, 30, [(20_480, layer * 30 * 20_480, 18_000) for layer in range(2)]),
}


@pytest.mark.parametrize("fp", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("bpp_factor", [1, 2, 3])
def test_every_block_lies_in_its_groups_pages(fp: Footprint, bpp_factor: int) -> None:
    g = min_blocks_per_page(fp, P) * bpp_factor
    plan = PagePlan(fp, P, g)
    assert plan.num_groups == -(-fp.num_blocks // g)
    for group in range(plan.num_groups):
        pages = set(plan.pages_of(group))
        for b in plan.block_range(group):
            assert plan.group_of(b) == group
            assert bytes_of_block(fp, b) <= pages, (group, b)
        assert max(pages) < plan.num_pages  # inside the reserved range
    assert plan.max_pages_per_group() == max(len(plan.pages_of(x)) for x in range(plan.num_groups))


@pytest.mark.parametrize("name", ["layer-outer, 4 blocks a page", "block-outer", "head-outer"])
def test_exact_group_sizes_own_their_pages(name: str) -> None:
    """Where the strides allow it, no physical page serves two groups: no page is mapped for nothing."""
    fp = CASES[name]
    plan = PagePlan(fp, P, min_blocks_per_page(fp, P))
    seen: dict[int, int] = {}
    for group in range(plan.num_groups):
        for page in plan.pages_of(group):
            assert seen.setdefault(page, group) == group, f"page {page} in groups {seen[page]} and {group}"


def test_group_sizes_follow_the_strides() -> None:
    assert min_blocks_per_page(CASES["layer-outer, 4 blocks a page"], P) == 4  # 64 KiB / 16 KiB
    assert min_blocks_per_page(CASES["block-outer"], P) == 4  # stride 16 KiB
    assert min_blocks_per_page(CASES["head-outer"], P) == 16  # stride 4 KiB
    # 18,432-byte rows: an exact size would be 32 blocks (9 pages a run); a page's worth (4) shares instead.
    assert min_blocks_per_page(CASES["MLA-like rows (not a divisor of the page)"], P) == 4
    # One group per two blocks of a 128 KiB stride is still exact (2 pages per run).
    assert min_blocks_per_page(layer_outer(1, 8, 128 * 1024), P) == 1


def test_shared_pages_when_groups_do_not_align() -> None:
    fp = CASES["MLA-like rows (not a divisor of the page)"]
    plan = PagePlan(fp, P, 4)
    assert set(plan.pages_of(0)) & set(plan.pages_of(1))  # neighbours share a boundary page
    assert plan.max_pages_per_group() == 6  # two pages per layer, at most
    # Layer regions that do not start on a page (37 blocks of 16 KiB) make groups share across
    # layers: the elastic-kv patch (vllm/elastic_buffers.py) pads such regions to whole pages before laying out views.
    odd = PagePlan(CASES["layer-outer, odd block count"], P, 4)
    assert set(odd.pages_of(0)) & set(odd.pages_of(1))


def test_workers_agree_on_one_size() -> None:
    assert agree_blocks_per_page([4, 8]) == 8
    assert agree_blocks_per_page([4, 6]) == 12
    assert agree_blocks_per_page([7, 9]) == 9  # the common multiple, 63, is too coarse: the largest wins


def test_runs_merge_and_bad_footprints_are_refused() -> None:
    assert merge_runs([(10, 5), (0, 10), (30, 1), (14, 3)]) == ((0, 17), (30, 1))
    with pytest.raises(ValueError, match="past the buffer"):
        Footprint.build(1000, 10, [(100, 0, 200)])
    with pytest.raises(ValueError, match="bad run"):
        Footprint.build(1000, 10, [(0, 0, 10)])
    fp = CASES["head-outer"]
    assert Footprint.from_dict(fp.to_dict()) == fp
    with pytest.raises(IndexError):
        PagePlan(fp, P, 16).pages_of(4)
