"""The rendezvous `zerofit launch` uses on one machine: a store that listens on loopback only.

[Note: loopback rendezvous]
torchrun's built-in rendezvous backends start a TCPStore server, which listens on every interface
whatever host name it is given (torch's TCPStore has no bind-address setting), and that store
accepts and executes requests from anyone who can reach the port. On one machine nothing outside
needs to reach it, so this backend hands the TCPStore a socket it bound to 127.0.0.1 itself (the
documented `master_listen_fd` argument): the server can then only be reached through loopback.

It also starts a new store, on a new OS-chosen port, for every restart of the worker group, so a
restarted attempt never reads keys the failed attempt left behind (see `zerofit.distributed.process_group`).
The backend is registered under `BACKEND` through torch's public rendezvous handler registry.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from zerofit.distributed.loopback import LOOPBACK
from zerofit.distributed.loopback import listen_on_loopback as _listen

BACKEND = "zerofit-loopback"
_STORE_TIMEOUT = timedelta(seconds=600)
"""How long a worker may take to reach the store (the same bound torchrun's static rendezvous uses)."""


class PortInUse(RendezvousError):
    """The rendezvous port is taken; the message names it and the option that moves it."""


def listen_on_loopback(port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` (0: a port the OS picks); PortInUse where it is taken."""
    try:
        return _listen(port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise PortInUse(f"port {port} on {LOOPBACK} is already in use (another run, or another program, listens "
                        "there): pass another with --main_process_port PORT (launch.main_process_port), or leave "
                        "it unset and zerofit picks a free one") from e


class LoopbackRendezvous(RendezvousHandler):
    """One machine's rendezvous through a TCPStore bound to 127.0.0.1, a new one per attempt."""

    def __init__(self, port: int, run_id: str):
        self.first_port = port
        self.run_id = run_id
        # Every store keeps its socket: the server reads the file descriptor, so it must stay open for as
        # long as torchrun may still hold that store (until the next attempt replaces it, or the end).
        self._stores: list[tuple[TCPStore, socket.socket]] = []

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers reach the store at MASTER_ADDR:MASTER_PORT as clients

    def next_rendezvous(self) -> RendezvousInfo:
        sock = listen_on_loopback(0 if self._stores else self.first_port)
        port = sock.getsockname()[1]
        store = TCPStore(LOOPBACK, port, 1, True, _STORE_TIMEOUT, multi_tenant=True,
                         master_listen_fd=sock.fileno())
        self._stores.append((store, sock))
        return RendezvousInfo(PrefixStore(self.run_id, store), 0, 1, RendezvousStoreInfo(LOOPBACK, port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0  # one machine: nobody else can join

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    _, port = parse_rendezvous_endpoint(params.endpoint, -1)
    if port < 0:
        raise ValueError(f"{BACKEND} rendezvous needs a port in its endpoint (got {params.endpoint!r})")
    return LoopbackRendezvous(port, params.run_id)


def register() -> None:
    """Make `--rdzv-backend zerofit-loopback` known to torchrun in this process (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
