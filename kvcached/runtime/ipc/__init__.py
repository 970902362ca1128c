"""Worker IPC (docs/CLEANER.md §5): a framed JSON protocol without pickle, a listener, a client."""
