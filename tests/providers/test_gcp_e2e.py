"""Opt-in: GcpProvider against a real GCP project. Costs a few cents per run.

Creates one e2-micro proxy VM, waits until `get` says RUNNING, which must mean
its startup script has reported Squid ready (so a probe passes at once), checks
that its boot disk carries its labels, tunnels an HTTPS request through it,
deletes it, and removes the firewall rule it made. Skipped unless these are
set (see docs/providers.md, "GCP"):

    PROXY_OPERATOR_E2E_GCP_PROJECT      project to create the VM in
    PROXY_OPERATOR_E2E_GCP_ZONE         e.g. europe-west1-b
    PROXY_OPERATOR_E2E_GCP_CLIENT_CIDR  this machine's public egress, e.g. 203.0.113.7/32

Credentials are Application Default Credentials (`gcloud auth
application-default login`, or GOOGLE_APPLICATION_CREDENTIALS):

    pytest -m gcp_e2e tests/providers/test_gcp_e2e.py
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets

import google.auth
import pytest
from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from activities.probe import ProbeResult, probe_connect
from providers.base import CreateRequest, Instance, InstanceState
from providers.config import parse_config
from providers.errors import NotFound
from providers.gcp import GcpProvider, firewall_name, labels
from providers.naming import INSTALLATION_KEY, instance_name, owner_tags
from tests.helpers.waiting import until

PROJECT = os.environ.get("PROXY_OPERATOR_E2E_GCP_PROJECT", "")
ZONE = os.environ.get("PROXY_OPERATOR_E2E_GCP_ZONE", "")
CLIENT_CIDR = os.environ.get("PROXY_OPERATOR_E2E_GCP_CLIENT_CIDR", "")
TARGET = os.environ.get("PROXY_OPERATOR_E2E_GCP_TARGET", "https://www.google.com/")

# Captured at import, before the suite's guard (tests/conftest.py) replaces
# them for every test; only this test puts them back.
_REAL_ADC = google.auth.default
_REAL_ENV = {
    name: os.environ.get(name) for name in ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG")
}

pytestmark = [
    pytest.mark.gcp_e2e,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        not (PROJECT and ZONE and CLIENT_CIDR),
        reason="set PROXY_OPERATOR_E2E_GCP_PROJECT, _ZONE and _CLIENT_CIDR to run",
    ),
]


def test_proxy_vm_lifecycle_on_a_real_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(google.auth, "default", _REAL_ADC)
    for name, value in _REAL_ENV.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)

    installation = f"e2e-{secrets.token_hex(4)}"
    owner = f"gcp-e2e-{secrets.token_hex(4)}"
    password = secrets.token_urlsafe(24)
    config = parse_config(
        {
            "installation": installation,
            "proxy": {"auth": {"password_env": "E2E_PASSWORD"}, "allowed_cidrs": [CLIENT_CIDR]},
            "providers": [
                {"name": "gcp-e2e", "type": "gcp", "gcp": {"project": PROJECT, "zone": ZONE}}
            ],
        },
        environ={"E2E_PASSWORD": password},
    )
    provider = GcpProvider.from_config(config.provider("gcp-e2e"), config)
    settings = config.proxy_settings()
    req = CreateRequest(
        name=instance_name(owner, 1),
        proxy=settings,
        tags=owner_tags(installation, owner, 1),
        placement={"zone": ZONE},
    )
    provider_id = f"{ZONE}/{req.name}"
    try:
        created = provider.create(req)
        assert created.provider_id == provider_id

        # The VM boots in seconds; its startup script then installs Squid,
        # which takes minutes on an e2-micro. `get` stays PROVISIONING
        # meanwhile (or ends TERMINATED with the script's reason).
        seen: list[Instance] = []

        def fetch() -> Instance:
            seen.append(provider.get(provider_id))
            return seen[-1]

        running = until(
            fetch, lambda i: i.state is not InstanceState.PROVISIONING, timeout=900, every=10
        )
        assert running.state is InstanceState.RUNNING, running
        assert running.ip and running.tags == req.tags
        assert any("startup script" in i.reason for i in seen), seen
        assert req.name in {i.name for i in provider.list_by_tag(INSTALLATION_KEY, installation)}

        disk = compute_v1.DisksClient().get(project=PROJECT, zone=ZONE, disk=req.name)
        assert dict(disk.labels) == labels(req.tags)

        # RUNNING means Squid answers: the first probes pass, no boot to wait out.
        def probe() -> ProbeResult:
            return asyncio.run(
                probe_connect(
                    running.ip, running.port, settings.username, password, TARGET, timeout=10
                )
            )

        result = until(probe, lambda r: r.ok, timeout=60, every=5)
        assert result.ok, result
    finally:
        provider.delete(provider_id)
        # The provider never deletes its installation's rule; this test's is throwaway.
        with contextlib.suppress(api_exceptions.NotFound):
            compute_v1.FirewallsClient().delete(
                project=PROJECT, firewall=firewall_name(installation)
            ).result(timeout=300)

    with pytest.raises(NotFound):
        provider.get(provider_id)
