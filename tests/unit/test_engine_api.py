"""Small pieces of the engine pass's API that the kvctl phase calls."""

from __future__ import annotations

from kvcached.node.engines import rpc_dirs_from_env
from kvcached.node.layout import Layout


def test_vllm_rpc_base_path_is_rebased_under_the_root() -> None:
    assert rpc_dirs_from_env(Layout("/"), {"VLLM_RPC_BASE_PATH": "/var/run/vllm"}) == ["/var/run/vllm"]
    assert rpc_dirs_from_env(Layout("/srv/node"), {"VLLM_RPC_BASE_PATH": "/var/run/vllm/"}) == [
        "/srv/node/var/run/vllm"]


def test_unset_empty_or_relative_means_only_tmp() -> None:
    for env in ({}, {"VLLM_RPC_BASE_PATH": ""}, {"VLLM_RPC_BASE_PATH": "rpc"}):
        assert rpc_dirs_from_env(Layout("/"), env) == []
