"""Building blocks: the enums, domain errors and units, the IPC name rules, the node's Layout,
mountinfo, kernel file handles. The standard library only; imports nothing else of the node.
"""
