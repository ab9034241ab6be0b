"""Listening sockets bound up front, so a busy port fails at once with one clear line.

`servefleet engine` binds before it imports torch or loads a model (seconds to minutes),
the gateway and `servefleet up` before they start anything else; the socket is then
handed to uvicorn. Standard library only: importing this costs nothing.
"""

from __future__ import annotations

import errno
import socket


class ListenError(OSError):
    """The port cannot be listened on (taken, privileged); the message says which and what
    to do, in one line."""


def bind_listener(
    host: str, port: int, *, flag: str = "--port", backlog: int = 2048
) -> socket.socket:
    """A TCP socket bound to `host:port` and listening; `flag` is how the user picks another."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OverflowError as exc:
        sock.close()
        raise ListenError(
            f"port {port} is not a TCP port; choose one in 1-65535 with {flag}"
        ) from exc
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(
                f"port {port} on {host} is already in use; stop what listens there or choose "
                f"another port with {flag} N",
            ) from exc
        if exc.errno == errno.EACCES:
            raise ListenError(
                f"no permission to listen on port {port} on {host}; choose a port above 1023 "
                f"with {flag} N",
            ) from exc
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(False)
    return sock
