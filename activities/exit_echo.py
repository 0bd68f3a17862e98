"""What address a request through a proxy actually leaves from, as an echo service sees it.

A provider knows the public address of a VM, or the node of a Pod, but not
a NAT in between: the address a crawled site sees is what counts for a
crawler. A pool given `exit_echo_url` (an https service that answers with
the caller's address, e.g. https://checkip.amazonaws.com/ or
https://api.ipify.org/) asks it through each member when it confirms the
member's endpoint, with the fleet's credentials, the same tunnel a probe uses.

The answer is untrusted text from the network: it counts only when it is one
IP address (plain text, or JSON with `ip` or `origin`), and at most
`MAX_BODY` bytes of it are read. Any https URL can be named, so an answer
that is not an address is described (how many bytes, what media type),
never quoted: the pool's status would otherwise let anyone who can start a
pool read any page through the fleet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import ssl

from activities.probe import (
    MAX_HEAD_BYTES,
    ProbeFailed,
    parse_https_target,
    read_response_head,
    read_status,
    send_connect,
)

# An address is a few dozen bytes; an echo service's answer is read no further.
MAX_BODY = 4096
EXPECTED = "one IP address (plain text, or JSON with `ip` or `origin`)"
# What a refused answer's Content-Type may be shown as: a media type's two tokens (RFC 9110).
MEDIA_TYPE = re.compile(rb"[a-z0-9!#$&^_.+-]{1,40}/[a-z0-9!#$&^_.+-]{1,40}")


class EchoFailed(Exception):
    """The echo request failed, or its answer names no single address; the message says which."""


async def observe_exit(
    proxy_host: str,
    proxy_port: int,
    username: str,
    password: str,
    echo_url: str,
    *,
    timeout: float = 10.0,  # noqa: ASYNC109  (one number per call, as probe_connect takes)
    ssl_context: ssl.SSLContext | None = None,
) -> str:
    """The address `echo_url` says the request came from, through the proxy."""
    writer: asyncio.StreamWriter | None = None
    try:
        host, port, path = parse_https_target(echo_url)
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                proxy_host, proxy_port, limit=MAX_HEAD_BYTES
            )
            authority = send_connect(writer, host, port, username, password)
            status = await read_status(reader, "proxy")
            if status != 200:
                raise EchoFailed(f"the proxy answered CONNECT {authority} with {status}")
            context = ssl_context or ssl.create_default_context()
            await writer.start_tls(context, server_hostname=host)
            # HTTP/1.0: the answer comes whole, not chunked, and ends with the connection.
            writer.write(
                f"GET {path} HTTP/1.0\r\nHost: {authority}\r\n"
                "User-Agent: proxy-operator-exit-check\r\nAccept: text/plain, application/json\r\n"
                "\r\n".encode()
            )
            status, head = await read_response_head(reader, "the echo service")
            if status != 200:
                raise EchoFailed(f"{echo_url} answered {status}")
            # To the end of the connection, or MAX_BODY: one read returns what one record held.
            body = b""
            while len(body) < MAX_BODY and (chunk := await reader.read(MAX_BODY - len(body))):
                body += chunk
    except ProbeFailed as failed:
        raise EchoFailed(failed.error) from None
    except TimeoutError:
        raise EchoFailed(f"{echo_url} through the proxy took over {timeout:g} s") from None
    except (OSError, ssl.SSLError) as exc:
        raise EchoFailed(f"{echo_url} through the proxy: {exc}") from None
    finally:
        if writer is not None:
            writer.transport.abort()
    return address_in(body, media_type(head))


def media_type(head: bytes) -> str:
    """The answer's Content-Type as a message may show it: `type/subtype`, or that it has none."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-type":
            found = MEDIA_TYPE.fullmatch(value.partition(b";")[0].strip().lower())
            return found.group().decode() if found else "an unreadable content type"
    return "no content type"


def address_in(body: bytes, content_type: str) -> str:
    """The one IP address an echo service's answer names; EchoFailed describing it if none."""
    text = body.decode("utf-8", "replace").strip()
    candidate = text
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        found = (
            next((parsed[k] for k in ("ip", "origin") if k in parsed), None)
            if isinstance(parsed, dict)
            else None
        )
        candidate = found if isinstance(found, str) else ""
    try:
        return str(ipaddress.ip_address(candidate.strip()))
    except ValueError:
        size = f"{len(body)} bytes" if len(body) < MAX_BODY else f"{MAX_BODY} bytes or more"
        raise EchoFailed(
            f"the echo service's answer is not {EXPECTED}: {size}, {content_type}"
        ) from None
