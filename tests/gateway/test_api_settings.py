"""The control API's flags and tokens file: every problem named before the gateway starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from gateway.api_settings import ApiSettings, api_settings
from gateway.api_tokens import TokenFileError, TokenStore
from gateway.main import parse_args

TOKEN = "t0ken-for-the-crawlers-1"


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


def test_tls_files_that_do_not_load_are_named(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")

    def with_tls(cert: Path, key: Path) -> ApiSettings | None:
        listen = ["--api-listen", "127.0.0.1:8889", "--api-tokens-file", str(tokens)]
        return settings(*listen, "--api-tls-cert", str(cert), "--api-tls-key", str(key))

    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError) as caught:
        with_tls(bad, bad)
    assert "--api-tls-cert/--api-tls-key: cannot load" in str(caught.value)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued = trustme.CA().issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    loaded = with_tls(cert, key)
    assert loaded is not None and loaded.tls is not None
