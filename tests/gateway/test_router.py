"""The router in this process, on real sockets: what it does with more than it can hold."""

from __future__ import annotations

import asyncio
import io

from gateway.router import Router
from tests.helpers.waiting import wait_for


async def test_connections_past_its_descriptors_are_refused_and_the_rest_kept() -> None:
    router = Router("proxy", "password", None, io.StringIO())
    router.max_connections = 2
    server = await asyncio.start_server(router.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await wait_for(lambda: router.connections == 2, "the router to take both")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the third is closed at once"
        writer.close()
        # The two held ones are still served: a CONNECT without credentials gets its 407.
        for held_reader, held_writer in held:
            held_writer.write(b"CONNECT a:443 HTTP/1.1\r\n\r\n")
            assert (await asyncio.wait_for(held_reader.readline(), 5)).startswith(b"HTTP/1.1 407 ")
            held_writer.close()
