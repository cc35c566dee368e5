"""The port tmod-serve answers on, bound one way everywhere: the start-up check (server/cli.py), the
socket that holds the port for `--engines N` and the workers' listener (server/workers/processes.py)."""
from __future__ import annotations

import socket


def bind_port(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to host:port, not listening. IPv6 for a host with a colon (`::`, `::1`), as
    uvicorn decides for one process. SO_REUSEADDR as every server binds: the connections a stopped server
    closed wait in TIME_WAIT on the port for a minute and would refuse a restart. `reuse_port`: several
    engines listen on the one port (the kernel spreads connections over them)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def address(host: str, port: int) -> str:
    """host:port as clients and gRPC write it: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_url(host: str, port: int) -> str:
    return f"http://{address(host, port)}"
