"""A real Scrapy crawl through a real gateway, whose site bans each exit after a few pages.

The pool (three members, the local provider: real Squids) sits behind
`proxy-operator-gateway` with its control API on. The site
(tests/helpers/banning_origin.py) tells exits apart by the member Squid
holding the connection, serves each exit ALLOWED pages and then bans it,
with a 403 or with a captcha page (200). The spider
(tests/helpers/pages_spider.py) runs in its own process with
GatewayMiddleware, as `scrapy runspider`. What a crawling team needs: every
page fetched, each banned exit reported through the API and replaced by the
pool, and no password or token in what Scrapy logged.

docs/scrapers.md's examples run here too, against the same kind of gateway:
each `python` block as its `docs-test` directive says (tests/docs/markdown.py).
Playwright's drives Debian's Chromium (`CHROMIUM`, as the doc says; Playwright's
own browsers come from its servers, outside the package registries this
project's machines reach), which trusts the site's CA through an NSS database
in a HOME of its own: Chromium reads no SSL_CERT_FILE.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from proxy_operator.client import GatewayClient
from tests.docs.markdown import Example, examples
from tests.helpers.banning_origin import HOME_TITLE, BanningOrigin, serve_banning_origin
from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.gateway import CHECKOUT_PYTHONPATH, GatewayProcess, pool_gateway
from tests.helpers.network import free_port
from tests.helpers.stacks import Stack
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import wait_for, wait_until
from tests.workflows.test_gateway import REPLICAS, Pool, running_pool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SPIDER = ROOT / "tests" / "helpers" / "pages_spider.py"
PAGES = 30
# Each exit serves this many pages: a crawl of PAGES needs at least three exits.
ALLOWED = 10
CRAWL_TIMEOUT = 600
DOC = ROOT / "docs" / "scrapers.md"
# The docs' target; the site's "/" (not a page, never banned) stands in for it.
DOCS_TARGET = "https://example.com/"
EXAMPLE_TIMEOUT = 120
# Debian's chromium-headless-shell (Makefile's test-tools), for the Playwright example.
CHROMIUM = Path("/usr/lib/chromium/chromium-headless-shell")
# The Playwright example's session key: its tunnel must reach a member on it.
BROWSER_SESSION = "login-3"
# What would let another virtualenv's Python import from this checkout or this one.
ISOLATED_ENV = frozenset({"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"})


@dataclass(frozen=True)
class ApiGateway:
    process: GatewayProcess
    api: str
    token: str


@pytest.fixture
def banning_origin(state_dir: Path) -> Iterator[BanningOrigin]:
    with serve_banning_origin(state_dir, ALLOWED) as origin:
        yield origin


@pytest.fixture
def tls_origin(banning_origin: BanningOrigin) -> TlsOrigin:
    """The stack's origin is the banning site: members and gateway allow CONNECT to its port."""
    assert banning_origin.tls is not None
    return banning_origin.tls


@pytest.fixture
async def pool(temporal_env: WorkflowEnvironment, stack: Stack) -> AsyncIterator[Pool]:
    # The crawl bans a few exits within a minute; the default is one per 10 minutes.
    async with running_pool(stack, bans={"max": 10, "window_seconds": 600}) as found:
        yield found


@pytest.fixture
async def gateway(
    temporal_env: WorkflowEnvironment, stack: Stack, pool: Pool
) -> AsyncIterator[ApiGateway]:
    token = secrets.token_urlsafe(24)
    port = free_port()

    def flags(directory: Path) -> tuple[str, ...]:
        tokens = directory / "tokens"
        tokens.write_text(f"{token}\n")
        return ("--api-listen", f"127.0.0.1:{port}", "--api-tokens-file", str(tokens))

    async with pool_gateway(temporal_env, stack, pool.handle.id, flags) as process:
        yield ApiGateway(process, f"http://127.0.0.1:{port}", token)


def run_python(
    arguments: list[str],
    workdir: Path,
    env: dict[str, str],
    timeout: float,
    python: Path | None = None,
) -> str:
    """`python <arguments>` in `workdir`: what it printed (exit 0).

    The suite's Python with this checkout importable, or `python` (another
    virtualenv's) with only what is installed there.
    """
    if python is None:
        inherited = {**os.environ, "PYTHONPATH": CHECKOUT_PYTHONPATH}
    else:
        inherited = {k: v for k, v in os.environ.items() if k not in ISOLATED_ENV}
    run = subprocess.run(
        [str(python or sys.executable), *arguments],
        cwd=workdir,
        env={**inherited, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    printed = run.stdout + run.stderr
    assert run.returncode == 0, f"exit {run.returncode}:\n{printed[-5000:]}"
    return printed


def middleware_env(gateway: ApiGateway) -> dict[str, str]:
    """GatewayMiddleware's settings from the environment, as docs/scrapers.md exports them."""
    return {
        "PROXY_OPERATOR_GATEWAY": f"127.0.0.1:{gateway.process.port}",
        "PROXY_OPERATOR_USER": USERNAME,
        "PROXY_OPERATOR_PASSWORD": PASSWORD,
        "PROXY_OPERATOR_API": gateway.api,
        "PROXY_OPERATOR_API_TOKEN": gateway.token,
    }


Crawl = tuple[str, list[dict[str, object]], dict[str, int]]


def crawl(
    gateway: ApiGateway,
    origin: str,
    workdir: Path,
    *,
    pages: int = PAGES,
    python: Path | None = None,
    **env_overrides: str,
) -> Crawl:
    """Run the spider to its end (on `python`, as run_python): what it logged, items, stats."""
    items, stats = workdir / "items.jsonl", workdir / "stats.json"
    env = middleware_env(gateway) | env_overrides
    # The token as a setting, the password from the environment: both ways are covered.
    token = env.pop("PROXY_OPERATOR_API_TOKEN")
    log = run_python(
        [
            *("-m", "scrapy", "runspider", str(SPIDER), "-o", f"{items}:jsonlines"),
            *("-s", f"PROXY_OPERATOR_API_TOKEN={token}"),
        ],
        workdir,
        env | {"PAGES_ORIGIN": origin, "PAGES_COUNT": str(pages), "PAGES_STATS": str(stats)},
        CRAWL_TIMEOUT,
        python,
    )
    found = [json.loads(line) for line in items.read_text().splitlines()] if items.exists() else []
    return log, found, json.loads(stats.read_text())


async def test_a_crawl_gets_every_page_reporting_each_ban_and_leaking_no_credential(
    stack: Stack,
    pool: Pool,
    gateway: ApiGateway,
    banning_origin: BanningOrigin,
    tmp_path: Path,
) -> None:
    log, items, stats = await asyncio.to_thread(crawl, gateway, stack.origin.url, tmp_path)

    # Every page, once, from an exit the site had not banned.
    pages = {f"/page/{n}" for n in range(PAGES)}
    assert sorted(i["path"] for i in items) == sorted(pages), items
    assert all(i["status"] == 200 and i["body"] == f"page {i['path']}" for i in items), items
    assert set(banning_origin.pages) == pages
    assert banning_origin.unknown == 0

    # The site banned at least two exits (a 403 and a captcha page), each
    # was reported through the API, and the pool replaced it.
    banned = banning_origin.banned
    assert len(banned) >= 2, banning_origin
    assert stats.get("proxy_operator/ban_reports", 0) >= len(banned), stats
    assert stats.get("proxy_operator/ban_reports_failed", 0) == 0, stats
    assert stats.get("proxy_operator/ban_retries_exhausted", 0) == 0, stats

    seen: dict[str, list[str]] = {}

    async def replaced() -> bool:
        live = set(stack.instances())
        serving = set(pool.instance_by_endpoint().get(e) for e in (await pool.endpoints()).values())
        seen.update(live=sorted(live), serving=sorted(map(str, serving)))
        return not (set(banned) & live) and len(serving) == REPLICAS and not (serving & set(banned))

    try:
        await wait_for(replaced, f"the banned exits {banned} replaced", deadline=180)
    except AssertionError as err:
        status = await pool.handle.query("status")
        rows = [(m["member"], m["state"], m.get("reason")) for m in status["members"]]
        raise AssertionError(f"{err}; last seen {seen}; members {rows}") from None
    client = GatewayClient(gateway.api, gateway.token)
    members = await asyncio.to_thread(client.members)
    assert len(members) == REPLICAS

    # What Scrapy logged (at DEBUG) holds no credential, plain or as a Basic login.
    for secret in (PASSWORD, gateway.token, "Basic "):
        assert secret not in log
    assert "Reported member" in log

    # Nor when the gateway refuses the login: every tunnel is a 407, retried, then given up.
    wrong = "wrong-" + PASSWORD
    (tmp_path / "refused").mkdir()
    log, items, _ = await asyncio.to_thread(
        crawl,
        gateway,
        stack.origin.url,
        tmp_path / "refused",
        pages=2,
        PROXY_OPERATOR_PASSWORD=wrong,
    )
    assert items == [] and "407" in log, log[-3000:]
    for secret in (wrong, gateway.token, "Basic "):
        assert secret not in log


def run_example(example: Example, gateway: ApiGateway, origin: TlsOrigin, workdir: Path) -> str:
    """Run one docs example as its directive says; what it printed, or an AssertionError."""
    text = example.text.replace(DOCS_TARGET, origin.url)
    if example.directive("syntax-only") is not None:
        compile(text, example.source, "exec")
        return ""
    ca_file = workdir / "ca.pem"
    origin.ca.cert_pem.write_to_path(str(ca_file))
    script = workdir / "example.py"
    script.write_text(text)
    output = workdir / "items.jsonl"
    if example.directive("python") is not None:
        arguments = [str(script)]
    elif example.directive("scrapy-runspider") is not None:
        arguments = ["-m", "scrapy", "runspider", str(script), "-o", f"{output}:jsonl"]
    else:
        raise AssertionError("no docs-test directive says how to run it (python, ...)")
    env = middleware_env(gateway) | {
        # What the docs export.
        "GATEWAY": f"127.0.0.1:{gateway.process.port}",
        "PROXY_PASSWORD": PASSWORD,
        "GATEWAY_API": gateway.api,
        "GATEWAY_API_TOKEN": gateway.token,
        # The site's CA, for requests and httpx (Scrapy does not verify).
        "REQUESTS_CA_BUNDLE": str(ca_file),
        "SSL_CERT_FILE": str(ca_file),
    }
    browser = "sync_playwright" in text
    if browser:
        env |= browser_env(workdir, ca_file)
    printed = run_python(arguments, workdir, env, EXAMPLE_TIMEOUT)
    if example.directive("scrapy-runspider") is not None:
        items = [json.loads(line) for line in output.read_text().splitlines()]
        assert items and all(i["status"] == 200 for i in items), items
    if browser:
        browsed_through_gateway(text, printed, gateway)
    return printed


def browser_env(workdir: Path, ca_file: Path) -> dict[str, str]:
    """Debian's Chromium as `CHROMIUM`, and a HOME whose NSS database trusts the site's CA.

    Chromium on Linux trusts what `~/.pki/nssdb` adds to its roots; Playwright
    runs it with `--no-sandbox` (root may not sandbox) unless told otherwise.
    """
    assert CHROMIUM.exists(), f"{CHROMIUM} missing: `make test-tools` installs it"
    home = workdir / "home"
    nssdb = home / ".pki" / "nssdb"
    nssdb.mkdir(parents=True)
    for certutil in (
        ("-N", "--empty-password"),
        ("-A", "-n", "test-origin-ca", "-t", "C,,", "-i", str(ca_file)),
    ):
        subprocess.run(["certutil", "-d", f"sql:{nssdb}", *certutil], check=True, timeout=30)
    return {"CHROMIUM": str(CHROMIUM), "HOME": str(home)}


def browsed_through_gateway(text: str, printed: str, gateway: ApiGateway) -> None:
    """The browser printed the site's title, and the gateway saw its tunnel on its session."""
    assert f'session="{BROWSER_SESSION}"' in text, "the example's session is not BROWSER_SESSION"
    assert HOME_TITLE in printed.splitlines(), printed
    client = GatewayClient(gateway.api, gateway.token)
    wait_until(
        lambda: any(BROWSER_SESSION in m.sessions for m in client.members()),
        60,
        f"a member listed as carrying session {BROWSER_SESSION} (the router logged its CONNECT)",
    )


async def test_every_python_example_in_scrapers_md_runs(
    gateway: ApiGateway, stack: Stack, tmp_path: Path
) -> None:
    found = examples(DOC, ROOT, language="python")
    assert len(found) >= 5, "docs/scrapers.md's python blocks not found"
    failures = []
    for n, example in enumerate(found):
        workdir = tmp_path / str(n)
        workdir.mkdir()
        try:
            printed = await asyncio.to_thread(run_example, example, gateway, stack.origin, workdir)
        except (AssertionError, SyntaxError, subprocess.TimeoutExpired) as failure:
            failures.append(f"--- {example.source}\n{failure}")
            continue
        if PASSWORD in printed or gateway.token in printed:
            failures.append(f"--- {example.source}\nprinted a secret:\n{printed}")
    assert not failures, "\n".join(failures)
