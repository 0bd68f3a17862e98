"""Does one Squid refuse connections while it reloads? Non-SMP against SMP.

    python -m bench.reconfigure [--reloads 10] [--clients 4] [--workers 1 2]

For each `--workers` value, one bare Squid on loopback (CONNECT allowed to
a local echo server, no auth, no parents) takes `--reloads`
`squid -k reconfigure`s, 1.5 s apart, while `--clients` threads connect and
CONNECT back to back. Prints CONNECTs that worked and failed (by error), and
whether a tunnel opened before the reloads still carries bytes after them.
`workers 1` runs with `-N` (no kids, as the local provider's proxies run),
`workers 2` and more with `--foreground` (SMP: a coordinator and kids).

The gateway's design rests on this (gateway/squid.py, docs/architecture.md
"The gateway"). Needs root or a Squid user that can write
/run/squid (SMP's IPC sockets). Asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from squid.process import find_binary, remove_shm, service_name
from tests.helpers.network import free_port

RELOAD_GAP = 1.5
UP_DEADLINE = 30.0


class Echo:
    """A loopback TCP server that echoes what it gets: the CONNECTs' origin."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port: int = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)


def tunnel(port: int, origin: int) -> socket.socket:
    """An open tunnel to `origin` through the Squid on `port`, or OSError."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sock.sendall(f"CONNECT 127.0.0.1:{origin} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(4096)
            if not data:
                raise OSError("closed before an answer")
            head += data
        status = head.split(b"\r\n")[0]
        if b" 200 " not in status:
            raise OSError(status.decode(errors="replace"))
        sock.sendall(b"ping")
        if sock.recv(4) != b"ping":
            raise OSError("no echo")
        return sock
    except BaseException:
        sock.close()
        raise


def run(workers: int, reloads: int, clients: int, binary: str) -> str:
    directory = Path(tempfile.mkdtemp(prefix=f"bench-reconfigure-{workers}-"))
    directory.chmod(0o777)  # Squid's user writes its logs here
    echo, port = Echo(), free_port()
    service = service_name(str(directory))
    conf = directory / "squid.conf"

    def write(generation: int) -> None:
        conf.write_text(
            "\n".join(
                [
                    f"# generation {generation}",
                    f"http_port 127.0.0.1:{port}",
                    *([f"workers {workers}"] if workers > 1 else []),
                    f"pid_filename {directory}/squid.pid",
                    "access_log none",
                    f"cache_log {directory}/cache.log",
                    f"coredump_dir {directory}",
                    *(["cache_effective_user proxy"] if os.geteuid() == 0 else []),
                    "acl CONNECT method CONNECT",
                    "http_access allow CONNECT",
                    "http_access deny all",
                    "cache deny all",
                    "pinger_enable off",
                    "shutdown_lifetime 1 seconds",
                    "",
                ]
            )
        )

    write(0)
    mode = "-N" if workers == 1 else "--foreground"
    squid = subprocess.Popen(
        [binary, mode, "-f", str(conf), "-n", service],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        until = time.monotonic() + UP_DEADLINE
        while True:
            try:
                tunnel(port, echo.port).close()
                break
            except OSError:
                if time.monotonic() > until or squid.poll() is not None:
                    return f"workers={workers}: Squid did not come up (see {directory}/cache.log)"
                time.sleep(0.1)
        held = tunnel(port, echo.port)
        stop = threading.Event()
        outcomes: collections.Counter[str] = collections.Counter()

        def loop() -> None:
            while not stop.is_set():
                try:
                    tunnel(port, echo.port).close()
                    outcomes["ok"] += 1
                except OSError as err:
                    outcomes[type(err).__name__] += 1

        threads = [threading.Thread(target=loop) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for generation in range(1, reloads + 1):
            time.sleep(RELOAD_GAP)
            write(generation)
            subprocess.run(
                [binary, "-k", "reconfigure", "-f", str(conf), "-n", service],
                capture_output=True,
                check=True,
            )
        time.sleep(RELOAD_GAP)
        stop.set()
        for thread in threads:
            thread.join()
        try:
            held.sendall(b"abcd")
            survived = held.recv(4) == b"abcd"
        except OSError:
            survived = False
        ok = outcomes.pop("ok", 0)
        failed = ", ".join(f"{n} {kind}" for kind, n in outcomes.most_common()) or "0"
        return (
            f"| {workers} | {mode} | {reloads} | {ok} | {failed} | {'yes' if survived else 'no'} |"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(squid.pid, signal.SIGTERM)
        squid.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(squid.pid, signal.SIGKILL)
        remove_shm(service)
        for leftover in Path("/run/squid").glob(f"{service}-*.ipc"):
            with contextlib.suppress(OSError):
                leftover.unlink()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reloads", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    binary = find_binary()
    print("| workers | mode | reloads | CONNECTs ok | failed | tunnel survived |")
    print("|---|---|---|---|---|---|")
    for workers in args.workers:
        print(run(workers, args.reloads, args.clients, binary), flush=True)


if __name__ == "__main__":
    main()
