"""kvcached: a KV-cache runtime for LLM serving engines (core layer: stdlib + psutil only)."""

__version__ = "0.1.0"
