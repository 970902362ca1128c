"""Worker IPC (DESIGN.md §5): a framed JSON protocol without pickle, a listener, a client."""
