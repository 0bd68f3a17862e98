"""What tests and benchmarks share: servers, Squids, configs, ports, /proc readings.

Plain functions and classes only; the pytest fixtures built on them live in
the conftest.py files (tests/conftest.py, tests/workflows/conftest.py).
Fakes of remote APIs (Kubernetes, Compute Engine) live in tests/fakes.
"""
