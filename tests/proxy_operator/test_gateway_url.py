"""Gateway proxy URLs: each routing form as the gateway reads it, bad fields named before use."""

from __future__ import annotations

import urllib.request

import pytest

from proxy_operator.gateway_url import (
    InvalidProxySetting,
    gateway_proxy,
    gateway_username,
    proxy_url,
)
from proxy_operator.username import gateway_account, parse_gateway_username

PASSWORD = "p@ss:w/rd%#"


def _userinfo(url: str) -> tuple[str, str]:
    """The login a client library reads back out of a proxy URL (urllib's own parser)."""
    _, user, password, _ = urllib.request._parse_proxy(url)  # type: ignore[attr-defined]
    return urllib.request.unquote(user), urllib.request.unquote(password)


@pytest.mark.parametrize(
    ("routing", "username"),
    [
        ({}, "proxy"),
        ({"session": "cart-42.a_b~c+d=e"}, "proxy-session-cart-42.a_b~c+d=e"),
        ({"member": "web/3"}, "proxy-proxy-web/3"),
        ({"zone": "europe-west1-b"}, "proxy-zone-europe-west1-b"),
        (
            {"provider": "gcp", "region": "us-east1", "zone": "us-east1-c", "session": "s-1"},
            "proxy-zone-us-east1-c-region-us-east1-provider-gcp-session-s-1",
        ),
        ({"region": "eu", "member": "web/0"}, "proxy-region-eu-proxy-web/0"),
        ({"provider": "local", "session": None, "zone": None}, "proxy-provider-local"),
    ],
)
def test_each_form_is_a_username_the_gateway_accepts(
    routing: dict[str, str], username: str
) -> None:
    assert gateway_username("proxy", **routing) == username
    assert gateway_account(username, "proxy") == "proxy"
    # The gateway reads back exactly what was asked for.
    parsed = parse_gateway_username(username, "proxy")
    assert parsed is not None
    given = {k: v for k, v in routing.items() if v is not None}
    assert parsed.filters == {k: v for k, v in given.items() if k not in ("session", "member")}
    assert (parsed.session, parsed.pin) == (given.get("session"), given.get("member"))
    url = proxy_url("127.0.0.1:8888", "proxy", PASSWORD, **routing)
    assert url.endswith("@127.0.0.1:8888")
    # The password's and the member's reserved characters survive the round trip.
    assert _userinfo(url) == (username, PASSWORD)


def test_the_server_has_no_credentials_and_the_repr_no_password() -> None:
    proxy = gateway_proxy("http://gw.example:8888", "proxy", PASSWORD, session="s1")
    assert proxy.server == "http://gw.example:8888"
    assert PASSWORD not in repr(proxy)


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"user": "pro xy"}, "user"),
        ({"user": ""}, "user"),
        ({"user": "a" * 65}, "user"),
        ({"session": ""}, "session"),
        ({"session": "a b"}, "session"),
        ({"session": "k" * 129}, "session"),
        ({"session": "a/b"}, "session"),
        ({"member": "web 3"}, "member"),
        ({"member": ""}, "member"),
        ({"session": "s", "member": "web/1"}, "session and member"),
        ({"gateway": "ftp://gw:8888"}, "gateway"),
        ({"gateway": "gw"}, "gateway"),
        ({"gateway": "gw:port"}, "gateway"),
        ({"gateway": "http://u:p@gw:8888"}, "gateway"),
        ({"gateway": f"ftp://u:{PASSWORD}@gw"}, "gateway"),
        ({"gateway": "http://gw:8888/path"}, "gateway"),
        ({"gateway": "gw:8888?x=1"}, "gateway"),
        ({"password": ""}, "password"),
        ({"zone": ""}, "zone"),
        ({"zone": "eu west"}, "zone"),
        ({"region": "eu-session-x"}, "region"),
        ({"provider": "a" * 65}, "provider"),
        ({"provider": "gcp-"}, "provider"),
        ({"country": "fr"}, "country"),
    ],
)
def test_a_bad_field_is_named(arguments: dict[str, str], field: str) -> None:
    given = {"gateway": "127.0.0.1:8888", "user": "proxy", "password": PASSWORD} | arguments
    with pytest.raises(InvalidProxySetting) as raised:
        proxy_url(given.pop("gateway"), given.pop("user"), given.pop("password"), **given)
    assert str(raised.value).startswith(f"{field}:")
    assert PASSWORD not in str(raised.value)
