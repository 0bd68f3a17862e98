"""A Scrapy downloader middleware that crawls through a gateway and closes the ban loop.

Enable it between Scrapy's RetryMiddleware (550) and HttpProxyMiddleware (750):

    DOWNLOADER_MIDDLEWARES = {"proxy_operator.scrapy.GatewayMiddleware": 610}

Each request goes through the gateway with a session username (one session
per domain, one per request, or none), so every request of a session leaves
from one member. A response that looks banned (a status in
PROXY_OPERATOR_BAN_STATUS, or a body matching PROXY_OPERATOR_BAN_PATTERN) is
reported through the gateway's control API by its session key (the gateway
knows which member carries it; the pool replaces that member), and the
request is retried on a fresh session, which the gateway pins to a member
still in rotation, up to PROXY_OPERATOR_MAX_BAN_RETRIES times. At 610 the
middleware sees a banned 429 before RetryMiddleware would retry it on the
same session. Settings and their defaults: docs/scrapers.md.

Credentials stay out of Scrapy's logs and stats: `request.meta["proxy"]`
holds the gateway's address only, the login goes into the
Proxy-Authorization header (which Scrapy sends on the CONNECT and never
logs), and nothing here logs a password, a token or a username.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import secrets
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy.exceptions import IgnoreRequest
from scrapy.http import Request, Response
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet import task, threads

from proxy_operator.client import MAX_REASON, GatewayApiError, GatewayClient
from proxy_operator.gateway_url import (
    GatewayProxy,
    InvalidProxySetting,
    gateway_proxy,
)
from proxy_operator.username import FILTERS

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings
    from scrapy.statscollectors import StatsCollector

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Where a request carries what this middleware decided: readable by spiders.
SESSION_META = "proxy_operator_session"  # the session key the request went out on
BAN_RETRIES_META = "proxy_operator_ban_retries"  # bans this request has met so far
STATS_PREFIX = "proxy_operator"
DEFAULT_USER = "proxy"
DEFAULT_BAN_STATUS = (403, 429)
DEFAULT_MAX_BAN_RETRIES = 5
# The gateway follows its pool's endpoints every couple of seconds: a retry
# sent at once may still be hashed to the member just banned.
DEFAULT_BAN_RETRY_DELAY = 3.0
# Settings that may come from the environment instead, so no secret needs to
# be written into a settings file or typed on a command line.
FROM_ENVIRONMENT = (
    "PROXY_OPERATOR_GATEWAY",
    "PROXY_OPERATOR_USER",
    "PROXY_OPERATOR_PASSWORD",
    "PROXY_OPERATOR_API",
    "PROXY_OPERATOR_API_TOKEN",
    "PROXY_OPERATOR_API_CA_FILE",
)


class SessionMode(StrEnum):
    """Which requests share a session key, and so a member."""

    PER_DOMAIN = "per-domain"  # every request to one host: one exit per site until it is banned
    PER_REQUEST = "per-request"  # a fresh key per request: spread over the members
    NONE = "none"  # the gateway rotates; a ban cannot be traced to a member, so is not reported


@dataclass(frozen=True)
class GatewaySettings:
    """The middleware's settings, checked: each problem names its setting."""

    gateway: str
    user: str
    password: str
    session: SessionMode
    ban_status: frozenset[int]
    ban_pattern: re.Pattern[bytes] | None
    max_ban_retries: int
    ban_retry_delay: float
    api: str | None
    api_token: str | None
    api_ca_file: str | None
    # Routing filters every request's username carries: {"zone": ..., ...}.
    filters: dict[str, str]

    def __repr__(self) -> str:
        return f"GatewaySettings(gateway={self.gateway!r}, session={self.session.value!r}, ...)"


def gateway_settings(
    settings: BaseSettings, environ: Mapping[str, str] | None = None
) -> GatewaySettings:
    """The PROXY_OPERATOR_* settings, those in FROM_ENVIRONMENT also from `environ`."""
    env = os.environ if environ is None else environ

    def text(name: str) -> str | None:
        value = settings.get(name)
        if value is None and name in FROM_ENVIRONMENT:
            value = env.get(name)
        return None if value is None or value == "" else str(value)

    gateway = text("PROXY_OPERATOR_GATEWAY")
    password = text("PROXY_OPERATOR_PASSWORD")
    if gateway is None:
        raise InvalidProxySetting("PROXY_OPERATOR_GATEWAY: not set (the gateway's host:port)")
    if password is None:
        raise InvalidProxySetting("PROXY_OPERATOR_PASSWORD: not set (the proxies' password)")
    api, token = text("PROXY_OPERATOR_API"), text("PROXY_OPERATOR_API_TOKEN")
    if api is not None and token is None:
        raise InvalidProxySetting("PROXY_OPERATOR_API_TOKEN: not set, and PROXY_OPERATOR_API is")
    return GatewaySettings(
        gateway=gateway,
        user=text("PROXY_OPERATOR_USER") or DEFAULT_USER,
        password=password,
        session=_parsed(
            "PROXY_OPERATOR_SESSION",
            SessionMode,
            settings.get("PROXY_OPERATOR_SESSION", SessionMode.PER_DOMAIN.value),
        ),
        ban_status=frozenset(
            _status(code)
            for code in settings.getlist("PROXY_OPERATOR_BAN_STATUS", list(DEFAULT_BAN_STATUS))
        ),
        ban_pattern=_pattern(settings.get("PROXY_OPERATOR_BAN_PATTERN")),
        max_ban_retries=_bounded(
            "PROXY_OPERATOR_MAX_BAN_RETRIES",
            int,
            settings.get("PROXY_OPERATOR_MAX_BAN_RETRIES", DEFAULT_MAX_BAN_RETRIES),
            0,
            100,
        ),
        ban_retry_delay=_bounded(
            "PROXY_OPERATOR_BAN_RETRY_DELAY",
            float,
            settings.get("PROXY_OPERATOR_BAN_RETRY_DELAY", DEFAULT_BAN_RETRY_DELAY),
            0,
            600,
        ),
        api=api,
        api_token=token,
        api_ca_file=text("PROXY_OPERATOR_API_CA_FILE"),
        filters={
            name: value
            for name in FILTERS
            if (value := text(f"PROXY_OPERATOR_{name.upper()}")) is not None
        },
    )


def _parsed(name: str, kind: Callable[[Any], T], value: Any) -> T:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidProxySetting(f"{name}: {value!r} is not a valid value") from None


def _bounded(name: str, kind: Callable[[Any], float], value: Any, low: float, high: float) -> Any:
    number = _parsed(name, kind, value)
    if not low <= number <= high:
        raise InvalidProxySetting(f"{name}: {value!r} is not between {low} and {high}")
    return number


def _status(code: Any) -> int:
    return int(_bounded("PROXY_OPERATOR_BAN_STATUS", int, code, 100, 599))


def _pattern(value: Any) -> re.Pattern[bytes] | None:
    if value is None or value == "":
        return None
    try:
        return re.compile(value.encode() if isinstance(value, str) else bytes(value))
    except (re.error, TypeError) as error:
        raise InvalidProxySetting(f"PROXY_OPERATOR_BAN_PATTERN: {value!r}: {error}") from None


class GatewayMiddleware:
    """Sends requests through the gateway on sessions; reports bans and retries on a fresh one."""

    def __init__(
        self, settings: GatewaySettings, stats: StatsCollector, priority_adjust: int
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.priority_adjust = priority_adjust
        # Checked once here, so a bad user or gateway fails the crawl's start, not each request.
        try:
            gateway_proxy(settings.gateway, settings.user, settings.password, **settings.filters)
            self.api = _api_client(settings)
        except InvalidProxySetting as error:
            raise InvalidProxySetting(f"PROXY_OPERATOR_* settings: {error}") from None
        # Unique per crawl: two crawls through one gateway never share a session.
        self.crawl = secrets.token_hex(4)
        self.requests = 0
        self.domain_generation: dict[str, int] = {}
        self.reported: set[str] = set()
        if self.api is None:
            logger.warning("PROXY_OPERATOR_API is not set: bans are retried, not reported")
        elif settings.session is SessionMode.NONE:
            logger.warning("PROXY_OPERATOR_SESSION is none: bans are retried, not reported")

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> GatewayMiddleware:
        assert crawler.stats is not None
        return cls(
            gateway_settings(crawler.settings),
            crawler.stats,
            crawler.settings.getint("RETRY_PRIORITY_ADJUST"),
        )

    def process_request(self, request: Request, spider: Spider | None = None) -> None:
        """Route `request` through the gateway on its session (chosen now unless it has one)."""
        key = request.meta.get(SESSION_META) or self._session_for(request)
        try:
            proxy = gateway_proxy(
                self.settings.gateway,
                self.settings.user,
                self.settings.password,
                session=key,
                **self.settings.filters,
            )
        except InvalidProxySetting as error:
            # Only a spider's own meta can be wrong here: settings were checked at start.
            self.stats.inc_value(f"{STATS_PREFIX}/bad_sessions")
            logger.error("Dropped %s: meta[%r]: %s", request, SESSION_META, error)
            raise IgnoreRequest(f"meta[{SESSION_META!r}]: {error}") from None
        if key is not None:
            request.meta[SESSION_META] = key
        _route(request, proxy)
        return None

    async def process_response(
        self, request: Request, response: Response, spider: Spider | None = None
    ) -> Request | Response:
        """`response` unless it looks banned; then report the session and retry on a fresh one."""
        reason = self.ban_reason(request, response)
        if reason is None:
            return response
        self.stats.inc_value(f"{STATS_PREFIX}/bans")
        session = request.meta.get(SESSION_META)
        if session is not None:
            self.retire(request, session)
            await self._report(session, reason)
        retry = self.retry_of(request, reason)
        if retry is None:
            return response
        if self.settings.ban_retry_delay:
            from twisted.internet import reactor

            await maybe_deferred_to_future(
                task.deferLater(reactor, self.settings.ban_retry_delay, lambda: None)
            )
        return retry

    def ban_reason(self, request: Request, response: Response) -> str | None:
        """Why `response` looks banned (for the report), or None if it does not."""
        host = urlparse_cached(request).hostname or "?"
        if response.status in self.settings.ban_status:
            return f"scrapy: HTTP {response.status} from {host}"[:MAX_REASON]
        pattern = self.settings.ban_pattern
        if pattern is not None and pattern.search(response.body):
            return f"scrapy: ban page from {host} (HTTP {response.status})"[:MAX_REASON]
        return None

    def retire(self, request: Request, session: str) -> None:
        """The domain's next requests get a fresh session, unless a ban retired this one already."""
        if self.settings.session is not SessionMode.PER_DOMAIN:
            return
        domain = urlparse_cached(request).hostname or ""
        if session == self._domain_session(domain):
            self.domain_generation[domain] = self.domain_generation.get(domain, 0) + 1

    def retry_of(self, request: Request, reason: str) -> Request | None:
        """`request` again, to go out on a fresh session; None once it met too many bans."""
        retries = int(request.meta.get(BAN_RETRIES_META, 0))
        if retries >= self.settings.max_ban_retries:
            self.stats.inc_value(f"{STATS_PREFIX}/ban_retries_exhausted")
            logger.warning("Gave up on %s: banned %d times (%s)", request, retries + 1, reason)
            return None
        retry = request.replace(dont_filter=True, priority=request.priority + self.priority_adjust)
        retry.meta[BAN_RETRIES_META] = retries + 1
        retry.meta.pop(SESSION_META, None)
        self.stats.inc_value(f"{STATS_PREFIX}/ban_retries")
        logger.info("Retrying %s on a fresh session (banned: %s)", request, reason)
        return retry

    def _session_for(self, request: Request) -> str | None:
        mode = self.settings.session
        if mode is SessionMode.NONE:
            return None
        if mode is SessionMode.PER_REQUEST:
            self.requests += 1
            return f"{self.crawl}.r{self.requests}"
        return self._domain_session(urlparse_cached(request).hostname or "")

    def _domain_session(self, domain: str) -> str:
        """The session `domain`'s requests go out on now: a new one after each ban."""
        return f"{self.crawl}.{_digest(domain)}.{self.domain_generation.get(domain, 0)}"

    async def _report(self, session: str, reason: str) -> None:
        """Report the ban on `session` once; requests still out on it are only retried."""
        if self.api is None or session in self.reported:
            self.stats.inc_value(f"{STATS_PREFIX}/bans_not_reported")
            return
        self.reported.add(session)
        api = self.api
        try:
            member = await maybe_deferred_to_future(
                threads.deferToThread(lambda: api.report_ban(session=session, reason=reason))
            )
        except (GatewayApiError, InvalidProxySetting) as error:
            self.stats.inc_value(f"{STATS_PREFIX}/ban_reports_failed")
            logger.warning("Could not report the ban on session %s: %s", session, error)
            return
        self.stats.inc_value(f"{STATS_PREFIX}/ban_reports")
        logger.info("Reported member %s banned (session %s): %s", member, session, reason)


def _route(request: Request, proxy: GatewayProxy) -> None:
    """The gateway's address in meta['proxy'], the login in Proxy-Authorization.

    Scrapy's HttpProxyMiddleware would move credentials out of meta['proxy']
    too, but only later in the chain; written apart from the start, the
    password is in no meta another middleware could log.
    """
    login = f"{proxy.username}:{proxy.password}".encode()
    request.meta["proxy"] = proxy.server
    request.headers[b"Proxy-Authorization"] = b"Basic " + base64.b64encode(login)


def _digest(domain: str) -> str:
    """A short fixed-alphabet stand-in for a host name, for a session key."""
    return hashlib.sha256(domain.encode()).hexdigest()[:12]


def _api_client(settings: GatewaySettings) -> GatewayClient | None:
    if settings.api is None or settings.api_token is None:
        return None
    context = None
    if settings.api_ca_file is not None:
        try:
            context = ssl.create_default_context(cafile=settings.api_ca_file)
        except OSError as error:
            raise InvalidProxySetting(f"PROXY_OPERATOR_API_CA_FILE: {error}") from None
    return GatewayClient(settings.api, settings.api_token, ssl_context=context)
