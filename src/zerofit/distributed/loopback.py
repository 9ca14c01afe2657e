"""A listening socket on loopback only, for a TCPStore server that nothing outside this machine can reach.

torch's TCPStore listens on every interface whatever host name it is given, and its server executes
requests from anyone who reaches the port. Handed a socket that is already bound to 127.0.0.1 (the
documented `master_listen_fd` argument) it listens there instead. Both stores zerofit hosts itself do so:
the launcher's one-machine rendezvous ([Note: loopback rendezvous] in zerofit.cli.rendezvous) and the
test harness's (`zerofit.testing.distributed`).
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def listen_on_loopback(port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` (0: a port the OS picks). A port already taken raises
    the bind's OSError (errno EADDRINUSE), the socket closed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    return sock
