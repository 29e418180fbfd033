"""ICE options aiortc does not offer: which addresses become host candidates, and a UDP port range.

aioice (pinned to 0.13.0) gathers a host candidate on every interface address except 127.0.0.1 and binds each to a
port the OS picks. A gateway on one host (tests, a laptop) wants loopback; one in a container wants its ports in a
published range. Both are module-level behaviour of aioice, so they are changed for the whole process, and only
when configured: until :func:`configure_ice` is given a value, aioice runs unchanged, and the function it returns
puts back what was there before (a server stopping, or a test ending).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence

import aioice.ice
from aioice import turn
from aioice.candidate import Candidate, candidate_foundation, candidate_priority
from aiortc import RTCConfiguration, RTCIceServer

log = logging.getLogger(__name__)

_aioice_host_addresses = aioice.ice.get_host_addresses
_aioice_component_candidates = aioice.ice.Connection.get_component_candidates


class _IcePolicy:
    def __init__(self) -> None:
        self.host_addresses: tuple[str, ...] | None = None
        self.port_range: tuple[int, int] | None = None
        self.next_port_index = 0


_policy = _IcePolicy()


def configure_ice(host_addresses: Sequence[str] = (), udp_ports: tuple[int, int] | None = None) -> Callable[[], None]:
    """Use ``host_addresses`` as the only host candidates and bind ICE sockets in ``udp_ports`` (inclusive).

    Empty or None leaves that part as it is. Returns a function that restores the previous state. Raises
    ``ValueError`` for a bad address or range, before changing anything.
    """
    for address in host_addresses:
        ipaddress.ip_address(address)
    if udp_ports is not None and not 1 <= udp_ports[0] <= udp_ports[1] <= 65535:
        raise ValueError(f"bad UDP port range {udp_ports[0]}-{udp_ports[1]}")
    saved_functions = (aioice.ice.get_host_addresses, aioice.ice.Connection.get_component_candidates)
    saved_policy = (_policy.host_addresses, _policy.port_range)
    if host_addresses:
        _policy.host_addresses = tuple(host_addresses)
        aioice.ice.get_host_addresses = _configured_host_addresses
    if udp_ports is not None:
        _policy.port_range = udp_ports
        aioice.ice.Connection.get_component_candidates = _component_candidates_in_range  # type: ignore[method-assign]

    def restore() -> None:
        aioice.ice.get_host_addresses = saved_functions[0]
        aioice.ice.Connection.get_component_candidates = saved_functions[1]  # type: ignore[method-assign]
        _policy.host_addresses, _policy.port_range = saved_policy

    return restore


def rtc_configuration(stun_servers: Sequence[str]) -> RTCConfiguration:
    """Peer connection settings. An explicit empty server list: aiortc otherwise queries Google's STUN server,
    which costs up to 5 s per call where it is unreachable."""
    return RTCConfiguration(iceServers=[RTCIceServer(urls=url) for url in stun_servers])


def _configured_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    addresses = _policy.host_addresses
    if addresses is None:
        return _aioice_host_addresses(use_ipv4, use_ipv6)
    wanted = {4} if use_ipv4 and not use_ipv6 else {6} if use_ipv6 and not use_ipv4 else {4, 6}
    return [a for a in addresses if ipaddress.ip_address(a).version in wanted]


def _bind_in_range(address: str) -> socket.socket:
    """A UDP socket on ``address`` at the first free port of the range, starting after the last one handed out."""
    assert _policy.port_range is not None
    low, high = _policy.port_range
    count = high - low + 1
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    for step in range(count):
        index = (_policy.next_port_index + step) % count
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((address, low + index))
        except OSError:
            sock.close()
            continue
        _policy.next_port_index = (index + 1) % count
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, turn.UDP_SOCKET_BUFFER_SIZE)
        return sock
    raise OSError(f"no free UDP port in {low}-{high} on {address}")


async def _component_candidates_in_range(
    self: aioice.ice.Connection,
    component: int,
    addresses: list[str],
    timeout: int = 5,  # noqa: ASYNC109
) -> list[Candidate]:
    """aioice's candidate gathering with host sockets bound inside the port range.

    Host and server-reflexive candidates are gathered here, as aioice does; relayed (TURN) candidates still come
    from aioice itself, called with no host addresses.
    """
    if _policy.port_range is None:
        return await _aioice_component_candidates(self, component, addresses, timeout)
    loop = asyncio.get_running_loop()
    candidates: list[Candidate] = []
    protocols: list[aioice.ice.StunProtocol] = []
    for address in addresses:
        try:
            sock = _bind_in_range(address)
        except OSError as exc:
            log.warning("ICE host candidate on %s skipped: %s", address, exc)
            continue
        _, protocol = await loop.create_datagram_endpoint(lambda: aioice.ice.StunProtocol(self), sock=sock)
        host, port = sock.getsockname()[:2]
        protocol.local_candidate = Candidate(
            foundation=candidate_foundation("host", "udp", host),
            component=component,
            transport="udp",
            priority=candidate_priority(component, "host"),
            host=host,
            port=port,
            type="host",
        )
        candidates.append(protocol.local_candidate)
        protocols.append(protocol)
    self._protocols += protocols
    if self.stun_server is not None:
        stun_server = self.stun_server
        queries = [
            asyncio.create_task(aioice.ice.server_reflexive_candidate(protocol, stun_server))
            for protocol in protocols
            if ipaddress.ip_address(protocol.local_candidate.host).version == 4
        ]
        if queries:
            done, pending = await asyncio.wait(queries, timeout=timeout)
            for task in pending:
                task.cancel()
            candidates += [task.result()[0] for task in done if task.exception() is None]
    candidates += await _aioice_component_candidates(self, component, [], timeout)
    return candidates
