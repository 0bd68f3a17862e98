"""Deterministic workflow code: ProxyLifecycle, ProxyPool (planned by pool_plan.py) and OrphanGC.

Nothing here does I/O, reads clocks or draws random numbers outside the
workflow API, and nothing imports a provider SDK.
"""
