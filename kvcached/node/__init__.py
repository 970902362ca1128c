"""The node layer: everything that reads and cleans a node, standard library and psutil only.

Naming and layout, the segment and its leases, identity, the /proc fact pass,
the scan, the decision, the guarded act (cleanup, gc, delete), the engine
owner's and the start-up claim's use of it, the inspect view, diagnostics,
metrics, the gc lock, orphans, units and errors. `kvctl` imports only this
layer; importing it never imports torch, vLLM or the compiled extension.
"""
