"""Reading a request head and relaying a tunnel's bytes: what the router and the wake holder share.

Standard library only: the router runs it as Squid's user, from a copy.
"""

from __future__ import annotations

import asyncio
import contextlib

MAX_HEAD = 16384
# The router's and a holder's peers (the front, the router) send a request's
# head at once: they have read all of it already. A socket silent for longer
# is not theirs, and is cut.
HEAD_TIMEOUT = 10.0
RELAY_CHUNK = 65536


async def read_head(reader: asyncio.StreamReader) -> bytes | None:
    """A request head through its blank line; None if the peer closed or sent too much."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    return head if len(head) <= MAX_HEAD else None


async def relay(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    member_reader: asyncio.StreamReader,
    member_writer: asyncio.StreamWriter,
) -> None:
    """Bytes both ways until both sides are done; a side's end is passed on as a half-close."""

    async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while chunk := await source.read(RELAY_CHUNK):
                sink.write(chunk)
                await sink.drain()
        with contextlib.suppress(OSError):
            sink.write_eof()

    try:
        await asyncio.gather(pipe(member_reader, client_writer), pipe(client_reader, member_writer))
    finally:
        member_writer.close()
