"""Engine integrations (vLLM first). Runtime layer: loaded only inside engine processes.

Importing this package imports no engine: `vllm_plugin.register` is what vLLM
calls, and `vllm_patches.detect()` imports vLLM only when it is called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..node.layout import Layout

ENV_ROOT = "KVCACHED_ROOT"
PLUGIN_NAME = "kvcached"  # the entry point's name in group vllm.general_plugins
ENV_VLLM_PLUGINS = "VLLM_PLUGINS"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when kvcached is switched on: upstream's `ENABLE_KVCACHED=true`, our `KVCACHED_ENABLE=1`,
    or `KVCACHED_ELASTIC=1` (elastic KV memory needs the other patches: the worker listener)."""
    env = os.environ if environ is None else environ
    upstream = env.get("ENABLE_KVCACHED", "").strip().lower() in ("true", "1", "yes", "on")
    ours = env.get("KVCACHED_ENABLE", "").strip().lower() in ("1", "true", "yes", "on")
    elastic = env.get("KVCACHED_ELASTIC", "").strip().lower() in ("1", "true", "yes", "on")
    return upstream or ours or elastic


def plugin_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """False when `VLLM_PLUGINS` is set and does not list `kvcached`: vLLM then never calls our plugin.

    Parsed as vLLM 0.33 parses it (`envs.VLLM_PLUGINS`): split on `,`, names
    compared exactly, so `VLLM_PLUGINS=""` allows no plugin at all.
    """
    env = os.environ if environ is None else environ
    if ENV_VLLM_PLUGINS not in env:
        return True
    return PLUGIN_NAME in env[ENV_VLLM_PLUGINS].split(",")


def layout_from_env(environ: Mapping[str, str] | None = None) -> Layout:
    """The node layout engine processes use: `/`, or `KVCACHED_ROOT` (tests, chroots)."""
    env = os.environ if environ is None else environ
    return Layout(root=env.get(ENV_ROOT) or "/")
