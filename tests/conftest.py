"""Suite-wide guards and fixtures (built on tests/helpers).

Tests must never reach a real cluster or cloud, so the developer's kubeconfig,
in-cluster config and Google credentials are made unreachable for every test.
Tests that need a client inject one pointed at a fake server.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server, start_time_skipping_server
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin


class RealCredentialsForbidden(RuntimeError):
    """Raised when code under test tries to load real cluster or cloud credentials."""


def _forbidden(*_args: Any, **_kwargs: Any) -> Any:
    raise RealCredentialsForbidden(
        "tests must not load a kubeconfig, in-cluster config or cloud credentials"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Start a native traceback at the test, as pytest's own styles do.

    pyproject.toml asks for native tracebacks (it says why), and pytest then
    prints every pytest and pluggy frame above the test too
    (pytest-dev/pytest#13023). The traceback is cut where pytest would cut
    its own; this reads frames and code objects only, it parses no source.
    """
    config = item.config
    if call.excinfo is None or config.getoption("tbstyle") != "native":
        return
    if config.getoption("fulltrace"):
        return
    trimmed = item._traceback_filter(call.excinfo)
    if trimmed:
        call.excinfo.traceback = trimmed


@pytest.fixture(autouse=True)
def _no_real_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    empty = tmp_path_factory.mktemp("no-credentials")
    monkeypatch.setenv("KUBECONFIG", str(empty / "kubeconfig-does-not-exist"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(empty / "gcloud"))
    # boto3's default chain: no keys from the environment, no ~/.aws, no
    # instance metadata (the AWS fake's clients carry fake keys of their own).
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty / "aws-config-does-not-exist"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "aws-credentials-does-not-exist"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    import google.auth
    from kubernetes import config as k8s_config

    monkeypatch.setattr(k8s_config, "load_kube_config", _forbidden)
    monkeypatch.setattr(k8s_config, "load_incluster_config", _forbidden)
    monkeypatch.setattr(k8s_config, "load_config", _forbidden)
    monkeypatch.setattr(google.auth, "default", _forbidden)
    yield


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """A real Temporal dev server, started once per session (a few seconds)."""
    env = await start_dev_server()
    yield env
    await env.shutdown()


@pytest.fixture(scope="module")
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    """The Java test server: timers (lifetimes, backoffs, quota waits) skip ahead.

    One per module: an activity its workflow closed on without waiting for
    it (a pool's members' monitor, cancelled as the pool ends) holds a
    time-skipping lock until it times out, since the server refuses its
    late completion; virtual time then runs at wall-clock pace for every
    later test on that server (tests/helpers/time_skipping.py).
    """
    env = await start_time_skipping_server()
    yield env
    await env.shutdown()


@pytest.fixture
def task_queue() -> str:
    """A task queue of the test's own, so tests never see each other's workflows."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A local provider state directory; whatever runs in it is deleted afterwards."""
    with local_state_dir() as path:
        yield path


@pytest.fixture(scope="session")
def tls_origin() -> Iterator[TlsOrigin]:
    """A stateless HTTPS origin on 127.0.0.1, shared by the whole session."""
    with serve_tls_origin() as origin:
        yield origin


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first, each group in its collected order.

    pytest-xdist hands tests to its processes in this order, a few at a time:
    the end-to-end tests, some of which take minutes, start while the quick
    ones can still fill in around them, rather than one of them running alone
    at the end of the run.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
