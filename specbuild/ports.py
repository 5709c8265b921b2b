"""Free TCP ports on 127.0.0.1 for the servers the benchmarks, the soak and the tests start.

All the ports one server needs are asked for at once: each socket stays bound until every port is known, so the
kernel never hands the same port out twice (asking one at a time and closing in between can, and a server given the
same port for two listeners refuses to start).
"""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct ports, free when asked (another process may still take one before the server binds it)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]
