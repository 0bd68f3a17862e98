"""What the control API asks of the pools: their members, and bans, through Temporal.

`/v1/members` is each open pool's `status` query (every page of its members,
from a pool of any size: workflows/pool_status.py), cut to what a scraper
may see (never an endpoint's credentials: the pool holds none, and only the
member id, state, placement, provider and age are copied), each member with
its pool, joined with the session keys each member carried last
(gateway/sessions.py). A ban is the `report_ban` update of the pool that owns
the member (the one whose id prefixes it, `<pool>/<n>`), naming the endpoint
the gateway saw the member at, so a ban of a member that has rotated since
changes nothing. A ban by session names the member that carried the
session's latest tunnel, whatever joined or left since, at the endpoint it
carried it from.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

from temporalio.client import Client, WorkflowQueryFailedError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from gateway.api import ApiError
from gateway.placement import region_of, zone_of
from gateway.routing import userhash_member
from gateway.sessions import SessionMap
from proxy_operator.username import SESSION_INFIX, parse_gateway_username
from squid.gateway import GatewayMember
from workflows.pool_carried import aware_time
from workflows.pool_input import DEFAULT_PAGE, MAX_REPLICAS

log = logging.getLogger("proxy_operator.gateway")

STATUS_QUERY = "status"
BAN_UPDATE = "report_ban"
# A status answer is reused this long: many clients asking at once cost one query.
STATUS_CACHE_SECONDS = 1.0
TEMPORAL_SECONDS = 30.0
# Status pages read at most: a pool's largest size over its smallest default
# page, and one more (a pool from before pages answers in one).
MAX_STATUS_PAGES = MAX_REPLICAS // DEFAULT_PAGE + 1
# What the pool's refusal of a member it does not have starts with (workflows/pool.py).
NO_SUCH_MEMBER = "member: no member"
DEFAULT_REASON = "reported through the gateway's API"
MAX_LOGGED_REASON = 200


def endpoint_of(member: GatewayMember) -> str:
    """`member`'s endpoint as the pool writes it: `host:port`, `[v6]:port`."""
    host = f"[{member.host}]" if ":" in member.host else member.host
    return f"{host}:{member.port}"


def _age(ready_since: Any, now: datetime) -> int | None:
    since = aware_time(ready_since)
    return None if since is None else max(0, int((now - since).total_seconds()))


class PoolControl:
    """The API's view of the gateway's pools (gateway/api.py's `Pool`)."""

    def __init__(
        self,
        client: Client,
        pools: Callable[[], Sequence[str]],
        user: str,
        sessions: SessionMap,
        serving: Callable[[], Sequence[GatewayMember]],
        catch_up: Callable[[], None] = lambda: None,
    ) -> None:
        """`pools` gives the open pools' ids; `serving` the members the gateway forwards to
        now, with their endpoints; `user` is the account a session key is assumed to come
        with when none was seen; `catch_up` reads into `sessions` what the router logged so
        far (metrics.LogFollower.catch_up)."""
        self._catch_up = catch_up
        self._client = client
        self._user = user
        self._pools = pools
        self._sessions = sessions
        self._serving = serving
        self._status: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = asyncio.Lock()

    async def _query_statuses(self, pools: Sequence[str]) -> list[dict[str, Any]]:
        """Each pool's status, asked together; ApiError 503 naming a pool that did not answer."""
        async with self._lock:
            answers = await asyncio.gather(
                *(self._query_status(pool) for pool in pools), return_exceptions=True
            )
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return [answer for answer in answers if not isinstance(answer, BaseException)]

    async def _query_status(self, pool: str) -> dict[str, Any]:
        now = asyncio.get_running_loop().time()
        cached = self._status.get(pool)
        if cached is not None and now - cached[0] < STATUS_CACHE_SECONDS:
            return cached[1]
        try:
            status = await self._every_page(pool)
        except (RPCError, WorkflowQueryFailedError, TimeoutError) as err:
            log.warning("status query of pool %s for the API failed: %s", pool, err)
            raise ApiError(
                HTTPStatus.SERVICE_UNAVAILABLE, f"pool: cannot ask {pool!r} now"
            ) from None
        self._status[pool] = (now, status)
        return status

    async def _every_page(self, pool: str) -> dict[str, Any]:
        """The pool's status with the members of all its pages.

        The first query has no argument, as a pool of any release takes it;
        each page's `next_page` asks for the next, and the walk stops at
        the last page, at a page that goes no further, or past MAX_STATUS_PAGES.
        """
        status: dict[str, Any] = {}
        members: list[Any] = []
        request: Any = None
        handle = self._client.get_workflow_handle(pool)
        for _ in range(MAX_STATUS_PAGES):
            args = [] if request is None else [request]
            raw = await asyncio.wait_for(handle.query(STATUS_QUERY, args=args), TEMPORAL_SECONDS)
            page = raw if isinstance(raw, dict) else {}
            status = status or page
            members += page.get("members") or []
            after = request["after"] if request else None
            request = page.get("next_page")
            if not isinstance(request, dict) or request.get("after") == after:
                break
        return {**status, "members": members}

    async def members(self) -> dict[str, Any]:
        pools = list(self._pools())
        statuses = await self._query_statuses(pools)
        sessions = self._sessions.by_member()
        now = datetime.now(UTC)
        members = []
        for pool, status in zip(pools, statuses, strict=True):
            members += _listed(pool, status, sessions, now)
        # `pool` is what a gateway of one pool has always answered.
        single = {"pool": pools[0]} if len(pools) == 1 else {}
        return {**single, "pools": pools, "members": members}

    def session_member(self, key: str) -> str | None:
        """The member session `key` goes to now, or None if no member can carry it."""
        carrier = self._sessions.get(key)
        username = carrier.username if carrier else f"{self._user}{SESSION_INFIX}{key}"
        # The fleet's user, or a users-file user's (a name without a dash).
        parsed = parse_gateway_username(username, self._user) or parse_gateway_username(
            username, username.partition("-")[0]
        )
        if parsed is None:
            return None
        # The members its filters admit: the router sends the session to no others.
        return userhash_member(
            username, [m.member for m in self._serving() if m.matches(parsed.filters)]
        )

    async def ban(self, *, member: str | None, session: str | None, reason: str) -> str:
        """Ban `member`, or the member that carried `session`'s latest tunnel at the endpoint
        it carried it from (gateway/sessions.py); a session no tunnel carried yet names the
        member it goes to now."""
        endpoint: str | None = None
        if session is not None:
            # The router wrote the carrier before the client saw its tunnel's 200.
            await asyncio.to_thread(self._catch_up)
            carrier = self._sessions.get(session)
            if carrier is not None:
                member, endpoint = carrier.member, carrier.endpoint
            else:
                member = self.session_member(session)
            if member is None:
                raise ApiError(HTTPStatus.NOT_FOUND, f"session: no member for {session!r} now")
        assert member is not None  # parse_ban gives exactly one of the two
        if endpoint is None:
            endpoint = next((endpoint_of(m) for m in self._serving() if m.member == member), None)
        pool = self._owner(member)
        request: dict[str, Any] = {"member": member, "reason": reason or DEFAULT_REASON}
        if endpoint is not None:
            request["endpoint"] = endpoint
        try:
            await asyncio.wait_for(
                self._client.get_workflow_handle(pool).execute_update(
                    BAN_UPDATE, request, id=f"api-ban-{uuid.uuid4()}"
                ),
                TEMPORAL_SECONDS,
            )
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            message = cause.message if isinstance(cause, ApplicationError) else str(cause)
            if message.startswith(NO_SUCH_MEMBER):
                raise ApiError(
                    HTTPStatus.NOT_FOUND, f"member: no member {member!r} in the pool"
                ) from None
            raise ApiError(HTTPStatus.TOO_MANY_REQUESTS, message) from None
        except (RPCError, TimeoutError) as err:
            log.warning("report_ban through the API failed: %s", err)
            raise ApiError(
                HTTPStatus.SERVICE_UNAVAILABLE, f"pool: cannot reach {pool!r} now"
            ) from None
        log.info("ban of %s forwarded to pool %s (%s)", member, pool, reason[:MAX_LOGGED_REASON])
        return member

    def _owner(self, member: str) -> str:
        """The pool a ban of `member` goes to: the open pool its id (`<pool>/<n>`) names, or
        the one pool of a gateway of one, which judges any id itself; ApiError 404 else."""
        pools = self._pools()
        owner = member.rpartition("/")[0]
        if owner in pools:
            return owner
        if len(pools) == 1:
            return pools[0]
        raise ApiError(
            HTTPStatus.NOT_FOUND, f"member: no member {member!r} in pools {', '.join(pools)}"
        )


def _listed(
    pool: str, status: dict[str, Any], sessions: dict[str, list[str]], now: datetime
) -> list[dict[str, Any]]:
    """`pool`'s members as `/v1/members` lists them, from its status."""
    members = []
    for entry in status.get("members") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("member"), str):
            continue
        placement = entry.get("placement")
        member = entry["member"]
        members.append(
            {
                "member": member,
                "pool": pool,
                "state": str(entry.get("state", "")),
                "zone": zone_of(placement),
                "region": region_of(placement),
                "provider": str(entry.get("provider", "")),
                # Where the member's traffic leaves from, as the pool confirmed it.
                "exit_address": _text_or_none(entry.get("exit_address")),
                "age_seconds": _age(entry.get("ready_since"), now),
                "sessions": sessions.get(member, []),
            }
        )
    return members


def _text_or_none(value: Any) -> str | None:
    """A string field of the pool's answer, or None when absent or not a string."""
    return value if isinstance(value, str) and value else None
