"""What `worker.serve` makes sure of before it polls: search attributes and the GC schedule.

Calls to Temporal, not activities: they run once per worker start, outside
any workflow, and are idempotent when many workers start at once.
"""
