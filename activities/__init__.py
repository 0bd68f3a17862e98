"""Side effects: provider calls, CONNECT probes and Temporal look-ups.

The only bridge between deterministic workflows and the outside world.
"""
