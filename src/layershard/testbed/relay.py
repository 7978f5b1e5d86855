"""``python -m layershard.testbed.relay --port P --delay S [--jitter S]``: the testbed's delay
line where the kernel has no netem (netns.py). Runs in the router namespace; nftables redirects
every TCP connection crossing the router to port P. Each accepted connection is joined to its
original destination (``SO_ORIGINAL_DST``), and each direction's bytes are written there ``delay``
seconds (+- ``jitter``, order kept) after they arrived: a one-way delay per direction, as netem
gives. The rate is not the relay's business: tbf shapes both ends of every link.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import struct

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
CHUNK = 1 << 16


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, jitter: float
) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` (+- ``jitter``) after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    last = 0.0

    async def drain() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    task = asyncio.create_task(drain())
    try:
        while True:
            data = await reader.read(CHUNK)
            due = max(last, loop.time() + delay + random.uniform(-jitter, jitter))
            last = due
            queue.put_nowait((due, data))
            if not data:
                break
        await task
    except (ConnectionError, OSError):
        task.cancel()
    finally:
        writer.close()


async def _serve(port: int, delay: float, jitter: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            host, dport = original_destination(sock)
            up_reader, up_writer = await asyncio.open_connection(host, dport)
        except OSError:  # the destination is unreachable (its link is down): as the kernel would
            writer.close()
            return
        for w in (writer, up_writer):
            s = w.get_extra_info("socket")
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(
            _pump(reader, up_writer, delay, jitter), _pump(up_reader, writer, delay, jitter),
            return_exceptions=True,
        )  # fmt: skip

    server = await asyncio.start_server(handle, "0.0.0.0", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay", type=float, required=True, help="seconds, one way")
    p.add_argument("--jitter", type=float, default=0.0, help="seconds, uniform +-")
    a = p.parse_args()
    asyncio.run(_serve(a.port, a.delay, a.jitter))


if __name__ == "__main__":
    main()
