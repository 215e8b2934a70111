"""Serve a directory over HTTP on 127.0.0.1 for the ingest benchmark (not part of epochcache).

aiohttp's static route answers GETs with ``sendfile`` (no copy through Python) and lists
directories as HTML links, which fsspec's HTTP filesystem can ``find``. It runs as its own
process so the server's CPU is not the client's. Prints ``PORT <n>`` once it listens::

    python scripts/http_files.py DIR [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from aiohttp import web


async def serve(root: str, port: int) -> None:
    app = web.Application()
    app.router.add_static("/", root, show_index=True, follow_symlinks=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    site = web.SockSite(runner, sock, backlog=1024)
    await site.start()
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.root, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
