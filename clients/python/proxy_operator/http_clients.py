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

    A Session's own `proxies` lose to HTTP(S)_PROXY in the environment (see
    `proxies_for`), so this one puts the gateway back over whatever the
    environment or a call gave; the rest of the environment (REQUESTS_CA_BUNDLE,
    .netrc) still applies.
    """
    import requests

    class GatewaySession(requests.Session):
        def merge_environment_settings(
            self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any
        ) -> Any:
            settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
            settings["proxies"] = dict(self.proxies)
            return settings

    client = GatewaySession()
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
