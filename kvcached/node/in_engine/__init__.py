"""What engine processes run: the start-up claim and sweep, and what the engine owner captures at READY
and removes after a confirmed exit. Imports base, state and clean.
"""
