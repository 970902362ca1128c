"""Node state primitives, one per kind of shared state: the limit segment, its leases, the passive
socket tests (sock_diag), the node-wide gc lock. Imports base only.
"""
