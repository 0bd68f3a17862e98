"""The gateway as users run it: `proxy-operator-gateway` in a process of its own.

Started with the worker's config file and PROXY_PASSWORD in its environment,
pointed at the test's Temporal server; `stop` sends SIGTERM (the gateway
stops its Squids) and kills what is left after a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from temporalio.testing import WorkflowEnvironment

from tests.helpers.api import call
from tests.helpers.config import PASSWORD, PASSWORD_ENV, local_entry, raw_config
from tests.helpers.network import free_port
from tests.helpers.stacks import Stack
from tests.helpers.state_dir import local_state_dir
from tests.helpers.tunnel import Answer, request

ROOT = Path(__file__).resolve().parents[2]
# Where a child Python finds this checkout's code: the operator, and the
# scrapers' client it imports (clients/python), whatever the virtualenv holds.
CHECKOUT_PYTHONPATH = os.pathsep.join(str(path) for path in (ROOT, ROOT / "clients" / "python"))
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
START_DEADLINE = 60.0
# More than the gateway's own bounds on stopping (gateway/squid.py: up to
# STOP_GRACE for Squid's process group, then as long for its watchdog), so a
# slow stop on a loaded machine is not mistaken for a hung one.
STOP_GRACE = 45.0


class GatewayProcess:
    """One `proxy-operator-gateway --pool ...` for a test or a benchmark."""

    def __init__(
        self,
        *,
        pool: str,
        raw_config: dict[str, Any],
        temporal_address: str,
        namespace: str,
        directory: Path,
        poll_seconds: float = 0.5,
        debounce_seconds: float = 0.0,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o755)  # Squid's user reaches its files under it
        config = directory / "providers.yaml"
        config.write_text(yaml.safe_dump(raw_config))
        self.output = directory / "gateway.out"
        self.args = [
            sys.executable,
            "-m",
            "gateway.main",
            "--pool",
            pool,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--providers-config",
            str(config),
            "--metrics-address",
            f"127.0.0.1:{self.metrics_port}",
            "--poll-interval",
            str(poll_seconds),
            "--debounce",
            str(debounce_seconds),
            "--state-dir",
            str(directory / "state"),
            *extra_args,
        ]
        self.state_dir = directory / "state"
        self.env = {
            **os.environ,
            PASSWORD_ENV: PASSWORD,
            "TEMPORAL_ADDRESS": temporal_address,
            "TEMPORAL_NAMESPACE": namespace,
            "PYTHONPATH": CHECKOUT_PYTHONPATH,
            **(extra_env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None
        # The control API's port and a token of it, with pool_gateway(..., api=True).
        self.api: tuple[int, str] | None = None

    def start(self) -> GatewayProcess:
        with self.output.open("ab") as out:
            self.process = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        until = time.monotonic() + START_DEADLINE
        while not self.healthy():
            if self.process.poll() is not None:
                raise AssertionError(f"the gateway exited: {self.log()}")
            if time.monotonic() > until:
                raise AssertionError(f"the gateway is not healthy after 60s: {self.log()}")
            time.sleep(0.1)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/healthz", timeout=1
            ) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def probe(self, path: str) -> tuple[int, str]:
        """The metrics listener's answer to GET `path` (/healthz, /readyz): status and body."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5
            ) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def metrics_text(self) -> str:
        """The metrics listener's /metrics, as anyone who reaches it reads it."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as response:
            return str(response.read().decode())

    def metrics(self) -> Samples:
        """Every gateway sample on the metrics listener (no member, no exit address)."""
        return gateway_samples(self.metrics_text())

    def member_metrics(self) -> Samples:
        """Every gateway sample, members' included: the control API's /metrics, with its token."""
        assert self.api is not None, "started without the control API (pool_gateway's api=)"
        port, token = self.api
        reply = call(port, "GET", "/metrics", token=token)
        assert reply.status == 200, reply
        return gateway_samples(reply.body.decode())

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.output.read_text(errors="replace")[-3000:]
        return ""

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def gateway_samples(text: str) -> Samples:
    """The gateway's samples in a /metrics body: (name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("proxy_operator_gateway_")
    }


def stack_gateway(
    env: WorkflowEnvironment,
    stack: Stack,
    pool: str,
    directory: Path,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> GatewayProcess:
    """A gateway (not started) over `pool`: the stack's local provider, its origin's port."""
    return GatewayProcess(
        pool=pool,
        raw_config=raw_config(local_entry(stack.state_dir), connect_ports=[443, stack.origin.port]),
        temporal_address=env.client.service_client.config.target_host,
        namespace=env.client.namespace,
        directory=directory,
        extra_args=extra_args,
        extra_env=extra_env,
    )


def through(
    gateway: GatewayProcess, stack: Stack, username: str, password: str = PASSWORD
) -> Answer:
    """One CONNECT through the gateway to the stack's TLS origin, then GET /."""
    return request(
        ("127.0.0.1", gateway.port),
        username,
        password,
        (stack.origin.host, stack.origin.port),
        stack.origin.client_ssl_context,
    )


@contextlib.asynccontextmanager
async def pool_gateway(
    env: WorkflowEnvironment,
    stack: Stack,
    pool: str,
    flags: Callable[[Path], tuple[str, ...]] | None = None,
    extra_env: Mapping[str, str] | None = None,
    *,
    api: bool = False,
) -> AsyncIterator[GatewayProcess]:
    """A gateway over `pool` of the stack's worker, stopped (and checked exit 0) afterwards.

    `flags`, given the gateway's directory, writes there what the gateway
    needs (a tokens file, say) and returns the flags that point at it;
    `extra_env` is added to its environment. With `api`, the control API is
    on (loopback, one token, no rate to speak of) for `member_metrics`.
    """
    with local_state_dir("proxy-operator-gateway-test-") as directory:
        extra_args = flags(directory) if flags is not None else ()
        token, api_port = secrets.token_urlsafe(24), free_port()
        if api:
            tokens = directory / "api-tokens"
            tokens.write_text(f"{token}\n")
            extra_args = (
                *extra_args,
                *("--api-listen", f"127.0.0.1:{api_port}", "--api-tokens-file", str(tokens)),
                *("--api-rate", "1000", "--api-burst", "1000"),
            )
        process = stack_gateway(env, stack, pool, directory, extra_args, extra_env)
        if api:
            process.api = (api_port, token)
        # Started off the event loop: the worker in the test's process answers its queries.
        try:
            await asyncio.to_thread(process.start)
            yield process
        except BaseException:
            await asyncio.to_thread(process.stop)  # a failed test leaves no gateway running
            raise
        assert await asyncio.to_thread(process.stop) == 0, process.log()
