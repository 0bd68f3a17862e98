"""requests and httpx through the gateway, routed as a GatewayProxy (gateway_url) says.

Neither library is a dependency of this package: each function imports its
library when called, so a scraper installs only the one it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy_operator.gateway_url import GatewayProxy

if TYPE_CHECKING:
    import httpx
    import requests


def proxies_for(proxy: GatewayProxy) -> dict[str, str]:
    """`proxies=` for requests (and urllib's ProxyHandler): every scheme through the gateway.

    Given per call (`requests.get(url, proxies=...)`) it wins over
    HTTP(S)_PROXY in the environment, which a Session's own `proxies`
    attribute does not (requests' Session.merge_environment_settings puts the
    environment's proxies under the call's, above the session's).
    """
    url = proxy.url()
    return {"http": url, "https": url}


def requests_session(proxy: GatewayProxy) -> requests.Session:
    """A requests Session whose every request goes through the gateway.

    `trust_env` is off so a proxy in the environment cannot send requests
    around the gateway (see `proxies_for`); that also ignores
    REQUESTS_CA_BUNDLE and .netrc, so give `verify=` yourself when the origin
    needs a CA of yours.
    """
    import requests

    client = requests.Session()
    client.trust_env = False
    client.proxies = proxies_for(proxy)
    return client


def httpx_client(proxy: GatewayProxy, **options: Any) -> httpx.Client:
    """An httpx Client through the gateway; `options` go to httpx.Client (`verify=`, `timeout=`)."""
    import httpx

    return httpx.Client(proxy=proxy.url(), **options)


def httpx_async_client(proxy: GatewayProxy, **options: Any) -> httpx.AsyncClient:
    """`httpx_client`'s asyncio twin: an httpx AsyncClient through the gateway."""
    import httpx

    return httpx.AsyncClient(proxy=proxy.url(), **options)
