"""The gateway's demand, measured and reported to its pools (`report_demand` update).

What an autoscaled pool sizes itself by (workflows/pool_autoscale.py),
each pool its own, counted by the router (`GatewaySquid.open_tunnels`), which
knows the pool of the member it sends each tunnel to:

- open tunnels: the tunnels one of the pool's members granted (answered
  200) that are open now, counted where they open and close, every
  SAMPLE_SECONDS; a report gives the most seen at once since the last one.
  A client refused (no or wrong credentials, a user over its `tunnels=`
  limit, a username no member admits, a port not allowed) or still being
  checked holds none, however long its check takes, nor does a socket that
  sends nothing, though Squid holds it until its timeout: only a client
  holding credentials can hold a pool up. A CONNECT held while a pool at
  zero wakes counts for that pool once its member granted it (the pool's
  stand-in, gateway/wake.py, is counted as the pool's);
- new tunnels: the tunnels the pool's members granted since the last report.

A report is an action billed by Temporal Cloud and a history event, so the
gateway reports sparingly: every REPORT_SECONDS at most, and to a pool only
when its demand moved (`moved`) or HEARTBEAT has passed since its last report
(the pool forgets a report after workflows/pool_autoscale.REPORT_STALE). A
pool that is not autoscaled says so, and the gateway stops reporting to it.

Behind a gateway of several pools (gateway/pools.py) each pool is told only
the tunnels its own members carry: a pool whose members carry nothing is
told 0 and may scale to zero while another pool takes the gateway's clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from temporalio.client import (
    Client,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

import cli
from gateway import metrics
from gateway.squid import GatewayError, Tunnels
from workflows.pool_autoscale import GATEWAY_NAME, MIN_REPORT_INTERVAL, NOT_AUTOSCALED

log = logging.getLogger("proxy_operator.gateway")

REPORT_DEMAND_UPDATE = "report_demand"
SAMPLE_SECONDS = 1.0
REPORT_SECONDS = 15.0
HEARTBEAT = 300.0
# A change of open tunnels smaller than this share (and than one) is not
# worth a report.
MOVED_SHARE = 0.1


def gateway_name(listen: tuple[str, int]) -> str:
    """This gateway's name in its reports: the host's name and the listen port."""
    host = "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())
    return f"{host.strip('.-')[:80] or 'gateway'}:{listen[1]}"


@dataclass(frozen=True)
class Sample:
    open_tunnels: int
    new_tunnels: int


def moved(last: Sample | None, now: Sample) -> bool:
    """Whether the demand changed enough since the last report to be worth another."""
    if last is None:
        return True
    if (last.open_tunnels == 0) != (now.open_tunnels == 0):
        return True
    if (last.new_tunnels == 0) != (now.new_tunnels == 0):
        return True
    step = max(1, int(last.open_tunnels * MOVED_SHARE))
    return abs(now.open_tunnels - last.open_tunnels) > step


class DemandMeter:
    """Per pool: peak open tunnels and tunnels granted since the last `take`; thread-safe."""

    def __init__(self, tunnels: Callable[[], Tunnels]) -> None:
        """`tunnels`: the router's count, per pool (GatewayError when it did not answer)."""
        self._tunnels = tunnels
        self._lock = threading.Lock()
        self._peak: dict[str, int] = {}
        # Each pool's granted tunnels (since the router started) at the last take.
        self._granted: dict[str, int] = {}
        self._last = Tunnels(0, {})

    def _now(self) -> Tunnels:
        """What is open now, or what was last counted if the router did not answer: a
        missed look must not end the reports (the gateway stops if the router is gone)."""
        try:
            now = self._tunnels()
        except GatewayError as err:
            log.warning("open tunnels not counted this second: %s", err)
            return self._last
        self._last = now
        return now

    def sample(self) -> int:
        """One look; the tunnels open now over every pool."""
        now = self._now()
        with self._lock:
            for pool, (open_now, _) in now.pools.items():
                self._peak[pool] = max(self._peak.get(pool, 0), open_now)
        return now.open

    def take(self) -> dict[str, Sample]:
        """Each pool's demand since the last take (a pool with none: not listed); starts
        the next window at what is open now."""
        now = self._now()
        with self._lock:
            taken = {}
            for pool in now.pools.keys() | self._peak.keys():
                open_now, granted = now.pools.get(pool, (0, self._granted.get(pool, 0)))
                peak = max(self._peak.get(pool, 0), open_now)
                taken[pool] = Sample(peak, max(0, granted - self._granted.get(pool, 0)))
            self._peak = {pool: open_now for pool, (open_now, _) in now.pools.items()}
            self._granted = {pool: granted for pool, (_, granted) in now.pools.items()}
        return {pool: sample for pool, sample in taken.items() if sample != Sample(0, 0)}


class DemandReporter:
    """Samples the meter and reports to the pools, sparingly, until every one says it is fixed."""

    def __init__(
        self,
        client: Client,
        pools: Callable[[], Sequence[str]],
        meter: DemandMeter,
        name: str,
    ) -> None:
        """`pools` gives the pools to report to now (the open ones)."""
        if not _valid_name(name):
            raise ValueError(f"gateway name {name!r} does not match {GATEWAY_NAME}")
        self.client = client
        self.pools = pools
        # Pools that said they are not autoscaled: no more reports to them.
        self.fixed: set[str] = set()
        self.meter = meter
        self.name = name
        # Per pool: the last report it took, and when.
        self.last: dict[str, Sample] = {}
        self.last_at: dict[str, float] = {}

    async def run(self, report_seconds: float = REPORT_SECONDS) -> None:
        """Until cancelled, or until every pool turns out not to be autoscaled."""
        window_start = time.monotonic()
        while True:
            while time.monotonic() - window_start < report_seconds:
                metrics.OPEN_TUNNELS.set(await asyncio.to_thread(self.meter.sample))
                await asyncio.sleep(SAMPLE_SECONDS)
            window = time.monotonic() - window_start
            window_start = time.monotonic()
            samples = await asyncio.to_thread(self.meter.take)
            if not await self.report(samples, window):
                return

    def due(self, samples: Mapping[str, Sample]) -> dict[str, Sample]:
        """The pools to report to now, each with its own demand: it moved, or HEARTBEAT
        passed since the pool's last report."""
        now = time.monotonic()
        return {
            pool: sample
            for pool in self.pools()
            if pool not in self.fixed
            for sample in [samples.get(pool, Sample(0, 0))]
            if moved(self.last.get(pool), sample) or now - self.last_at[pool] >= HEARTBEAT
        }

    async def report(self, samples: Mapping[str, Sample], window: float) -> bool:
        """Its own demand to each pool `due`; False once every pool said it is not
        autoscaled (stop)."""
        due = self.due(samples)
        seconds = max(1, min(3600, round(window)))
        sent = await asyncio.gather(
            *(
                self._report_to(
                    pool,
                    {
                        "gateway": self.name,
                        "open_tunnels": sample.open_tunnels,
                        "new_tunnels": sample.new_tunnels,
                        "window_seconds": seconds,
                    },
                )
                for pool, sample in due.items()
            )
        )
        for (pool, sample), took in zip(due.items(), sent, strict=True):
            if took:
                self.last[pool], self.last_at[pool] = sample, time.monotonic()
        return any(pool not in self.fixed for pool in self.pools())

    async def _report_to(self, pool: str, body: dict[str, Any]) -> bool:
        """One report to `pool`; whether it took it."""
        try:
            answer = await self.client.get_workflow_handle(pool).execute_update(
                REPORT_DEMAND_UPDATE, body
            )
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type == NOT_AUTOSCALED:
                log.info("pool %s is not autoscaled: no demand reports", pool)
                self.fixed.add(pool)
                return False
            metrics.DEMAND_REPORTS.labels(pool=pool, outcome=metrics.REPORT_REFUSED).inc()
            log.warning("demand report refused by pool %s: %s", pool, cause or err)
            return False
        except (RPCError, WorkflowUpdateRPCTimeoutOrCancelledError) as err:
            metrics.DEMAND_REPORTS.labels(pool=pool, outcome=metrics.REPORT_FAILED).inc()
            log.warning("demand report to pool %s failed: %s", pool, err)
            return False
        metrics.DEMAND_REPORTS.labels(pool=pool, outcome=metrics.REPORT_SENT).inc()
        record_answer(pool, answer)
        return True


def record_answer(pool: str, answer: Any) -> None:
    """The pool's size and cost as its answer says, into the gateway's metrics."""
    if not isinstance(answer, dict):
        return
    replicas, seconds = answer.get("replicas"), answer.get("member_seconds")
    if isinstance(replicas, int):
        metrics.POOL_REPLICAS.labels(pool=pool).set(replicas)
    if isinstance(seconds, int | float):
        metrics.POOL_MEMBER_SECONDS.labels(pool=pool).set(seconds)


def _valid_name(name: str) -> bool:
    return re.fullmatch(GATEWAY_NAME, name) is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.env_argument(
        parser,
        "--gateway-name",
        "PROXY_OPERATOR_GATEWAY_NAME",
        "this gateway's name in its demand reports; unset, <host name>:<listen port>",
    )
    cli.seconds_argument(
        parser,
        "--report-interval",
        REPORT_SECONDS,
        "seconds between demand reports to an autoscaled pool, at most",
        "reports that change nothing are skipped",
    )


def usage_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.gateway_name is not None and not _valid_name(args.gateway_name):
        problems.append(
            f"--gateway-name: {args.gateway_name!r} must be 1-100 letters, digits, "
            "'.', '_', ':', '@', '/' or '-', starting with a letter or digit"
        )
    least = MIN_REPORT_INTERVAL.total_seconds()
    if not least <= args.report_interval <= HEARTBEAT:
        problems.append(
            f"--report-interval: {args.report_interval} is not between {least:g} and "
            f"{HEARTBEAT:g} seconds"
        )
    return problems


def name_of(args: argparse.Namespace, listen: tuple[str, int]) -> str:
    """This gateway's name in its reports and wakes: `--gateway-name`, or the default."""
    return str(args.gateway_name) if args.gateway_name else gateway_name(listen)


@contextlib.asynccontextmanager
async def reporting(
    args: argparse.Namespace,
    client: Client,
    pools: Callable[[], Sequence[str]],
    meter: DemandMeter,
    listen: tuple[str, int],
) -> AsyncIterator[None]:
    """Demand reports in the background while the gateway serves."""
    reporter = DemandReporter(client, pools, meter, name_of(args, listen))
    task = asyncio.create_task(reporter.run(args.report_interval))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
