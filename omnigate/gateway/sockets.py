"""The listening socket, bound by the gateway itself so that every accepted connection gets bounded buffers."""

from __future__ import annotations

import socket


def bind_listener(host: str, port: int, send_buffer_bytes: int | None, *, reuse_port: bool = False) -> socket.socket:
    """Bind a TCP listener. Accepted sockets inherit ``SO_SNDBUF`` from it (Linux), which turns off send-buffer
    autotuning: otherwise the kernel may queue megabytes (minutes of audio) for a client that stopped reading, and
    the session would see backpressure only after all of it was generated. ``reuse_port``: several gateway
    processes bind the same port and the kernel spreads connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
