"""Suite-wide guards and fixtures.

Tests must never reach a real cluster or cloud, so the developer's kubeconfig,
in-cluster config and Google credentials are made unreachable for every test.
Tests that need a client inject one pointed at a fake server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


class RealCredentialsForbidden(RuntimeError):
    """Raised when code under test tries to load real cluster or cloud credentials."""


def _forbidden(*_args: Any, **_kwargs: Any) -> Any:
    raise RealCredentialsForbidden(
        "tests must not load a kubeconfig, in-cluster config or cloud credentials"
    )


@pytest.fixture(autouse=True)
def _no_real_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    empty = tmp_path_factory.mktemp("no-credentials")
    monkeypatch.setenv("KUBECONFIG", str(empty / "kubeconfig-does-not-exist"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(empty / "gcloud"))
    import google.auth
    from kubernetes import config as k8s_config

    monkeypatch.setattr(k8s_config, "load_kube_config", _forbidden)
    monkeypatch.setattr(k8s_config, "load_incluster_config", _forbidden)
    monkeypatch.setattr(k8s_config, "load_config", _forbidden)
    monkeypatch.setattr(google.auth, "default", _forbidden)
    yield


from tests.fixtures.state_dir import state_dir  # noqa: E402, F401
from tests.fixtures.temporal import task_queue, temporal_env, time_skipping_env  # noqa: E402, F401
from tests.fixtures.tls_origin import tls_origin  # noqa: E402, F401
