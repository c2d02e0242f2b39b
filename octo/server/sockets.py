"""The listening sockets of ``octo serve``, taken first: before its engine worker starts and before anything loads.

A port in use is then an error at once (not after a load of seconds or minutes, and never a traceback), and nothing
started meanwhile can take it (a Ray head starts a dozen services on free ports). Only ``socket`` here: ``octo serve``
calls it before it imports asyncio or aiohttp (``octo.cli.serve``); ``octo.server.listen`` serves the sockets.
"""

from __future__ import annotations

import errno
import socket


def open_sockets(host: str | None, port: int) -> list[socket.socket]:
    """Listening TCP sockets for ``host:port``, one per address ``host`` resolves to (as asyncio's create_server
    binds); port 0 takes one free port for all of them. Raises ``OSError`` with a message fit for the user."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve --host {host}: {exc.strerror}") from None
    socks: list[socket.socket] = []
    skipped: list[str] = []
    seen: set[tuple] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            if port == 0 and socks:  # every address on the port the first one got
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            where = f"[{addr[0]}]:{addr[1]}" if family == socket.AF_INET6 else f"{addr[0]}:{addr[1]}"
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # a family this host does not have (IPv6 off), as asyncio skips it
                skipped.append(f"{where}: {exc.strerror}")
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart beside TIME_WAIT connections
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(exc.errno, f"{where} is already in use (another server on that port? "
                                             f"choose another with --port)") from None
                if exc.errno == errno.EADDRNOTAVAIL:  # e.g. ::1 for "localhost" with IPv6 disabled (asyncio's rule)
                    socks.pop().close()
                    skipped.append(f"{where}: {exc.strerror}")
                    continue
                raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror}") from None
            sock.listen(1024)
            sock.setblocking(False)
        if not socks:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on any address of --host {host}: "
                                               + "; ".join(skipped))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks
