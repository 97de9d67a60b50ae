"""The server's listening socket: connections accepted from it have TCP_NODELAY, as asyncio sets it only
on sockets that name their protocol (without it, kept-alive requests wait on Nagle's algorithm)."""

from __future__ import annotations

import asyncio
import socket

from gracelm.server.api_server import _bind


def test_accepted_connections_have_tcp_nodelay():
    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        with _bind("127.0.0.1", 0) as listener:
            server = await asyncio.start_server(on_connection, sock=listener)
            async with server:
                _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
                result = await asyncio.wait_for(seen, 5)
                writer.close()
            return result

    assert asyncio.run(accepted_nodelay()) != 0
