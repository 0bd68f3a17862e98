"""The exit check: which address an echo service sees a request through a proxy come from.

The proxies are the small stand-ins of test_probe.py; a pool end to end
through real Squids is in tests/workflows/test_pool_exits.py.
"""

from __future__ import annotations

import pytest

from activities.exit_echo import MAX_BODY, EchoFailed, address_in, observe_exit
from tests.activities.test_probe import (
    PASSWORD,
    USERNAME,
    answering,
    serve,
    silent,
    tunnelling_proxy,
)
from tests.helpers.tls_origin import ECHO_PATH, TlsOrigin, TlsRequestHandler, serve_tls_origin

# What a page a pool names as its echo service might hold, that its status must never show.
SECRET = "not-an-address-but-a-secret-4eC39HqLyjWDarjt"


@pytest.mark.parametrize(
    ("body", "address"),
    [
        (b"203.0.113.7\n", "203.0.113.7"),
        (b'{"ip": "203.0.113.7"}', "203.0.113.7"),
        (b'{"origin": "2001:db8::1"}', "2001:db8::1"),
        (b"  2001:DB8:0:0:0:0:0:1  ", "2001:db8::1"),  # as the address is written everywhere else
    ],
)
def test_an_echo_answer_names_one_address(body: bytes, address: str) -> None:
    assert address_in(body, "text/plain") == address


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html>captcha</html>",
        b"203.0.113.7, 198.51.100.1",  # a chain of proxies: which one is ours is unknowable
        b'{"ip": 203}',
        b'{"ip": "not an address"}',
        b"[1, 2]",
        b"{not json",
        b"\xff\xfe\x00",
        b"999.1.1.1",
    ],
)
def test_an_echo_answer_that_names_no_single_address_is_refused_saying_so(body: bytes) -> None:
    with pytest.raises(EchoFailed, match=rf"not one IP address .*: {len(body)} bytes, text/plain$"):
        address_in(body, "text/plain")


async def test_the_echo_service_sees_the_proxys_address(tls_origin: TlsOrigin) -> None:
    async with serve(tunnelling_proxy) as port:
        seen = await observe_exit(
            "127.0.0.1",
            port,
            USERNAME,
            PASSWORD,
            f"{tls_origin.url.rstrip('/')}{ECHO_PATH}",
            ssl_context=tls_origin.client_ssl_context,
        )
    assert seen == "127.0.0.1"


async def test_a_proxy_that_refuses_is_a_failed_check_never_leaking_the_password(
    tls_origin: TlsOrigin,
) -> None:
    async with serve(answering(407)) as port:
        with pytest.raises(EchoFailed, match=r"answered CONNECT .* with 407") as failed:
            await observe_exit("127.0.0.1", port, USERNAME, PASSWORD, tls_origin.url)
    assert PASSWORD not in str(failed.value)


async def test_a_silent_proxy_is_a_failed_check_within_the_timeout(tls_origin: TlsOrigin) -> None:
    async with serve(silent) as port:
        with pytest.raises(EchoFailed, match=r"took over 0\.5 s"):
            await observe_exit("127.0.0.1", port, USERNAME, PASSWORD, tls_origin.url, timeout=0.5)


async def test_an_echo_url_that_is_not_https_is_refused_before_connecting() -> None:
    with pytest.raises(EchoFailed, match=r"not an https:// URL"):
        await observe_exit("127.0.0.1", 1, USERNAME, PASSWORD, "http://checkip.example/")


def answering_with(answer: bytes) -> type[TlsRequestHandler]:
    """An https service that answers every request with `answer`, raw, then closes."""

    class Handler(TlsRequestHandler):
        def do_GET(self) -> None:
            self.wfile.write(answer)
            self.close_connection = True

    return Handler


def http_answer(headers: str, body: bytes) -> bytes:
    return f"HTTP/1.1 200 OK\r\n{headers}Connection: close\r\n\r\n".encode() + body


@pytest.mark.parametrize(
    ("answer", "described"),
    [
        (
            http_answer("Content-Type: text/html; charset=utf-8\r\n", f"<p>{SECRET}</p>".encode()),
            f"not one IP address (plain text, or JSON with `ip` or `origin`): "
            f"{len(SECRET) + 7} bytes, text/html",
        ),
        (
            http_answer("Content-Type: application/json\r\n", f'{{"ip": "{SECRET}"}}'.encode()),
            f"{len(SECRET) + 10} bytes, application/json",
        ),
        (http_answer("", SECRET.encode() * 200), f"{MAX_BODY} bytes or more, no content type"),
        (
            http_answer(f"Content-Type: {SECRET}\r\n", SECRET.encode()),
            f"{len(SECRET)} bytes, an unreadable content type",
        ),
        (
            f"{SECRET}\r\n\r\n".encode(),
            f"no HTTP status line (a first line of {len(SECRET)} bytes)",
        ),
    ],
)
async def test_an_answer_that_is_no_address_is_described_never_quoted(
    answer: bytes, described: str
) -> None:
    with serve_tls_origin(handler=answering_with(answer)) as origin:
        async with serve(tunnelling_proxy) as port:
            with pytest.raises(EchoFailed) as failed:
                await observe_exit(
                    "127.0.0.1",
                    port,
                    USERNAME,
                    PASSWORD,
                    origin.url,
                    ssl_context=origin.client_ssl_context,
                )
    assert SECRET not in str(failed.value) and SECRET[:8] not in str(failed.value)
    assert described in str(failed.value)
