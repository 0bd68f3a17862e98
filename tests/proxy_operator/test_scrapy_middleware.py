"""GatewayMiddleware's settings, routing and ban decisions, in process: no crawl, no reactor.

What a request looks like after the middleware (the gateway's address in
meta['proxy'], the login in Proxy-Authorization, a session per mode), how
bad settings are refused, naming the setting, and what a ban changes. The
ban loop itself (the report through the API, the wait, the retry) runs in a
real crawl: tests/workflows/test_gateway_scrapy.py.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from scrapy import Request
from scrapy.exceptions import IgnoreRequest
from scrapy.http import HtmlResponse
from scrapy.utils.test import get_crawler

from proxy_operator.gateway_url import InvalidProxySetting
from proxy_operator.scrapy import (
    BAN_RETRIES_META,
    FROM_ENVIRONMENT,
    SESSION_META,
    GatewayMiddleware,
    gateway_settings,
)

PASSWORD = "pw-5d0c:/@"
TOKEN = "api-token-91ac"
BASE = {
    "PROXY_OPERATOR_GATEWAY": "127.0.0.1:8888",
    "PROXY_OPERATOR_PASSWORD": PASSWORD,
    "PROXY_OPERATOR_API": "http://127.0.0.1:9999",
    "PROXY_OPERATOR_API_TOKEN": TOKEN,
}


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FROM_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def middleware(**settings: Any) -> GatewayMiddleware:
    return GatewayMiddleware.from_crawler(get_crawler(settings_dict=BASE | settings))


def routed(mw: GatewayMiddleware, url: str, **meta: Any) -> tuple[Request, str]:
    """The request after the middleware, and the username it logs in with."""
    request = Request(url, meta=meta)
    assert mw.process_request(request) is None
    scheme, _, token = request.headers[b"Proxy-Authorization"].partition(b" ")
    assert scheme == b"Basic"
    username, _, password = base64.b64decode(token).decode().partition(":")
    assert password == PASSWORD
    return request, username


def test_the_login_is_a_header_and_meta_proxy_only_the_gateway() -> None:
    request, username = routed(middleware(), "https://shop.example/a")
    assert request.meta["proxy"] == "http://127.0.0.1:8888"
    assert username == f"proxy-session-{request.meta[SESSION_META]}"


def test_per_domain_sessions_are_shared_by_a_host_only() -> None:
    mw = middleware()
    first, _ = routed(mw, "https://shop.example/a")
    second, _ = routed(mw, "https://shop.example/b?page=2")
    other, _ = routed(mw, "https://news.example/")
    assert first.meta[SESSION_META] == second.meta[SESSION_META] != other.meta[SESSION_META]


def test_per_request_sessions_differ_and_none_rotates() -> None:
    mw = middleware(PROXY_OPERATOR_SESSION="per-request")
    keys = {routed(mw, "https://shop.example/a")[0].meta[SESSION_META] for _ in range(5)}
    assert len(keys) == 5
    request, username = routed(middleware(PROXY_OPERATOR_SESSION="none"), "https://shop.example/")
    assert username == "proxy" and SESSION_META not in request.meta


def test_routing_filters_from_settings_go_before_the_session() -> None:
    mw = middleware(PROXY_OPERATOR_ZONE="europe-west1-b", PROXY_OPERATOR_PROVIDER="gcp")
    request, username = routed(mw, "https://shop.example/a")
    assert username == (
        f"proxy-zone-europe-west1-b-provider-gcp-session-{request.meta[SESSION_META]}"
    )


def test_a_session_the_spider_chose_is_kept() -> None:
    _, username = routed(middleware(), "https://shop.example/login", **{SESSION_META: "login-7"})
    assert username == "proxy-session-login-7"


@pytest.mark.parametrize("key", ["a b", "k" * 129, 42, "../x"])
def test_a_bad_session_from_the_spider_drops_the_request_naming_it(key: object) -> None:
    mw = middleware()
    request = Request("https://shop.example/login", meta={SESSION_META: key})
    with pytest.raises(IgnoreRequest, match=r"proxy_operator_session.*session:"):
        mw.process_request(request)
    assert "proxy" not in request.meta and b"Proxy-Authorization" not in request.headers


def test_secrets_come_from_the_environment_when_settings_lack_them() -> None:
    crawler = get_crawler(settings_dict={"PROXY_OPERATOR_GATEWAY": "127.0.0.1:8888"})
    environ = {"PROXY_OPERATOR_PASSWORD": PASSWORD, "PROXY_OPERATOR_API_TOKEN": TOKEN}
    environ["PROXY_OPERATOR_API"] = "http://127.0.0.1:9999"
    parsed = gateway_settings(crawler.settings, environ)
    assert (parsed.password, parsed.api_token) == (PASSWORD, TOKEN)
    assert PASSWORD not in repr(parsed) and TOKEN not in repr(parsed)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"PROXY_OPERATOR_GATEWAY": None}, "PROXY_OPERATOR_GATEWAY"),
        ({"PROXY_OPERATOR_PASSWORD": None}, "PROXY_OPERATOR_PASSWORD"),
        ({"PROXY_OPERATOR_API_TOKEN": None}, "PROXY_OPERATOR_API_TOKEN"),
        ({"PROXY_OPERATOR_SESSION": "per-site"}, "PROXY_OPERATOR_SESSION"),
        ({"PROXY_OPERATOR_BAN_STATUS": "403,abc"}, "PROXY_OPERATOR_BAN_STATUS"),
        ({"PROXY_OPERATOR_BAN_STATUS": [99]}, "PROXY_OPERATOR_BAN_STATUS"),
        ({"PROXY_OPERATOR_BAN_PATTERN": "captcha("}, "PROXY_OPERATOR_BAN_PATTERN"),
        ({"PROXY_OPERATOR_MAX_BAN_RETRIES": "-1"}, "PROXY_OPERATOR_MAX_BAN_RETRIES"),
        ({"PROXY_OPERATOR_MAX_BAN_RETRIES": "lots"}, "PROXY_OPERATOR_MAX_BAN_RETRIES"),
        ({"PROXY_OPERATOR_BAN_RETRY_DELAY": "nan"}, "PROXY_OPERATOR_BAN_RETRY_DELAY"),
        ({"PROXY_OPERATOR_GATEWAY": "gateway"}, "gateway"),
        ({"PROXY_OPERATOR_USER": "a user"}, "user"),
        ({"PROXY_OPERATOR_API": "ftp://x"}, "api"),
        ({"PROXY_OPERATOR_API_CA_FILE": "/nonexistent/ca.pem"}, "PROXY_OPERATOR_API_CA_FILE"),
        ({"PROXY_OPERATOR_REGION": "eu west"}, "region"),
    ],
)
def test_a_bad_setting_is_named(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidProxySetting) as raised:
        GatewayMiddleware.from_crawler(
            get_crawler(settings_dict=BASE | settings),
        )
    assert named in str(raised.value)
    assert PASSWORD not in str(raised.value) and TOKEN not in str(raised.value)


def banned_answer(request: Request, status: int = 200, body: bytes = b"ok") -> HtmlResponse:
    return HtmlResponse(request.url, status=status, body=body, request=request)


def test_a_ban_is_a_listed_status_or_a_body_matching_the_pattern() -> None:
    mw = middleware(PROXY_OPERATOR_BAN_PATTERN=r"(?i)captcha", PROXY_OPERATOR_BAN_STATUS="403,503")
    request, _ = routed(mw, "https://shop.example/a")
    assert mw.ban_reason(request, banned_answer(request, 403)) == (
        "scrapy: HTTP 403 from shop.example"
    )
    assert mw.ban_reason(request, banned_answer(request, 200, b"<p>CAPTCHA</p>")) == (
        "scrapy: ban page from shop.example (HTTP 200)"
    )
    # 429 is not listed here; a 404 is the site's answer, not a ban.
    for status in (200, 404, 429):
        assert mw.ban_reason(request, banned_answer(request, status)) is None


def test_a_ban_retires_the_domains_session_once_and_the_retry_goes_out_on_the_new_one() -> None:
    mw = middleware()
    first, _ = routed(mw, "https://shop.example/a")
    second, _ = routed(mw, "https://shop.example/b")
    banned = first.meta[SESSION_META]
    mw.retire(first, banned)
    mw.retire(second, banned)  # a request still out on it: no second renewal
    retry = mw.retry_of(first, "scrapy: HTTP 403 from shop.example")
    assert retry is not None and retry.dont_filter
    assert retry.meta[BAN_RETRIES_META] == 1 and retry.priority == first.priority - 1
    rerouted, username = routed(mw, retry.url, **retry.meta)
    renewed = rerouted.meta[SESSION_META]
    assert renewed != banned and username == f"proxy-session-{renewed}"
    assert routed(mw, "https://shop.example/c")[0].meta[SESSION_META] == renewed
    # Only one renewal: the second request's session is renewed to the same key.
    assert renewed.rsplit(".", 1)[1] == "1"


def test_a_request_banned_too_often_is_given_up() -> None:
    mw = middleware(PROXY_OPERATOR_MAX_BAN_RETRIES=2)
    request, _ = routed(mw, "https://shop.example/a")
    for _ in range(2):
        retry = mw.retry_of(request, "banned")
        assert retry is not None
        request, _ = routed(mw, retry.url, **retry.meta)
    assert mw.retry_of(request, "banned") is None
    assert mw.stats.get_value("proxy_operator/ban_retries_exhausted") == 1
    assert mw.stats.get_value("proxy_operator/ban_retries") == 2
