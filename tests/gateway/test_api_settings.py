"""The control API's flags and tokens file: every problem named before the gateway starts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trustme

from gateway.api_settings import ApiSettings, api_settings
from gateway.api_tokens import TokenFileError, TokenStore
from gateway.main import parse_args
from tests.gateway.test_main import run_gateway
from tests.helpers.config import PASSWORD, PASSWORD_ENV

TOKEN = "t0ken-for-the-crawlers-1"
PLAIN_BEYOND_LOOPBACK = "the control API listens beyond loopback on plain HTTP"


def settings(*argv: str) -> ApiSettings | None:
    return api_settings(parse_args(["--pool", "web", *argv]))


def test_the_api_is_off_unless_asked_for(tmp_path: Path) -> None:
    assert settings() is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--api-listen", "8889"], "--api-listen: '8889' is not host:port"),
        (
            ["--api-listen", "127.0.0.1:8889"],
            "--api-tokens-file (or PROXY_OPERATOR_GATEWAY_API_TOKENS_FILE) is required",
        ),
        (
            ["--api-listen", "127.0.0.1:8889", "--api-tokens-file", "/nonexistent/tokens"],
            "--api-tokens-file: /nonexistent/tokens: No such file",
        ),
        (
            ["--api-listen", "127.0.0.1:8889", "--api-rate", "0"],
            "--api-rate (or PROXY_OPERATOR_GATEWAY_API_RATE): '0'",
        ),
        (["--api-listen", "127.0.0.1:8889", "--api-rate", "nan"], "--api-rate"),
        (
            ["--api-listen", "127.0.0.1:8889", "--api-burst", "2.5"],
            "--api-burst: '2.5' is not a whole number",
        ),
        (["--api-listen", "127.0.0.1:8889", "--api-tls-cert", "cert.pem"], "give both, or neither"),
        (
            ["--api-listen", "127.0.0.1:8889", "--api-connections-per-client", "0"],
            "--api-connections-per-client (or PROXY_OPERATOR_GATEWAY_API_CONNECTIONS_PER_CLIENT):"
            " '0' is not a whole number from 1 to 64",
        ),
        (
            ["--api-listen", "127.0.0.1:8889", "--api-connections-per-client", "65"],
            "--api-connections-per-client (or PROXY_OPERATOR_GATEWAY_API_CONNECTIONS_PER_CLIENT):"
            " '65' is not a whole number from 1 to 64",
        ),
        (
            ["--api-listen", "127.0.0.1:8889", "--api-connections-per-client", "2.5"],
            "--api-connections-per-client (or PROXY_OPERATOR_GATEWAY_API_CONNECTIONS_PER_CLIENT):"
            " '2.5'",
        ),
    ],
)
def test_bad_api_flags_are_named(tmp_path: Path, argv: list[str], expected: str) -> None:
    with pytest.raises(ValueError) as caught:
        settings(*argv)
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "holds no token"),
        ("# only a comment\n\n", "holds no token"),
        ("short\n", "line 1: a token is 16 to 512"),
        (f"# ok\n{TOKEN}\n{TOKEN} extra\n", "line 3"),
        (f"{TOKEN}\x00\n", "line 1"),
        ("x" * 600 + "\n", "line 1"),
    ],
)
def test_a_tokens_file_without_good_tokens_refuses_to_start(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(TokenFileError) as caught:
        TokenStore(path)
    assert expected in str(caught.value)
    assert TOKEN not in str(caught.value), "a token (maybe a real one with a typo) is never echoed"


def test_tokens_are_kept_as_digests_and_matched_exactly(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"  {TOKEN}  \n# {TOKEN}x\n")
    store = TokenStore(path)
    assert TOKEN not in repr(vars(store))
    assert store.match(TOKEN) is not None
    for wrong in ("", TOKEN + "x", TOKEN[:-1], TOKEN.upper(), f"{TOKEN}x"):
        assert store.match(wrong) is None


def test_a_tokens_file_that_turns_bad_keeps_the_tokens_there_were(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN}\n")
    store = TokenStore(path)
    path.write_text("short\n")
    store.reload()
    assert store.match(TOKEN) is not None
    path.write_text("# every token revoked\n")
    store.reload()
    assert store.match(TOKEN) is None


def certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate and its key, as PEM files in `directory`."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    issued = trustme.CA().issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return cert, key


def tokens_file(directory: Path) -> Path:
    tokens = directory / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    return tokens


def test_tls_files_that_do_not_load_are_named(tmp_path: Path) -> None:
    tokens = tokens_file(tmp_path)

    def with_tls(cert: Path, key: Path) -> ApiSettings | None:
        listen = ["--api-listen", "127.0.0.1:8889", "--api-tokens-file", str(tokens)]
        return settings(*listen, "--api-tls-cert", str(cert), "--api-tls-key", str(key))

    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError) as caught:
        with_tls(bad, bad)
    assert "--api-tls-cert/--api-tls-key: cannot load" in str(caught.value)
    loaded = with_tls(*certificate(tmp_path))
    assert loaded is not None and loaded.tls is not None


@pytest.mark.parametrize(
    ("listen", "tls", "warned"),
    [
        ("0.0.0.0:8889", False, True),
        ("[::]:8889", False, True),
        ("no-such-host.invalid:8889", False, True),
        ("127.0.0.1:8889", False, False),
        ("127.0.0.2:8889", False, False),
        ("[::1]:8889", False, False),
        ("localhost:8889", False, False),
        ("0.0.0.0:8889", True, False),
    ],
)
def test_a_plain_listener_beyond_loopback_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, listen: str, tls: bool, warned: bool
) -> None:
    argv = ["--api-listen", listen, "--api-tokens-file", str(tokens_file(tmp_path))]
    if tls:
        cert, key = certificate(tmp_path)
        argv += ["--api-tls-cert", str(cert), "--api-tls-key", str(key)]
    with caplog.at_level(logging.WARNING, logger="proxy_operator.gateway"):
        assert settings(*argv) is not None
    warnings = [r.getMessage() for r in caplog.records if PLAIN_BEYOND_LOOPBACK in r.getMessage()]
    if warned:
        (warning,) = warnings
        assert f"--api-listen {listen}:" in warning
        assert "--api-tls-cert and --api-tls-key" in warning and "127.0.0.1" in warning
    else:
        assert warnings == []


@pytest.mark.slow
def test_the_warning_is_among_the_first_lines_a_gateway_writes(tmp_path: Path) -> None:
    """At start, before Temporal is reached (here it cannot be: the gateway exits after)."""
    env = {PASSWORD_ENV: PASSWORD, "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    tokens = str(tokens_file(tmp_path))
    result = run_gateway(
        tmp_path, env, "--pool", "web", "--api-listen", "0.0.0.0:8889", "--api-tokens-file", tokens
    )
    assert result.returncode == 1, result.stderr
    warning, error = (
        result.stderr.index(PLAIN_BEYOND_LOOPBACK),
        result.stderr.index("error: cannot connect to Temporal"),
    )
    assert warning < error, result.stderr
