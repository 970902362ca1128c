"""An engine meeting a same-name segment at start-up: join live, replace stale, refuse otherwise."""

from __future__ import annotations

import os

import pytest

from kvcached.node.in_engine.startup import SegmentConflict, claim_segment
from kvcached.node.state.lease import SegmentLease, segment_lease_held
from kvcached.node.state.segment import create_segment, read_segment, write_segment

from .helpers import backdate


def test_creates_then_joins_a_live_one(layout, uniq) -> None:
    lease, info, how = claim_segment(layout, uniq, 100)
    assert how == "created" and info.total == 100 and segment_lease_held(layout.segment_path(uniq))
    try:
        lease2, info2, how2 = claim_segment(layout, uniq, 5)
        assert how2 == "joined" and info2.total == 100
        lease2.release()
    finally:
        lease.release()


def test_replaces_a_stale_one(layout, uniq) -> None:
    path = layout.segment_path(uniq)
    create_segment(path, 7)
    write_segment(path, used=3)
    backdate(path)
    lease, info, how = claim_segment(layout, uniq, 100)
    try:
        assert how == "replaced" and info.total == 100 and read_segment(path).used == 0
    finally:
        lease.release()


def test_refuses_foreign_or_unknown(layout, uniq, tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 24)
    os.link(victim, layout.segment_path(uniq))
    with pytest.raises(SegmentConflict, match="foreign"):
        claim_segment(layout, uniq, 100)
    assert victim.read_bytes() == b"\0" * 24


def test_joined_lease_survives_the_first_holder(layout, uniq) -> None:
    path = layout.segment_path(uniq)
    first, _, _ = claim_segment(layout, uniq, 1)
    second, _, _ = claim_segment(layout, uniq, 1)
    first.release()
    assert segment_lease_held(path)
    second.release()
    assert not segment_lease_held(path)
    assert isinstance(first, SegmentLease)
