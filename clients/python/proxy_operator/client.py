"""The gateway's control API from a scraper: which member serves a session, and reporting a ban.

Standard library only (urllib), so a scraper needs nothing beyond this
package to report bans. Every call sends the bearer token and nothing else
secret, only to the address it was given: a redirect is refused, not
followed (the API never redirects; see `_NoRedirects`). The token never
appears in an error, a repr or a log line of ours.
The endpoints are the gateway's (docs/operations.md, "The control API"):

- `GET /v1/members`: the pool's members, their placement and pinned sessions;
- `GET /v1/sessions/<key>`: the member a session key goes to now (404: none serves);
- `POST /v1/bans`: a member or a session's member is banned, and replaced by
  the pool (202; 429 when the pool's ban limit or the gateway's request
  limit refuses it).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from proxy_operator.gateway_url import InvalidProxySetting, checked_member, checked_session

DEFAULT_TIMEOUT = 10.0
# The API refuses longer reasons; refusing them here names the field before a round trip.
MAX_REASON = 200
# An error body is shown to the user; a misrouted request could answer with a whole page.
MAX_ERROR_CHARS = 300


class GatewayApiError(Exception):
    """The API answered an error (`status`, its `error` message) or could not be reached (0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"gateway API: {status or 'unreachable'}: {message}")
        self.status = status
        self.message = message


class BanRefused(GatewayApiError):
    """429: the ban was not applied (the pool's ban rate limit, or the token's request limit)."""


@dataclass(frozen=True)
class Member:
    """One pool member as `/v1/members` describes it; never its credentials."""

    member: str
    state: str
    zone: str | None = None
    region: str | None = None
    provider: str | None = None
    exit_address: str | None = None
    age_seconds: float | None = None
    sessions: tuple[str, ...] = field(default=())


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect: the answer reaches `_call` as the HTTPError it is.

    Why not follow one, dropping the token when it leaves the origin: the
    API answers no path with a redirect, so one comes from something else at
    that address (a load balancer moving http to https, a wrong base URL), and
    following it would send the token on to wherever the redirect points, or
    turn a ban's POST into a GET (urllib does, for 301 to 303). Saying where it
    points lets the user fix the address instead.
    """

    def redirect_request(self, *_: Any) -> None:
        return None


class GatewayClient:
    """The control API at `base_url` (`http[s]://host:port`), authenticated by `token`."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.username is not None or parts.password is not None:
            raise InvalidProxySetting("api: give the token apart, not in the address")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidProxySetting(f"api: {base_url!r} is not http(s)://host:port")
        if not token or any(c.isspace() for c in token):
            raise InvalidProxySetting("api token: empty or with whitespace")
        self.base_url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self._token = token
        self._timeout = timeout
        self._opener = urllib.request.build_opener(
            _NoRedirects, urllib.request.HTTPSHandler(context=ssl_context)
        )

    def __repr__(self) -> str:
        return f"GatewayClient({self.base_url!r})"

    def healthy(self) -> bool:
        """Whether `/healthz` answers 200 (the gateway is up and following its pool)."""
        try:
            self._call("GET", "/healthz")
        except GatewayApiError:
            return False
        return True

    def members(self) -> list[Member]:
        """The pool's members as the gateway sees them now."""
        body = self._call("GET", "/v1/members")
        return [_member(entry) for entry in body.get("members", [])]

    def session_member(self, key: str) -> str | None:
        """The member session `key` is pinned to, or None if no member holds it."""
        try:
            body = self._call("GET", f"/v1/sessions/{quote(checked_session(key), safe='')}")
        except GatewayApiError as error:
            if error.status == 404:
                return None
            raise
        return str(body["member"])

    def report_ban(
        self, *, member: str | None = None, session: str | None = None, reason: str
    ) -> str:
        """Report `member`, or the member `session` goes to, as banned; the member banned.

        The pool replaces it; a session's next request lands on another
        member. Raises BanRefused when the pool or the gateway limits bans.
        """
        if (member is None) == (session is None):
            raise InvalidProxySetting("member or session: give exactly one")
        if len(reason) > MAX_REASON or not reason.isprintable():
            raise InvalidProxySetting(
                f"reason: {len(reason)} characters, at most {MAX_REASON} printable ones"
            )
        target = (
            {"member": checked_member(member)}
            if member is not None
            else {"session": checked_session(str(session))}
        )
        body = self._call("POST", "/v1/bans", {**target, "reason": reason})
        return str(body["member"])

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with self._opener.open(request, timeout=self._timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            with error:
                message = (
                    _redirect_message(error.headers.get("Location", ""))
                    if 300 <= error.code < 400
                    else _error_message(error.read())
                )
            kind = BanRefused if error.code == 429 and path == "/v1/bans" else GatewayApiError
            raise kind(error.code, message) from None
        except (OSError, ValueError) as error:
            # urllib's URLError text names the address, never the request's headers.
            raise GatewayApiError(0, f"{self.base_url}: {error}") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise GatewayApiError(0, f"{self.base_url}{path}: the answer is not JSON") from None


def _redirect_message(location: str) -> str:
    """Where a refused redirect points: its origin only (a path or query could carry anything)."""
    parts = urlsplit(location)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    host = parts.hostname or ""
    where = f"{parts.scheme}://{f'[{host}]' if ':' in host else host}{port}" if host else ""
    to = f" to {where[:MAX_REASON]}" if where else ""
    return f"the API redirects{to}, which is not followed: give the API's own address"


def _error_message(body: bytes) -> str:
    """The API's `{"error": ...}` text, or the start of whatever else came back."""
    text = body.decode(errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:MAX_ERROR_CHARS]
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return (error if isinstance(error, str) else text)[:MAX_ERROR_CHARS]


def _member(entry: dict[str, Any]) -> Member:
    return Member(
        member=str(entry["member"]),
        state=str(entry.get("state", "")),
        zone=entry.get("zone"),
        region=entry.get("region"),
        provider=entry.get("provider"),
        exit_address=entry.get("exit_address"),
        age_seconds=entry.get("age_seconds"),
        sessions=tuple(entry.get("sessions") or ()),
    )
