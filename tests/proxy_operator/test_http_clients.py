"""requests and httpx send their tunnels to the gateway, whatever proxy the environment names.

The "gateway" here is a loopback peer that records each CONNECT and answers
200 with nothing behind it (tests/helpers/loopback_peer.py): the TLS
handshake that follows fails, which is the client's error to raise; what
matters is where the CONNECT went. Through a real gateway, docs/scrapers.md's
examples run in tests/workflows/test_gateway_scrapy.py.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import requests

from proxy_operator.gateway_url import GatewayProxy, gateway_proxy
from proxy_operator.http_clients import httpx_client, proxies_for, requests_session
from tests.helpers.loopback_peer import loopback_peer
from tests.helpers.network import free_port

TARGET = "https://origin.invalid:8443/"


def via_requests_session(proxy: GatewayProxy) -> None:
    with requests_session(proxy) as session:
        session.get(TARGET, timeout=10)


def via_proxies_for(proxy: GatewayProxy) -> None:
    requests.get(TARGET, proxies=proxies_for(proxy), timeout=10)


def via_httpx(proxy: GatewayProxy) -> None:
    with httpx_client(proxy, timeout=10) as client:
        client.get(TARGET)


@pytest.mark.parametrize("send", [via_requests_session, via_proxies_for, via_httpx])
def test_the_connect_goes_to_the_gateway_not_to_the_environments_proxy(
    monkeypatch: pytest.MonkeyPatch, send: Callable[[GatewayProxy], None]
) -> None:
    elsewhere = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, elsewhere)
    with loopback_peer() as gateway:
        proxy = gateway_proxy(f"127.0.0.1:{gateway.port}", "proxy", "pw", session="s1")
        with pytest.raises((requests.exceptions.SSLError, httpx.ConnectError, httpx.ProxyError)):
            send(proxy)
        # urllib3 says HTTP/1.0, httpx HTTP/1.1.
        assert [r.rsplit(" ", 1)[0] for r in gateway.requests] == ["CONNECT origin.invalid:8443"]
