"""The control API's flags (gateway/api.py): off unless `--api-listen` is given.

Each flag falls back to an environment variable, as the gateway's others do,
so a Deployment sets them from its env and mounts the tokens from a Secret.
Every problem is named (flag and environment variable) before anything starts,
and a plain-HTTP listener beyond loopback is warned about: its bearer tokens
would cross the network in clear text.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import cli
from gateway.api import DEFAULT_PER_CLIENT, MAX_PER_CLIENT
from gateway.api_tokens import TokenFileError, TokenStore
from providers.base import split_endpoint

log = logging.getLogger("proxy_operator.gateway")

DEFAULT_RATE = 5.0
DEFAULT_BURST = 20
MAX_RATE = 10_000.0


@dataclass(frozen=True)
class ApiSettings:
    listen: tuple[str, int]
    tokens: TokenStore
    tls: ssl.SSLContext | None
    rate: float
    burst: int
    per_client: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.env_argument(
        parser,
        "--api-listen",
        "PROXY_OPERATOR_GATEWAY_API_LISTEN",
        "host:port of the control API (members, session lookups, bans); unset, no API",
    )
    cli.env_argument(
        parser,
        "--api-tokens-file",
        "PROXY_OPERATOR_GATEWAY_API_TOKENS_FILE",
        "the API's bearer tokens, one a line (required with --api-listen)",
    )
    cli.env_argument(
        parser,
        "--api-tls-cert",
        "PROXY_OPERATOR_GATEWAY_API_TLS_CERT",
        "PEM certificate (chain) for HTTPS on the API; with --api-tls-key",
    )
    cli.env_argument(
        parser,
        "--api-tls-key",
        "PROXY_OPERATOR_GATEWAY_API_TLS_KEY",
        "PEM private key for --api-tls-cert",
    )
    cli.env_argument(
        parser,
        "--api-rate",
        "PROXY_OPERATOR_GATEWAY_API_RATE",
        "requests a second each API token may make",
        str(DEFAULT_RATE),
    )
    cli.env_argument(
        parser,
        "--api-burst",
        "PROXY_OPERATOR_GATEWAY_API_BURST",
        "requests an API token may make at once",
        str(DEFAULT_BURST),
    )
    cli.env_argument(
        parser,
        "--api-connections-per-client",
        "PROXY_OPERATOR_GATEWAY_API_CONNECTIONS_PER_CLIENT",
        f"connections one client address (an IPv6 /64) may hold open on the API, "
        f"1 to {MAX_PER_CLIENT}",
        str(DEFAULT_PER_CLIENT),
    )


def api_settings(args: argparse.Namespace) -> ApiSettings | None:
    """The API's settings, None when it is off; ValueError naming every bad flag.

    A plain-HTTP listener beyond loopback is logged as a warning here, at start.
    """
    if not args.api_listen:
        return None
    problems: list[str] = []
    listen = split_endpoint(args.api_listen)
    if listen is None:
        problems.append(f"--api-listen: {args.api_listen!r} is not host:port (e.g. 0.0.0.0:8889)")
    rate = _number(args.api_rate, "--api-rate (or PROXY_OPERATOR_GATEWAY_API_RATE)", problems)
    burst = _number(args.api_burst, "--api-burst (or PROXY_OPERATOR_GATEWAY_API_BURST)", problems)
    if burst is not None and burst != int(burst):
        problems.append(f"--api-burst: {args.api_burst!r} is not a whole number")
    per_client = _per_client(args.api_connections_per_client, problems)
    tokens = None
    if not args.api_tokens_file:
        problems.append(
            "--api-tokens-file (or PROXY_OPERATOR_GATEWAY_API_TOKENS_FILE) is required with "
            "--api-listen: the API takes bearer tokens only"
        )
    else:
        try:
            tokens = TokenStore(Path(args.api_tokens_file))
        except TokenFileError as err:
            problems.append(str(err))
    tls = _tls(args, problems)
    if problems:
        raise ValueError("; ".join(problems))
    assert listen is not None and tokens is not None and rate is not None and burst is not None
    assert per_client is not None
    if tls is None and not _loopback_only(listen[0]):
        log.warning(
            "--api-listen %s: the control API listens beyond loopback on plain HTTP, so its "
            "bearer tokens and answers cross the network in clear text; give it a certificate "
            "(--api-tls-cert and --api-tls-key) or listen on 127.0.0.1",
            args.api_listen,
        )
    return ApiSettings(listen, tokens, tls, rate, int(burst), per_client)


def _per_client(value: str, problems: list[str]) -> int | None:
    if value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_PER_CLIENT:
        return int(value)
    problems.append(
        "--api-connections-per-client (or PROXY_OPERATOR_GATEWAY_API_CONNECTIONS_PER_CLIENT): "
        f"{value!r} is not a whole number from 1 to {MAX_PER_CLIENT} (half the API's "
        "connections in all, so one address never holds them all)"
    )
    return None


def _loopback_only(host: str) -> bool:
    """Whether every address `host` names is loopback; a name that does not resolve is not."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    try:
        return all(ipaddress.ip_address(str(a).partition("%")[0]).is_loopback for a in addresses)
    except ValueError:
        return False


def _number(value: str, flag: str, problems: list[str]) -> float | None:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number <= MAX_RATE:  # NaN fails too
        problems.append(f"{flag}: {value!r} is not a number above 0 and at most {MAX_RATE:g}")
        return None
    return number


def _tls(args: argparse.Namespace, problems: list[str]) -> ssl.SSLContext | None:
    cert, key = args.api_tls_cert, args.api_tls_key
    if not cert and not key:
        return None
    if not cert or not key:
        problems.append("--api-tls-cert and --api-tls-key: give both, or neither")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        problems.append(f"--api-tls-cert/--api-tls-key: cannot load {cert}, {key}: {err}")
        return None
    return context
