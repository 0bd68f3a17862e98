"""The scrapers' client as a crawl team installs it: alone, in a fresh virtualenv, and crawling.

`pip install './clients/python[scrapy]'` into a virtualenv that has nothing
else (`python -m venv`, no system site packages) must bring Scrapy and
proxy_operator and none of the operator: no Temporal, Kubernetes or cloud
SDK, no top-level `workflows`, `providers` or `gateway`. The spider of the
Scrapy end-to-end test (tests/workflows/test_gateway_scrapy.py, whose
fixtures this reuses) then crawls on that virtualenv's Python, with
GatewayMiddleware, through a real proxy-operator-gateway in front of the
pool's member Squids to a local TLS site.

The install is the same command a crawl team runs, with the index swapped
for the wheels of requirements/client.txt that `make` downloaded into the
suite's virtualenv (`WHEELHOUSE` in the Makefile): the suite needs no network.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.banning_origin import BanningOrigin
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for
from tests.workflows.test_gateway import Pool
from tests.workflows.test_gateway_scrapy import (  # noqa: F401  (the fixtures)
    ALLOWED,
    ISOLATED_ENV,
    ApiGateway,
    banning_origin,
    crawl,
    gateway,
    pool,
    tls_origin,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "python"
# The Makefile's WHEELHOUSE: requirements/client.txt's wheels, in the suite's virtualenv.
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
INSTALL_TIMEOUT = 600
# Fewer pages than an exit is served before the site bans it: this crawl is
# about the install, test_gateway_scrapy about bans.
PAGES = ALLOWED - 2
# What the operator needs and a scraper must not get.
OPERATOR_DISTRIBUTIONS = {"proxy-operator", "temporalio", "kubernetes", "boto3"}
OPERATOR_DISTRIBUTIONS |= {"google-cloud-compute"}
OPERATOR_MODULES = ("workflows", "providers", "gateway", "activities", "startup", "worker", "cli")
GATEWAY_TUNNELS = "proxy_operator_gateway_requests_total"
# What the virtualenv holds, as its own Python sees it from outside any checkout.
INVENTORY = """
import importlib.metadata, importlib.util, json, sys
import proxy_operator.scrapy
print(json.dumps({
    "distributions": sorted({d.metadata["Name"] for d in importlib.metadata.distributions()}),
    "modules": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None],
    "client": proxy_operator.scrapy.__file__,
}))
"""


def venv_run(command: list[str], cwd: Path) -> str:
    """`command` in `cwd`, isolated from this suite's Python and pip's own config: its output."""
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_ENV}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    run = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT
    )
    printed = run.stdout + run.stderr
    assert run.returncode == 0, f"{' '.join(command)}: exit {run.returncode}\n{printed[-5000:]}"
    return run.stdout


def install_client(workdir: Path) -> Path:
    """A fresh virtualenv with `pip install './clients/python[scrapy]'`: its Python.

    From a copy of clients/python without the build leftovers of the
    checkout's own editable install, so nothing stale goes in and the
    checkout is left as it was.
    """
    assert WHEELHOUSE.is_dir(), f"{WHEELHOUSE} is missing: `make` downloads the client's wheels"
    shutil.copytree(
        CLIENT,
        workdir / "clients" / "python",
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    venv = workdir / "venv"
    venv_run([sys.executable, "-m", "venv", str(venv)], workdir)
    python = venv / "bin" / "python"
    pip_install = [str(python), "-m", "pip", "install", "--no-index", "--find-links"]
    venv_run([*pip_install, str(WHEELHOUSE), "./clients/python[scrapy]"], workdir)
    return python


async def test_the_client_installs_alone_and_crawls_through_a_gateway(
    stack: Stack,
    pool: Pool,  # noqa: F811
    gateway: ApiGateway,  # noqa: F811
    banning_origin: BanningOrigin,  # noqa: F811
    tmp_path: Path,
) -> None:
    python = await asyncio.to_thread(install_client, tmp_path)

    found = json.loads(venv_run([str(python), "-c", INVENTORY, *OPERATOR_MODULES], tmp_path))
    installed = {name.lower() for name in found["distributions"]}
    assert {"proxy-operator-client", "scrapy"} <= installed, installed
    assert installed.isdisjoint(OPERATOR_DISTRIBUTIONS), installed & OPERATOR_DISTRIBUTIONS
    assert found["modules"] == []
    assert Path(found["client"]).is_relative_to(tmp_path / "venv"), found["client"]

    (tmp_path / "crawl").mkdir()
    log, items, stats = await asyncio.to_thread(
        crawl, gateway, stack.origin.url, tmp_path / "crawl", pages=PAGES, python=python
    )

    # Every page, each on a session GatewayMiddleware chose, served to a
    # member's Squid: no request went to the site but through the pool.
    pages = {f"/page/{n}" for n in range(PAGES)}
    assert sorted(i["path"] for i in items) == sorted(pages), log[-3000:]
    assert all(i["status"] == 200 and i["body"] == f"page {i['path']}" for i in items), items
    assert all(i["session"] for i in items), items
    assert set(banning_origin.pages) == pages
    assert banning_origin.unknown == 0
    assert stats["reason"] == "finished", stats

    # And the members were reached through the gateway, which counted the tunnels.
    async def tunnelled() -> bool:
        samples = await asyncio.to_thread(gateway.process.metrics)
        return sum(v for (name, _), v in samples.items() if name == GATEWAY_TUNNELS) >= 1

    await wait_for(tunnelled, "the gateway counting the crawl's tunnels", deadline=60)
