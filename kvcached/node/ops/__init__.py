"""The operations kvctl calls: gc and delete, the inspect view, doctor's checks and the detect
document, metrics, the agent's heartbeat and endpoint, the demo, the host hazards. Imports base,
state, clean and gpu.
"""
