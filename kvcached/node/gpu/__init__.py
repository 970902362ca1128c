"""GPU holders: which processes hold a GPU, which serve each belongs to, and which are orphans to end.

What the rest of the node layer calls: holders.find_holders (one pass over
the /proc facts), holders.prepare (before the engine pass, so that one read
of the maps serves both), kill.terminate_holders (the guarded kill); each
caller imports the module (the package imports none of them). NVML is
imported only inside a pass that found an NVIDIA holder, never when kvctl
starts.
"""
