"""The cleaner: the /proc fact pass, process roles, the scan, the pure decision, the guarded act and
its report, what a run cannot see (sight), the pidfd kill of orphans; leftovers/ is the engines'
families on the same path. Imports base and state.
"""
