"""Where a group's ranks meet: a TCPStore hosted in rank 0's process, on a port bound when its
address is handed out.

Picking a free port and binding it later leaves a window in which another process can take it:
an in-process vLLM engine choosing its own port while the controllers build their engines, or
another run on the node. The late rank 0 then fails to bind, and the other ranks wait in the
rendezvous until they time out. So rank 0's process binds the store first (`host`: the OS picks
the port) and hands out that address. The group that rank 0 builds there later takes the same
store (`store`), and every other rank connects to it.

A library that meets through ``env://`` itself (a tensor-parallel vLLM engine's group) takes a
server bound the same way: torch opens an ``env://`` store multi-tenant, and a multi-tenant
store finds the server this process already holds on that port (`host(..., library=True)`).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

__all__ = ["host", "store"]

_hosted: dict[int, Any] = {}  # port → the TCPStore server this process bound there, not yet taken
_kept: list[Any] = []  # servers bound for a library's env:// rendezvous, held for the process's life
_lock = threading.Lock()  # a Ray actor serves calls on several threads


def host(ip: str | None = None, *, timeout_s: float = 600.0, library: bool = False
         ) -> tuple[str, int]:
    """Bind a TCPStore server in this process on a port the OS picks. Returns this node's IP
    (Ray's node address unless ``ip`` is given) and the port. The caller is rank 0 of the group
    that will meet there: its `store(addr, port, 0, …)` takes this server.

    ``library``: the group is a library's, which meets through ``env://`` (MASTER_ADDR and
    MASTER_PORT) in this process; the server is multi-tenant, so the store torch opens there
    shares it, and it is held for the process's life rather than handed to `store`."""
    import torch.distributed as dist

    if ip is None:
        import ray

        ip = ray.util.get_node_ip_address()
    server = dist.TCPStore(ip, 0, None, True, timeout=timedelta(seconds=timeout_s),
                           wait_for_workers=False, multi_tenant=library)
    with _lock:
        if library:
            _kept.append(server)
        else:
            _hosted[server.port] = server
    return ip, server.port


def store(addr: str, port: int, rank: int, world: int, *, timeout_s: float = 600.0) -> Any:
    """The group's store: rank 0 takes the server it bound with `host` (or binds ``port`` now,
    for a caller that chose the port itself); every other rank connects to ``addr:port``."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        with _lock:
            server = _hosted.pop(port, None)
        if server is not None:
            server.set_timeout(timeout)
            return server
    return dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
