"""proxy-operator-gateway: one stable proxy endpoint over a ProxyPool, or several.

    proxy-operator-gateway --pool pool-demo --listen 0.0.0.0:8888 --providers-config providers.yaml

Clients authenticate with the proxies' username and password (from the same
providers config and PROXY_PASSWORD as the worker), or a users file's
(`--users-file`, gateway/users.py), and pick a member by username: `USER`
rotates per CONNECT, `USER-session-<key>` sticks to one member per key,
`USER-proxy-<member>` pins one member, and `-zone-`, `-region-` and
`-provider-` filters narrow any of them (docs/operations.md). A control API
(`--api-listen`, gateway/api.py) names a session's member and takes bans. The members are the
pool's `endpoints`, followed by polling, less any outside `--member-networks`
(gateway/member_networks.py); `--pool` repeated puts several pools' members
behind the one endpoint (gateway/pools.py). Temporal is reached with the
worker's connection settings (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TLS, API
key, profiles). The gateway holds no state: run as many as you like.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import NoReturn

from temporalio.service import RPCError

import cli
from cli import connect, serve_metrics
from gateway import api_settings, demand, membership, metrics, pools, wake
from gateway.api import ControlApi
from gateway.api_pool import PoolControl
from gateway.health import GatewayHealth, stale_after
from gateway.member_networks import MemberNetworks, configured_networks, parse_networks
from gateway.pools import Pools
from gateway.sessions import SessionMap, record_router_line
from gateway.squid import GatewayError, GatewaySquid
from gateway.users import UsersFileError
from gateway.users_follow import UsersFollower, load_users
from providers.base import split_endpoint
from providers.config import Config, ConfigError, load_config
from squid.conf import ProxySettings
from squid.gateway import GatewayMember, fleet_login

DEFAULT_LISTEN = "0.0.0.0:8888"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9465"
METRICS_ENV = "PROXY_OPERATOR_GATEWAY_METRICS_ADDRESS"
# One client address's connections at the front, at most: room for a crawler's
# worth of tunnels, not for one address holding the front's descriptors.
DEFAULT_CLIENT_CONNECTIONS = 1000
# A membership change's log line names at most this many members in, and as many out.
LOGGED_MEMBERS = 10
# A describe is not billed (docs/cost.md) and the server answers it from the
# workflow's cached state, so the poll is what a change waits for: 0.5 s puts
# a change in traffic within about 0.3 s at the median, at two describes a
# second per pool per gateway, a small share of a namespace's request rate.
DEFAULT_POLL_SECONDS = 0.5
# Below this the describes would cost the server more than they save anyone.
MIN_POLL_SECONDS = 0.1
# The router takes a change between two requests: nothing to batch, so none.
DEFAULT_DEBOUNCE_SECONDS = 0.0
SUPERVISE_SECONDS = 1.0

log = logging.getLogger("proxy_operator.gateway")


class UsageError(Exception):
    """A bad flag or environment value, named."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.argument_parser(
        "proxy-operator-gateway",
        __doc__,
        metrics_env=METRICS_ENV,
        metrics_default=DEFAULT_METRICS_ADDRESS,
    )
    pools.add_arguments(parser)
    cli.env_argument(
        parser,
        "--listen",
        "PROXY_OPERATOR_GATEWAY_LISTEN",
        "host:port clients connect to",
        DEFAULT_LISTEN,
    )
    cli.env_argument(
        parser,
        "--state-dir",
        "PROXY_OPERATOR_GATEWAY_STATE_DIR",
        "where Squid's configs and logs go; unset, a private temporary directory",
    )
    cli.env_argument(
        parser,
        "--member-networks",
        "PROXY_OPERATOR_GATEWAY_MEMBER_NETWORKS",
        "CIDR,... the only networks a member's endpoint may be in; unset, the providers "
        "config's (the local provider's bind address; required with Kubernetes or GCP)",
    )
    cli.env_argument(
        parser,
        "--client-max-connections",
        "PROXY_OPERATOR_GATEWAY_CLIENT_MAX_CONNECTIONS",
        "the most connections one client address may hold open at once (more are "
        "dropped until it closes some); 0: no limit",
        str(DEFAULT_CLIENT_CONNECTIONS),
        type=client_connections,
    )
    parser.add_argument(
        "--allow-member-hostnames",
        action="store_true",
        help="let a member's endpoint be a hostname (refused by default: a name can "
        "resolve anywhere)",
    )
    cli.seconds_argument(
        parser,
        "--poll-interval",
        DEFAULT_POLL_SECONDS,
        "seconds between looks at each pool: a describe (not billed), and the endpoints "
        f"query only when they changed; at least {MIN_POLL_SECONDS:g}",
    )
    cli.seconds_argument(
        parser,
        "--debounce",
        DEFAULT_DEBOUNCE_SECONDS,
        "seconds a membership change must hold still before it goes to the router (0: at once)",
    )
    demand.add_arguments(parser)
    cli.env_argument(
        parser,
        "--users-file",
        "PROXY_OPERATOR_GATEWAY_USERS_FILE",
        "more client credentials, `name:hash` a line (python -m gateway.users hash NAME), "
        "optionally limited (zones=, tunnels=); followed as it changes",
    )
    api_settings.add_arguments(parser)
    wake.add_arguments(parser)
    args = parser.parse_args(argv)
    pools.from_environment(args)
    return args


def client_connections(value: str) -> int | None:
    """`--client-max-connections`: a count, or None for 0 (no limit)."""
    try:
        count = int(value)
    except ValueError:
        count = -1
    if not 0 <= count <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number from 0 to 1000000")
    return count or None


def listen_address(value: str) -> tuple[str, int]:
    parsed = split_endpoint(value)
    if parsed is None:
        raise UsageError(f"--listen: {value!r} is not host:port (e.g. 0.0.0.0:8888)")
    return parsed


def checked(args: argparse.Namespace) -> tuple[list[str], tuple[str, int]]:
    """The pool ids and listen address, or UsageError naming what is wrong."""
    problems = pools.usage_problems(args.pool)
    if not args.providers_config:
        problems.append("--providers-config (or PROXY_OPERATOR_CONFIG) is required")
    if not MIN_POLL_SECONDS <= args.poll_interval <= 3600:
        problems.append(
            f"--poll-interval: {args.poll_interval} is not between {MIN_POLL_SECONDS:g} and "
            "3600 seconds"
        )
    if not 0 <= args.debounce <= 3600:
        problems.append(f"--debounce: {args.debounce} is not between 0 and 3600 seconds")
    try:
        listen = listen_address(args.listen)
    except UsageError as err:
        problems.append(str(err))
        listen = ("", 0)
    problems += demand.usage_problems(args) + wake.usage_problems(args)
    if problems:
        raise UsageError("; ".join(problems))
    return list(args.pool), listen


def member_networks(args: argparse.Namespace, config: Config) -> MemberNetworks:
    """Where members may be (gateway/member_networks.py), or UsageError naming the flag."""
    flag = "--member-networks (or PROXY_OPERATOR_GATEWAY_MEMBER_NETWORKS)"
    try:
        networks = (
            parse_networks(args.member_networks, flag)
            if args.member_networks
            else configured_networks(config, flag)
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    return MemberNetworks(networks, allow_hostnames=args.allow_member_hostnames)


def main(argv: list[str] | None = None) -> int:
    cli.configure_logging()
    args = parse_args(argv)
    health = GatewayHealth(args.pool or [], stale_after(args.poll_interval, args.debounce))
    try:
        pool_ids, listen = checked(args)
        config = load_config(args.providers_config)
        allowed = member_networks(args, config)
        api = api_settings.api_settings(args)
        users = (
            load_users(Path(args.users_file), config.proxy_settings().username)
            if args.users_file
            else None
        )
        if args.metrics_address:
            # Aggregates only: members and exits are the control API's, behind its token.
            serve_metrics(args.metrics_address, health, metrics.PUBLIC, METRICS_ENV)
    except UsersFileError as err:
        print(f"error: --users-file (or PROXY_OPERATOR_GATEWAY_USERS_FILE): {err}", file=sys.stderr)
        return 2
    except (UsageError, ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(
            serve(args, pool_ids, listen, config.proxy_settings(), allowed, health, api, users)
        )
    except membership.PoolNotFound as err:
        print(f"error: --pool: {err}", file=sys.stderr)
        return 2
    except membership.PoolClosed as err:
        print(f"error: {err}; the gateway stops (docs/operations.md)", file=sys.stderr)
        return 1
    except (GatewayError, RPCError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def serve(
    args: argparse.Namespace,
    pool_ids: list[str],
    listen: tuple[str, int],
    settings: ProxySettings,
    allowed: MemberNetworks,
    health: GatewayHealth,
    api: api_settings.ApiSettings | None = None,
    users: str | None = None,
) -> int:
    try:
        client = await connect()
    except RuntimeError as err:  # what the SDK raises for an unreachable server
        raise GatewayError(f"cannot connect to Temporal: {err}") from err
    # A pool that does not exist stops us here; one that has closed, once none is open.
    followed = Pools(client, pool_ids, allowed, health)
    await followed.start()

    # An autoscaled pool's wake holder is the router's stand-in for it while it has no member.
    holding = contextlib.AsyncExitStack()
    followed.holders = await holding.enter_async_context(
        wake.holding(
            args,
            client,
            followed.open(),
            demand.name_of(args, listen),
            followed.fetch,
            fleet_login(settings.username, settings.password),
        )
    )
    members = followed.routed()
    private = args.state_dir is None
    state_dir = Path(args.state_dir) if args.state_dir else _private_dir()
    squid = GatewaySquid(
        settings,
        state_dir / "squid",
        listen,
        users=users,
        client_connections=args.client_max_connections,
        pool_of=followed.pool_of,
    )
    names = metrics.MemberNames()
    for member in members:
        names.add(member.member)
    follower = metrics.LogFollower()
    sessions = SessionMap()
    control: ControlApi | None = None
    following_users: asyncio.Task[None] | None = None
    on_sighup: list[Callable[[], None]] = []  # files read again: tokens, users

    def on_router_line(line: str) -> None:
        metrics.count_router_line(line, names)
        record_router_line(line, names, sessions)

    try:
        await asyncio.to_thread(squid.start, members)
        meter = demand.DemandMeter(squid.open_tunnels)
        follower.follow(squid.front.access_log, metrics.count_front_line)
        follower.follow(squid.router.access_log, on_router_line)
        follower.start()
        metrics.set_members(wake.real(members))
        followed.count()
        health.routes(members)
        if api is not None:
            pool_control = PoolControl(
                client,
                followed.open,
                settings.username,
                sessions,
                lambda: wake.real(squid.members),
                follower.catch_up,
            )
            control = ControlApi(
                pool_control,
                api.tokens,
                rate=api.rate,
                burst=api.burst,
                tls=api.tls,
                per_client=api.per_client,
                readiness=health.not_ready,
            )
            await control.start(*api.listen)
            on_sighup.append(control.reload_tokens)
        if users is not None:
            users_follower = UsersFollower(Path(args.users_file), settings.username, squid)
            following_users = asyncio.create_task(users_follower.follow())
            on_sighup.append(users_follower.reload)

        def reread() -> None:
            for reload in on_sighup:
                reload()

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reread)
        health.ready = True
        health.checked_squid()
        log.info(
            "gateway for %s on %s:%s, %d members",
            pools.named(followed.open()),
            listen[0],
            listen[1],
            len(members),
        )
        async with demand.reporting(args, client, followed.open, meter, listen):
            return await _run(args, squid, names, followed, health)
    finally:
        if following_users is not None:
            following_users.cancel()
        if control is not None:
            await control.close()
        await asyncio.to_thread(squid.stop)
        await holding.aclose()
        follower.stop()
        if private:
            shutil.rmtree(state_dir, ignore_errors=True)


async def _run(
    args: argparse.Namespace,
    squid: GatewaySquid,
    names: metrics.MemberNames,
    followed: Pools,
    health: GatewayHealth,
) -> int:
    async def apply(new: Sequence[GatewayMember]) -> bool:
        before = squid.in_force
        for member in new:
            names.add(member.member)
        try:
            with health.applying(), metrics.CHANGE_SECONDS.time():
                await asyncio.to_thread(squid.apply, new)
        except (GatewayError, subprocess.SubprocessError) as err:
            metrics.RELOADS.labels(outcome=metrics.RELOAD_FAILED).inc()
            log.error("membership change failed, keeping the previous members: %s", err)
            return False
        metrics.RELOADS.labels(outcome=metrics.RELOAD_OK).inc()
        metrics.set_members(wake.real(new))
        health.routes(new)
        after = squid.in_force
        log.info(
            "members now %d; in: %s; out: %s",
            len(squid.members),
            _some(after - before),
            _some(before - after),
        )
        return True

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    following = asyncio.create_task(
        followed.follow(apply, poll_seconds=args.poll_interval, debounce_seconds=args.debounce)
    )
    try:
        while not stop.is_set():
            if not squid.running():
                log.error("the gateway's Squid exited; stopping")
                return 1
            health.checked_squid()
            if following.done():
                following.result()  # raises what ended it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SUPERVISE_SECONDS)
        log.info("stopping")
        return 0
    finally:
        following.cancel()


def _some(members: AbstractSet[GatewayMember]) -> str:
    """Members named in a log line, with where each listens: a few, and how many more (one
    change can bring in or take out a whole pool, up to 1,000 members)."""
    shown = sorted(f"{m.member} at {m.host}:{m.port}" for m in members)[:LOGGED_MEMBERS]
    more = len(members) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "") if shown else "none"


def _private_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="proxy-operator-gateway-"))
    path.chmod(0o755)  # Squid's user must reach its own directories below
    return path


def run() -> NoReturn:
    """The console entry point; leaves as the worker's does (cli.run says why)."""
    cli.run(main)


if __name__ == "__main__":
    run()
