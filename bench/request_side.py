"""bench.gateway's load in a process of its own: the TLS origin and the clients.

The clients and the origin are the load: the same at every pool size. The
benchmark's own work grows with the pool (a rotation a second, the pool's
1,000 endpoints polled four times a second, pinned probes, the member
Squids' logs read). In one interpreter that work took the GIL from the
clients and the origin, and its CPU from the request path's core, so the
ratios measured the benchmark. Here the origin and the clients run in a
child process pinned to the request path's cores; the benchmark, on the
control plane's, hands it one load phase at a time.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import trustme

from bench.gateway_load import Load, Phase, Target
from tests.helpers.tls_origin import HOST, TlsOrigin, origin_at, serving

# How long the child may take to start (a spawned interpreter imports the benchmark).
START_SECONDS = 60.0
STOP_SECONDS = 10.0


@dataclass(frozen=True)
class LoadOrder:
    """One phase of load: `clients` closed-loop clients through `proxy` for `seconds`."""

    name: str
    proxy: Target
    clients: int
    credentials: tuple[str, str]
    seconds: float


class RequestSide:
    """The child process's origin, and its clients, one phase at a time."""

    def __init__(self, origin: TlsOrigin, orders: Connection) -> None:
        self.origin = origin
        self._orders = orders

    def load(self, order: LoadOrder) -> Phase:
        """Runs the phase and returns its figures (blocking: call it from a thread). The
        gateway's CPU is the caller's to fill in."""
        self._orders.send(order)
        phase: Phase = self._orders.recv()
        return phase


@contextlib.contextmanager
def request_side(cpus: frozenset[int]) -> Iterator[RequestSide]:
    """The origin and the clients in a child process on `cpus`, until the block exits."""
    ca = trustme.CA()
    chain = ca.issue_cert(HOST, "localhost").private_key_and_cert_chain_pem.bytes()
    spawn = multiprocessing.get_context("spawn")
    orders, theirs = spawn.Pipe()
    child = spawn.Process(
        target=_serve, args=(theirs, chain, ca.cert_pem.bytes(), cpus), daemon=True
    )
    child.start()
    try:
        if not orders.poll(START_SECONDS):
            raise RuntimeError(f"the request side did not start within {START_SECONDS:.0f} s")
        yield RequestSide(origin_at(orders.recv(), ca), orders)
        orders.send(None)
        child.join(STOP_SECONDS)
    finally:
        if child.is_alive():
            child.kill()
            child.join()


def _serve(orders: Connection, chain: bytes, ca: bytes, cpus: frozenset[int]) -> None:
    os.sched_setaffinity(0, cpus)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.NamedTemporaryFile(suffix=".pem") as pem:
        pem.write(chain)
        pem.flush()
        server_context.load_cert_chain(pem.name)
    client_context = ssl.create_default_context(cadata=ca.decode())
    with serving(server_context) as port:
        orders.send(port)
        while (order := orders.recv()) is not None:
            started = time.monotonic()
            with Load(
                order.proxy, (HOST, port), client_context, order.clients, order.credentials
            ) as load:
                time.sleep(order.seconds)
            orders.send(load.phase(order.name, time.monotonic() - started, gateway_cpu=0.0))
