"""`make run`'s script (deploy/local/devenv.py) as a module, and its demo site's config.

deploy/ is not a package: the script is loaded from its file, as
`make run` runs it, so tests use its own demo site and config rather than
stand-ins.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from tests.helpers.config import local_entry

ROOT = Path(__file__).resolve().parents[2]
DEVENV = ROOT / "deploy" / "local" / "devenv.py"
LOCAL_CONFIG = ROOT / "deploy" / "local" / "providers.yaml"
# Where deploy/local/providers.yaml has the demo site; a test serves it on a port of its own.
DEMO_SITE = "127.0.0.1:8443"


def load_devenv() -> ModuleType:
    spec = importlib.util.spec_from_file_location("devenv", DEVENV)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up by name while they are made.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def demo_config(
    state_dir: Path, installation: str, demo_site: str, more_exceptions: tuple[str, ...] = ()
) -> dict[str, Any]:
    """deploy/local/providers.yaml as shipped, but for the test's state_dir, installation and site.

    Its access rules stay the shipped ones: the default denied destinations,
    port 443, and the demo site (moved to `demo_site`) as the one exception
    (with `more_exceptions`, such as a test's TLS origin).
    """
    raw: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    assert raw["proxy"]["destination_exceptions"] == [DEMO_SITE], "the shipped demo site moved"
    assert "denied_destinations" not in raw["proxy"], "the shipped config no longer denies"
    raw["installation"] = installation
    raw["proxy"]["destination_exceptions"] = [demo_site, *more_exceptions]
    raw["providers"] = [local_entry(state_dir)]
    return raw
