"""What the vLLM and the SGLang tests (tests/vllm, tests/sglang) share: the elastic tests' page and their twin check."""

from __future__ import annotations

from collections.abc import Callable

import pytest

# KVCACHED_PAGE_SIZE in both engines' elastic tests: small CPU pages, so that a few blocks make a page.
PAGE = 64 * 1024


def check_or_fail(on: bool, check: Callable[[], object]) -> None:
    """Run `check`; with kvcached's elastic classes off it must fail: the claim is kvcached's, not the engine's."""
    if on:
        check()
    else:
        with pytest.raises(AssertionError):
            check()
