"""Activities that drive providers and probe proxies for ProxyLifecycle and OrphanGC.

One class holds the provider registry and the worker's config, so tests can
inject providers and credentials never travel through a workflow payload: the
workflow names a provider and an owner, the activity adds the password.
Provider calls are synchronous SDK calls; they run on a dedicated thread pool
so the worker's event loop (and the probes on it) never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TypeVar
from urllib.parse import urlsplit

from temporalio import activity
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import (
    disruption_of,
    instance_disrupted,
    instance_lost,
    invalid_input,
    is_not_found,
    to_application_error,
)
from activities.exit_echo import EchoFailed, observe_exit
from activities.metrics import POOL_MONITOR_LATE_SECONDS, PROBE_SECONDS, PROBES
from activities.models import (
    CreateInstanceInput,
    EndpointCheck,
    FailingMember,
    InstanceInput,
    InstanceRef,
    MonitorInput,
    MonitorOutcome,
    MonitorReason,
    PoolMonitorInput,
    PoolMonitorOutcome,
    ProbeInput,
    ProbeSummary,
    TargetCheck,
    ValidateTargetInput,
    VerifyEndpointInput,
    WatchedMember,
)
from activities.probe import OTHER, ProbeResult, probe_connect
from contract import ROTATE_SIGNAL, ErrorType
from providers.base import (
    AccessCheck,
    Advice,
    CreateRequest,
    Disruption,
    Instance,
    InstanceState,
    NamedLookup,
    Provider,
    ReplacementAdvice,
    split_endpoint,
)
from providers.catalog import provider_type
from providers.config import Config
from providers.errors import Permanent, classify
from providers.naming import OWNER_KEY, instance_name, owner_tags, ownership_mismatch

T = TypeVar("T")

# Poll quickly at first (a local Squid is up in tens of milliseconds), then
# back off so a slow VM boot costs few provider calls.
FIRST_POLL_SECONDS = 0.05
MAX_POLL_SECONDS = 2.0
# An instance not RUNNING this long after wait_running was first scheduled
# (across retries) is written off; within WAIT_RUNNING's start-to-close.
WAIT_RUNNING_DEADLINE_SECONDS = 600.0
# A delete that has not taken effect after this long is issued again.
REDELETE_AFTER_SECONDS = 30.0
# A pool shard asks the server, between rounds and at most this often,
# whether the pool still wants it: whether the run that started it is still
# its pool's open run, and has not asked to cancel it. A cancel reaches a
# shard only with a heartbeat's reply, up to 80 s later (the SDK sends one
# every 80% of the 100 s heartbeat timeout): meanwhile the next run's shards already probe the
# same members after a handover (a 1,000-member pool starting up hands over
# every few seconds, and several generations of shards probed at once), and
# an ending pool, which waits for its shards, waited that long to end. A
# describe is no billable action.
HANDOVER_CHECK_SECONDS = 5.0
HANDOVER_CHECK_TIMEOUT = timedelta(seconds=5)
GONE_STATES = (InstanceState.TERMINATED, InstanceState.STOPPED)
# While a new instance fails its first probes (a VM still booting), ask the
# provider this often whether it still exists.
GONE_CHECK_SECONDS = 5.0
# A create heartbeats this often while its provider call runs; the SDK sends
# at most one every 80% of the heartbeat timeout (workflows/policies.py).
CREATE_HEARTBEAT_SECONDS = 5.0
# The monitor heartbeats on a clock of its own, not after each probe: an
# `interval_seconds` longer than its heartbeat timeout (up to an hour is
# allowed) would otherwise time it out between probes. Every heartbeat is a
# billable action in Temporal Cloud (docs/cost.md), so it beats as rarely as
# its timeout allows: MONITOR_HEARTBEAT_SLACK before the timeout (a busy
# event loop's margin), or at half the timeout for a timeout under twice
# that. For the monitor's 60 s timeout (workflows/policies.py) that is every
# 30 s, of which the SDK sends one every 48 s (80% of the timeout); a 270 s
# timeout would beat every 210 s, 17 an hour.
MONITOR_HEARTBEAT_SLACK = timedelta(seconds=60)
# A monitor scheduled without a heartbeat timeout beats as if it had this one:
# its heartbeats still carry the last probe and bring a cancel.
UNTIMED_HEARTBEAT = timedelta(seconds=60)
# A pool monitor's round starts its probes evenly over this share of the
# interval: a shard's 200 probes at one instant were 200 TLS handshakes at
# once on the worker's event loop and, where members share a host or a NAT,
# a burst on it. A shard restarts for every change of its members'
# endpoints, so a rotating pool set one off every few seconds. Spread, each
# member is still probed once an interval, and a failing one is told within
# half an interval more than before.
ROUND_SPREAD = 0.5
# A failing member's detail, as the pool's signal to the member carries it.
MAX_DETAIL = 200


@dataclass(frozen=True)
class Gone:
    """Why an instance can no longer serve, and whether its platform took it away."""

    detail: str
    disruption: Disruption | None = None

    def error(self, when: str) -> ApplicationError:
        """What a wait on the instance raises: InstanceDisrupted, else InstanceLost."""
        message = f"{self.detail} {when}"
        if self.disruption is not None:
            return instance_disrupted(message)
        return instance_lost(message)


@dataclass(frozen=True)
class ProbeRequest:
    """One probe of one instance: through its proxy, with the worker's credentials, to `target`."""

    instance: InstanceRef
    target: str
    username: str
    password: str = field(repr=False)
    timeout_seconds: float
    ssl_context: ssl.SSLContext


async def probe_instance(req: ProbeRequest) -> ProbeResult:
    """The real probe: CONNECT through the instance's proxy to the target, TLS, HEAD."""
    return await probe_connect(
        req.instance.ip,
        req.instance.port,
        req.username,
        req.password,
        req.target,
        timeout=req.timeout_seconds,
        ssl_context=req.ssl_context,
    )


# How `check_health` and `monitor` probe: `probe_instance` unless injected. A
# benchmark injects a wrapper that times and records every probe.
InstanceProbe = Callable[[ProbeRequest], Awaitable[ProbeResult]]


class ProviderActivities:
    """Activities over the worker's configured providers."""

    def __init__(
        self,
        providers: Mapping[str, Provider],
        config: Config,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_threads: int = 32,
        probe: InstanceProbe = probe_instance,
    ) -> None:
        self._providers = dict(providers)
        self._config = config
        self._probe_instance = probe
        # One context for every probe: building one loads the CA bundle.
        self._ssl = ssl_context or ssl.create_default_context()
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="provider")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @activity.defn(name="validate_target")
    async def validate_target(self, inp: ValidateTargetInput) -> TargetCheck:
        """Check what only the worker knows: provider names, placement, ports.

        Returns every problem, each naming its input field, so the workflow can
        fail with all of them at once before creating anything, and the
        installation the workflow's instance names are hashed with.
        """
        problems: list[str] = []
        entry = next((p for p in self._config.providers if p.name == inp.provider), None)
        if entry is None or inp.provider not in self._providers:
            known = ", ".join(sorted(self._providers)) or "none"
            problems.append(f"provider: unknown provider {inp.provider!r} (configured: {known})")
        else:
            kind = provider_type(entry.type)
            for key in sorted(set(inp.placement) - kind.placement_keys):
                problems.append(
                    f"placement.{key}: not supported by provider {inp.provider!r} "
                    f"(type {entry.type})"
                )
            problems += entry.settings.placement_problems(inp.placement)
        ports = self._config.proxy.allowed_connect_ports
        target_port = _port_of(inp.health_target)
        excepted = _authority_of(inp.health_target) in self._config.proxy.destination_exceptions
        if target_port is not None and target_port not in ports and not excepted:
            problems.append(
                f"health.target: port {target_port} is not in the proxies' "
                f"allowed_connect_ports {ports}, so every probe would be refused"
            )
        return TargetCheck(problems, self._config.installation)

    @activity.defn(name="create_instance")
    async def create_instance(self, inp: CreateInstanceInput) -> InstanceRef:
        """Create (or adopt) the instance for this owner and generation.

        The name and tags scope it to this installation and the owner's
        Temporal namespace, so another installation or namespace sharing the
        project or cluster never derives the same name nor garbage-collects it.
        """
        installation = self._config.installation
        if inp.installation and inp.installation != installation:
            raise to_application_error(
                Permanent(
                    f"this workflow belongs to installation {inp.installation!r}, but the "
                    f"worker that ran its create is installation {installation!r}: two "
                    "installations share one task queue in one namespace"
                )
            )
        namespace = activity.info().workflow_namespace or ""
        name = instance_name(
            inp.owner_id,
            inp.generation,
            installation=inp.installation or None,
            namespace=namespace,
        )
        request = CreateRequest(
            name=name,
            proxy=self._config.proxy_settings(inp.port),
            tags=owner_tags(
                installation, inp.owner_id, inp.generation, inp.labels, namespace=namespace
            ),
            placement=dict(inp.placement),
        )
        provider = self._provider(inp.provider)
        call = asyncio.ensure_future(self._call(provider.create, request))
        # Heartbeat while the provider works: a lost worker is then noticed
        # within the heartbeat timeout, and the retry adopts the instance by
        # its name, instead of the server waiting out the start-to-close.
        while not call.done():
            activity.heartbeat(f"creating {name}")
            await asyncio.wait([call], timeout=CREATE_HEARTBEAT_SECONDS)
        instance = call.result()
        return _ref(inp.provider, inp.generation, instance)

    @activity.defn(name="wait_running")
    async def wait_running(self, inp: InstanceInput) -> InstanceRef:
        """Poll until the instance is RUNNING with an address.

        An instance that dies or vanishes meanwhile, or is not running by the
        deadline, is reported as InstanceLost (non-retryable) with the
        provider's reason: the workflow replaces it and shows why.
        """
        ref = inp.instance
        provider = self._provider(ref.provider)
        delay = FIRST_POLL_SECONDS
        deadline = activity.info().scheduled_time + timedelta(seconds=WAIT_RUNNING_DEADLINE_SECONDS)
        while True:
            try:
                instance = await self._call(provider.get, ref.provider_id)
            except ApplicationError as err:
                if is_not_found(err) and disruption_of(err) is not None:
                    raise instance_disrupted(
                        f"{ref.name} is gone while provisioning, {err.message}"
                    ) from err
                if is_not_found(err):
                    raise instance_lost(f"{ref.name} vanished while provisioning") from err
                raise
            if instance.state is InstanceState.RUNNING and instance.ip:
                return _ref(ref.provider, ref.generation, instance)
            because = f": {instance.reason}" if instance.reason else ""
            if instance.state in GONE_STATES:
                lost = instance_disrupted if instance.disruption else instance_lost
                raise lost(f"{ref.name} is {instance.state.value} while provisioning{because}")
            if datetime.now(UTC) >= deadline:
                raise instance_lost(
                    f"{ref.name} not running after {WAIT_RUNNING_DEADLINE_SECONDS:g}s "
                    f"({instance.state.value}{because})"
                )
            activity.heartbeat(instance.state.value + because)
            await _pause(delay)
            delay = min(delay * 2, MAX_POLL_SECONDS)

    @activity.defn(name="wait_healthy")
    async def wait_healthy(self, inp: ProbeInput) -> ProbeSummary:
        """Probe until one CONNECT succeeds or the deadline passes.

        Returns the last result either way; the workflow decides what a
        proxy that never became healthy means. An instance found dead or
        deleted meanwhile (say, by a worker restart that stopped local
        proxies) is reported as InstanceLost at once instead of at the deadline.
        """
        started = time.monotonic()
        deadline = started + inp.deadline_seconds
        report_at = None if inp.report_after_seconds is None else started + inp.report_after_seconds
        next_check = started + GONE_CHECK_SECONDS
        delay = FIRST_POLL_SECONDS
        attempts = 0
        recheck: asyncio.Task[None] | None = None
        try:
            while True:
                summary = _summarise(
                    await self._probe(inp.instance, inp.target, inp.timeout_seconds)
                )
                attempts += 1
                now = time.monotonic()
                if summary.ok or now >= deadline or (report_at is not None and now >= report_at):
                    return replace(summary, attempts=attempts)
                if recheck is None:
                    # Alongside the probes, which heartbeat: a repair waits on
                    # an operation longer than the heartbeat timeout.
                    recheck = asyncio.create_task(self._recheck_access(inp.instance))
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + GONE_CHECK_SECONDS
                    gone = await self._gone(inp.instance)
                    if gone is not None:
                        raise gone.error("while waiting for its first probe")
                activity.heartbeat(summary)
                await _pause(delay)
                delay = min(delay * 2, MAX_POLL_SECONDS)
        finally:
            if recheck is not None:
                recheck.cancel()

    @activity.defn(name="monitor")
    async def monitor(self, inp: MonitorInput) -> MonitorOutcome:
        """Probe every interval; return only when something changed.

        This loop is what keeps steady state cheap: no history event per
        probe, just throttled heartbeats whose details show the last probe in
        the Web UI. It returns `unhealthy` after `failure_threshold`
        consecutive failures, `gone` as soon as a failed probe finds the
        instance dead or deleted, `elapsed` after `max_duration_seconds`, and
        `handover` when this worker starts shutting down. A platform's advice
        to replace the instance soon (ReplacementAdvice) does not end it: it
        asks the proxy's workflow for a rotation and goes on probing.
        """
        info = activity.info()
        previous = info.heartbeat_details[0] if info.heartbeat_details else None
        carried = previous if isinstance(previous, dict) else {}
        failures = int(carried.get("consecutive_failures", 0))
        # A retried attempt shows the lost attempt's last probe until its own.
        details: dict[str, object] = {
            "last_probe": carried.get("last_probe"),
            "consecutive_failures": failures,
        }
        timeout = info.heartbeat_timeout or UNTIMED_HEARTBEAT
        period = max(timeout - MONITOR_HEARTBEAT_SLACK, timeout / 2)
        async with _heartbeating(period, details):
            return await self._monitor_loop(inp, failures, details)

    async def _monitor_loop(
        self, inp: MonitorInput, failures: int, details: dict[str, object]
    ) -> MonitorOutcome:
        """The monitor's probes; `details` is what its heartbeats carry, updated in place."""
        started = time.monotonic()
        probes = 0
        advice_taken = False
        while True:
            tick = time.monotonic()
            summary = _summarise(
                await self._probe(inp.instance, inp.target, inp.probe_timeout_seconds)
            )
            probes += 1
            failures = 0 if summary.ok else failures + 1
            details.update(last_probe=summary, consecutive_failures=failures)
            if probes == 1:
                # Show the first probe now, not one heartbeat period later.
                activity.heartbeat(dict(details))
            if summary.ok and not advice_taken:
                advice_taken = await self._rotate_if_advised(inp.instance)
            if not summary.ok:
                gone = await self._gone(inp.instance)
                if gone is not None:
                    return MonitorOutcome(
                        MonitorReason.GONE,
                        summary,
                        failures,
                        probes,
                        gone.detail,
                        disruption=gone.disruption,
                    )
                if failures == 1:
                    # The heartbeats run on their own clock meanwhile.
                    await self._recheck_access(inp.instance)
                if failures >= inp.failure_threshold:
                    return MonitorOutcome(
                        MonitorReason.UNHEALTHY,
                        summary,
                        failures,
                        probes,
                        f"{failures} failed probes in a row",
                    )
            if time.monotonic() - started >= inp.max_duration_seconds:
                return MonitorOutcome(MonitorReason.ELAPSED, summary, failures, probes)
            pause = max(0.0, inp.interval_seconds - (time.monotonic() - tick))
            if await _worker_shutting_down_within(pause):
                # Hand over now instead of at the end of the drain: the
                # workflow starts the next monitor, which another worker runs.
                return MonitorOutcome(
                    MonitorReason.HANDOVER, summary, failures, probes, "worker shutting down"
                )

    async def _rotate_if_advised(self, ref: InstanceRef) -> bool:
        """On its platform's advice, ask the proxy's workflow to replace `ref` make-before-break.

        The `rotate` signal, as max lifetime rotates: the replacement serves
        before the platform takes the instance. Sent once per instance: not
        when the workflow's status shows it serving from another instance or
        already replacing this one (a monitor on another worker, or after a
        handover, asks the workflow, not its memory). True once nothing is
        left to do for this instance; False to ask again after the next probe.
        """
        provider = self._provider(ref.provider)
        if not isinstance(provider, ReplacementAdvice):
            return True
        try:
            advice = await self._call(provider.replacement_advised, ref.provider_id)
        except ApplicationError:
            return False  # cannot tell right now
        if advice is None:
            return False
        workflow_id = activity.info().workflow_id
        if workflow_id is None:
            return True  # not scheduled by a workflow
        return await _ask_rotation(workflow_id, ref.name, Advice(ref.provider_id, advice))

    @contextlib.asynccontextmanager
    async def _advising(self) -> AsyncIterator[Callable[[list[WatchedMember]], None]]:
        """A pool shard's asks for its platform's advice, one at a time, alongside its rounds.

        Yields what a round calls with the members whose probe just passed:
        it starts an ask unless one is under way (a provider's calls take
        longer than a probe). An ask still running at the end is cancelled.
        """
        taken: set[str] = set()
        asking: asyncio.Task[None] | None = None

        def ask(passed: list[WatchedMember]) -> None:
            nonlocal asking
            if asking is None or asking.done():
                asking = asyncio.create_task(self._rotate_advised_members(passed, taken))

        try:
            yield ask
        finally:
            if asking is not None:
                asking.cancel()

    async def _rotate_advised_members(self, members: list[WatchedMember], taken: set[str]) -> None:
        """On their platform's advice, ask pool members' workflows to rotate, make-before-break.

        A pool member runs no monitor of its own: its pool's shard asks
        each member's provider about the members whose probe just passed,
        all of a provider's at once, by member id and endpoint (the pool
        advertises only endpoints its provider confirmed are the member's
        own). The `rotate` goes to the member, as `_rotate_if_advised`
        sends it, once per instance; `taken` holds the instances nothing is
        left to do for. A provider that cannot tell right now is asked
        again after the next round.
        """
        serving: dict[str, dict[str, str]] = {}
        for member in members:
            serving.setdefault(member.provider, {})[member.member] = member.endpoint
        for name, endpoints in serving.items():
            provider = self._providers.get(name)
            if not isinstance(provider, ReplacementAdvice):
                continue
            try:
                advised = await self._call(provider.replacements_advised, endpoints)
            except ApplicationError as err:
                activity.logger.info("cannot ask %s for advice now: %s", name, err.message)
                continue
            for member_id, advice in advised.items():
                if advice.provider_id in taken or member_id not in endpoints:
                    continue
                if await _ask_rotation(member_id, member_id, advice):
                    taken.add(advice.provider_id)

    @activity.defn(name="monitor_members")
    async def monitor_members(self, inp: PoolMonitorInput) -> PoolMonitorOutcome:
        """Probe a shard of a pool's members every interval; return when any keeps failing.

        What makes a pool member cheap: one heartbeat for up to a shard of
        members (policies.POOL_MONITOR_SHARD) instead of a monitor each. It
        probes the endpoints the pool advertises each round, their starts
        spread over the first half of the interval (ROUND_SPREAD), and
        returns `unhealthy` naming every member that failed
        `failure_threshold` probes in a row; the pool tells those members,
        and each checks its own instance before it acts. `elapsed` and
        `handover` as the proxy's own monitor.
        """
        info = activity.info()
        previous = info.heartbeat_details[0] if info.heartbeat_details else None
        counted = previous.get("failing") if isinstance(previous, dict) else None
        # Only members still failing are carried: the details stay small.
        failures = {
            m.member: int(counted.get(m.member, 0)) if isinstance(counted, dict) else 0
            for m in inp.members
        }
        details: dict[str, object] = {
            "members": len(inp.members),
            "failing": {},
            "round": None,
            # When the shard last found its pool run still the pool's open run.
            "run_open_at": None,
        }
        timeout = info.heartbeat_timeout or UNTIMED_HEARTBEAT
        period = max(timeout - MONITOR_HEARTBEAT_SLACK, timeout / 2)
        try:
            async with _heartbeating(period, details), self._advising() as advise:
                return await self._members_loop(inp, failures, details, advise)
        except asyncio.CancelledError:
            cancelled = activity.cancellation_details()
            if cancelled is None or not cancelled.not_found:
                raise
            # The pool's run that started this shard has continued as new (its
            # next run started shards of its own): nobody is waiting for an
            # answer, and a cancel error would read as a failure in the log.
            return PoolMonitorOutcome(MonitorReason.HANDOVER, [], 0)

    async def _members_loop(
        self,
        inp: PoolMonitorInput,
        failures: dict[str, int],
        details: dict[str, object],
        advise: Callable[[list[WatchedMember]], None],
    ) -> PoolMonitorOutcome:
        """The pool monitor's rounds; `details` is what its heartbeats carry, updated in place.

        After each round, `advise` is given the members whose probe passed.
        """
        started = time.monotonic()
        probes = 0
        due = checked = started
        while True:
            tick = time.monotonic()
            # A round that starts late means this worker cannot keep up.
            POOL_MONITOR_LATE_SECONDS.observe(max(0.0, tick - due))
            due = tick + inp.interval_seconds
            results = await self._round(inp)
            probes += len(results)
            advise([m for m, r in zip(inp.members, results, strict=True) if r.ok])
            failing: list[FailingMember] = []
            for member, result in zip(inp.members, results, strict=True):
                failures[member.member] = 0 if result.ok else failures[member.member] + 1
                if failures[member.member] >= inp.failure_threshold:
                    why = ": ".join(x for x in (result.failure, result.error) if x)
                    detail = f"{failures[member.member]} failed probes in a row ({why})"
                    failing.append(
                        FailingMember(member.member, member.endpoint, detail[:MAX_DETAIL])
                    )
            details.update(
                failing={m: n for m, n in failures.items() if n},
                round=datetime.now(UTC).isoformat(timespec="seconds"),
            )
            if failing:
                return PoolMonitorOutcome(MonitorReason.UNHEALTHY, failing, probes)
            if time.monotonic() - started >= inp.max_duration_seconds:
                return PoolMonitorOutcome(MonitorReason.ELAPSED, [], probes)
            if time.monotonic() - checked >= HANDOVER_CHECK_SECONDS:
                checked = time.monotonic()
                if await _shard_released():
                    return PoolMonitorOutcome(MonitorReason.HANDOVER, [], probes)
                details["run_open_at"] = datetime.now(UTC).isoformat(timespec="seconds")
            pause = max(0.0, inp.interval_seconds - (time.monotonic() - tick))
            if await _worker_shutting_down_within(pause):
                return PoolMonitorOutcome(MonitorReason.HANDOVER, [], probes)

    async def _round(self, inp: PoolMonitorInput) -> list[ProbeResult]:
        """One probe of each member, in the shard's order, their starts spread evenly over
        ROUND_SPREAD of the interval."""
        gap = inp.interval_seconds * ROUND_SPREAD / max(len(inp.members), 1)

        async def probe(k: int, member: WatchedMember) -> ProbeResult:
            await asyncio.sleep(k * gap)
            return await self._probe_member(member, inp)

        return await asyncio.gather(*(probe(k, m) for k, m in enumerate(inp.members)))

    async def _probe_member(self, member: WatchedMember, inp: PoolMonitorInput) -> ProbeResult:
        """One probe through a member's advertised endpoint; an unusable endpoint fails it."""
        address = split_endpoint(member.endpoint)
        if address is None:
            return ProbeResult(ok=False, failure=OTHER, error=f"not host:port: {member.endpoint!r}")
        ref = InstanceRef(member.provider, "", member.member, 0, ip=address[0], port=address[1])
        return await self._probe(ref, inp.target, inp.probe_timeout_seconds)

    @activity.defn(name="verify_endpoint")
    async def verify_endpoint(self, inp: VerifyEndpointInput) -> EndpointCheck:
        """Whether the member's own instance serves at the endpoint its report names.

        The pool's members report their endpoints by signal, which anyone
        with access to the namespace can forge, and a gateway sends the
        fleet's credentials to every endpoint the pool lists. So the pool
        lists one only once this says yes: the provider has a RUNNING
        instance at that address whose tags name this installation, this
        Temporal namespace and this member as its owner, tags only this
        installation writes. Provider faults raise (and are retried); a
        claim that does not hold is an answer, not an error.
        """
        provider = self._provider(inp.provider)
        namespace = activity.info().workflow_namespace
        # A miss by name (a lifecycle on the old name formula, a claim about
        # another generation) is asked of the full listing.
        for lookup in (self._named_instance, self._owned_instances):
            for instance in await lookup(provider, inp, namespace):
                mismatch = ownership_mismatch(
                    instance.tags,
                    self._config.installation,
                    owner_id=inp.owner_id,
                    namespace=namespace,
                )
                if (
                    mismatch is None
                    and instance.state is InstanceState.RUNNING
                    and (instance.endpoint == inp.endpoint)
                ):
                    return await self._exit_check(instance, inp.echo_url)
        return EndpointCheck(
            verified=False,
            problem=(
                f"provider {inp.provider!r} has no running instance of {inp.owner_id} "
                f"at {inp.endpoint[:100]!r}"
            ),
        )

    async def _named_instance(
        self, provider: Provider, inp: VerifyEndpointInput, namespace: str | None
    ) -> list[Instance]:
        """The member's instance of the reported generation, by name, when the provider
        can look one up so (none otherwise): the name alone proves nothing, its tags do."""
        if inp.generation is None or not isinstance(provider, NamedLookup):
            return []
        name = instance_name(
            inp.owner_id,
            inp.generation,
            installation=self._config.installation,
            namespace=namespace or "",
        )
        instance = await self._call(provider.find, name, inp.placement)
        return [] if instance is None else [instance]

    async def _owned_instances(
        self, provider: Provider, inp: VerifyEndpointInput, _namespace: str | None
    ) -> list[Instance]:
        """Every instance tagged with the member as its owner."""
        return await self._call(provider.list_by_tag, OWNER_KEY, inp.owner_id)

    async def _exit_check(self, instance: Instance, echo_url: str) -> EndpointCheck:
        """A confirmed endpoint and its exit: as the echo service saw it, else the provider's."""
        known = instance.exit_address or ""
        if not echo_url:
            return EndpointCheck(verified=True, exit_address=known)
        try:
            seen = await observe_exit(
                instance.ip,
                instance.port,
                self._config.proxy.auth.username,
                self._config.proxy_settings().password,
                echo_url,
                ssl_context=self._ssl,
            )
        except EchoFailed as err:
            return EndpointCheck(verified=True, exit_address=known, exit_problem=str(err)[:200])
        return EndpointCheck(verified=True, exit_address=seen)

    @activity.defn(name="delete_instance")
    async def delete_instance(self, inp: InstanceInput) -> None:
        """Start deleting; an instance already gone is success."""
        ref = inp.instance
        try:
            await self._call(self._provider(ref.provider).delete, ref.provider_id)
        except ApplicationError as err:
            if not is_not_found(err):
                raise

    @activity.defn(name="wait_gone")
    async def wait_gone(self, inp: InstanceInput) -> None:
        """Poll until the provider no longer knows the instance.

        Re-issues the delete now and then: a delete accepted by an API is not
        always a delete carried out, and a leaked instance keeps costing.
        """
        ref = inp.instance
        provider = self._provider(ref.provider)
        delay = FIRST_POLL_SECONDS
        last_delete = time.monotonic()
        while True:
            try:
                instance = await self._call(provider.get, ref.provider_id)
            except ApplicationError as err:
                if is_not_found(err):
                    return
                raise
            activity.heartbeat(instance.reason or instance.state.value)
            if time.monotonic() - last_delete >= REDELETE_AFTER_SECONDS:
                await self.delete_instance(inp)
                last_delete = time.monotonic()
            await _pause(delay)
            delay = min(delay * 2, MAX_POLL_SECONDS)

    async def _probe(self, ref: InstanceRef, target: str, timeout_seconds: float) -> ProbeResult:
        request = ProbeRequest(
            instance=ref,
            target=target,
            username=self._config.proxy.auth.username,
            password=self._config.proxy_settings().password,
            timeout_seconds=timeout_seconds,
            ssl_context=self._ssl,
        )
        result = await self._probe_instance(request)
        PROBES.labels(ref.provider, "ok" if result.ok else str(result.failure)).inc()
        if result.ok and result.total_ms is not None:
            PROBE_SECONDS.labels(ref.provider).observe(result.total_ms / 1000)
        return result

    async def _recheck_access(self, ref: InstanceRef) -> None:
        """Tell a provider that keeps a firewall rule (AccessCheck) that `ref` failed a probe.

        Best effort: a failed check is logged and the probes go on; the
        provider's next create checks the rule again anyway.
        """
        provider = self._provider(ref.provider)
        if not isinstance(provider, AccessCheck):
            return
        try:
            await self._call(
                provider.recheck_access, ref.provider_id, self._config.proxy_settings(ref.port)
            )
        except ApplicationError as err:
            activity.logger.warning("cannot check access to %s: %s", ref.name, err.message)

    async def _gone(self, ref: InstanceRef) -> Gone | None:
        """Why the instance can no longer serve, or None while it still exists."""
        try:
            instance = await self._call(self._provider(ref.provider).get, ref.provider_id)
        except ApplicationError as err:
            if not is_not_found(err):
                return None  # cannot tell right now: keep counting failed probes
            disruption = disruption_of(err)
            if disruption is None:
                return Gone(f"{ref.name} no longer exists")
            return Gone(f"{ref.name} is gone, {err.message}", disruption)
        if instance.state in GONE_STATES:
            because = f": {instance.reason}" if instance.reason else ""
            return Gone(f"{ref.name} is {instance.state.value}{because}", instance.disruption)
        return None

    def _provider(self, name: str) -> Provider:
        try:
            return self._providers[name]
        except KeyError:
            raise invalid_input(f"provider: unknown provider {name!r}") from None

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a sync provider call on the pool; taxonomy errors become ApplicationErrors."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except Exception as err:
            raise to_application_error(classify(err)) from err


async def _pause(seconds: float) -> None:
    """Sleep between polls; on worker shutdown, hand the activity to another worker.

    The retryable error ends the attempt at once instead of at the end of the
    drain, and the server retries it on a worker that is staying.
    """
    if await _worker_shutting_down_within(seconds):
        # Benign: the SDK logs it at debug, not as a warning with a traceback.
        raise ApplicationError(
            "worker shutting down; retrying elsewhere",
            type=ErrorType.WORKER_SHUTDOWN,
            category=ApplicationErrorCategory.BENIGN,
        )


@contextlib.asynccontextmanager
async def _heartbeating(period: timedelta, details: dict[str, object]) -> AsyncIterator[None]:
    """Heartbeat `details` every `period` while the block runs, whatever it is doing.

    The block updates `details` in place. Each heartbeat sends a copy: the SDK
    encodes heartbeat details later, on a task of its own.
    """

    async def beat() -> None:
        while True:
            await asyncio.sleep(period.total_seconds())
            activity.heartbeat(dict(details))

    beats = asyncio.create_task(beat())
    try:
        yield
    finally:
        beats.cancel()


async def _ask_rotation(workflow_id: str, name: str, advice: Advice) -> bool:
    """Send proxy `workflow_id` a `rotate` for `advice` unless nothing is left to do.

    Not when its status shows it serving from another instance or already
    replacing this one: it asks the workflow, not a memory, so monitors on
    several workers, or after a handover, send it once per instance. True
    once nothing is left to do for the instance; False when the workflow
    could not be asked (ask again later).
    """
    try:
        client = activity.client()
    except RuntimeError:
        return True  # an ActivityEnvironment given no client: nobody to tell
    workflow = client.get_workflow_handle(workflow_id)
    try:
        status = await workflow.query("status")
        if not isinstance(status, dict) or status.get("provider_id") != advice.provider_id:
            return True  # the workflow serves from another instance
        if status.get("replaced_because"):
            return True  # already being replaced
        await workflow.signal(ROTATE_SIGNAL, {"reason": advice.reason})
    except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
        activity.logger.info("%s: %s; asking again later", name, err)
        return False
    activity.logger.info("%s: %s; asked its workflow to rotate it", name, advice.reason)
    return True


async def _shard_released() -> bool:
    """Whether the workflow run that scheduled this activity no longer wants it: it is
    no longer its workflow's open run, or it has asked to cancel this activity.

    Only asked where a client is at hand (a worker's activities always have
    one); a failed ask is no answer, and the next round asks again.
    """
    info = activity.info()
    try:
        client = activity.client()
    except RuntimeError:
        return False  # an ActivityEnvironment given no client
    if info.workflow_id is None:
        return False  # not scheduled by a workflow
    try:
        described = await client.get_workflow_handle(info.workflow_id).describe(
            rpc_timeout=HANDOVER_CHECK_TIMEOUT
        )
    except RPCError as err:
        return err.status == RPCStatusCode.NOT_FOUND
    if described.run_id != info.workflow_run_id or (
        described.status is not WorkflowExecutionStatus.RUNNING
    ):
        return True
    return any(
        pending.activity_id == info.activity_id
        and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_CANCEL_REQUESTED
        for pending in described.raw_description.pending_activities
    )


async def _worker_shutting_down_within(seconds: float) -> bool:
    """Sleep `seconds`, or less if the worker starts shutting down (then True)."""
    try:
        await asyncio.wait_for(activity.wait_for_worker_shutdown(), timeout=seconds)
    except TimeoutError:
        return False
    return True


def _ref(provider: str, generation: int, instance: Instance) -> InstanceRef:
    return InstanceRef(
        provider=provider,
        provider_id=instance.provider_id,
        name=instance.name,
        generation=generation,
        ip=instance.ip,
        port=instance.port,
        created_at=instance.created_at.isoformat(),
        exit_address=instance.exit_address or "",
    )


def _port_of(url: str) -> int | None:
    """The port a probe would CONNECT to, or None for a URL not worth checking."""
    if not url:
        return None
    try:
        return urlsplit(url).port or 443
    except ValueError:
        return None


def _authority_of(url: str) -> str:
    """`host:port` of the URL, as `proxy.destination_exceptions` spells a destination."""
    try:
        parts = urlsplit(url)
        return f"{parts.hostname}:{parts.port or 443}"
    except ValueError:
        return ""


def _summarise(result: ProbeResult) -> ProbeSummary:
    return ProbeSummary(
        ok=result.ok,
        at=datetime.now(UTC).isoformat(timespec="seconds"),
        total_ms=None if result.total_ms is None else round(result.total_ms, 1),
        failure=result.failure,
        error=result.error,
    )
