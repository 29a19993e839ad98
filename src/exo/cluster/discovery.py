"""Zero-configuration discovery: each daemon advertises ``_exo._tcp.local.`` over mDNS/DNS-SD and browses
for the others.

TXT records: ``node_id``, ``grpc_port``, ``api_port``, ``version``, ``namespace`` (never a secret).
Only adverts of our own cluster namespace are reported. Our own service is recognised by its instance
name, not by node id, so that two nodes sharing an id (a copied home directory) still see each other and
the duplicate can be detected. Discovery only says who is out there; liveness is the registry's business
(an advert of a crashed node lingers until its records expire).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import ifaddr
from zeroconf import (
    InterfacesType,
    IPVersion,
    NonUniqueNameException,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_exo._tcp.local."

# RFC 6762 suggests 75 minutes for records without a host name (PTR, TXT); a node that vanishes without
# a goodbye would linger that long in every peer's cache. Two minutes for everything bounds that, at
# the cost of a re-query every ~100 s per peer.
_TTL_S = 120
_RESOLVE_TIMEOUT_MS = 3000
_REGISTER_ATTEMPTS = 3
_TXT_FIELDS = ("node_id", "grpc_port", "api_port", "version", "namespace")


class DiscoveryError(RuntimeError):
    """Discovery could not start (no usable interface, mDNS port unavailable, registration refused...)."""


@dataclass(frozen=True)
class Advert:
    """One peer's advertised service, resolved to an address we can dial."""

    node_id: str
    host: str
    grpc_port: int
    api_port: int
    version: str
    namespace: str


class Discovery:
    """Advertises this node over mDNS/DNS-SD and reports peers of the same namespace.

    ``on_found(advert)`` runs when a peer's service appears or its advert changes (an unchanged refresh is
    not reported again); ``on_lost(node_id)`` when the last service advertising that node id goes away
    (a goodbye packet or record expiry). Both run on the event loop thread that called ``start()``;
    exceptions they raise are logged and swallowed.

    ``interfaces``: zeroconf's choice (a list of local IP addresses, or an ``InterfaceChoice``) of where to
    run mDNS; the IPv4 addresses in a list are also the addresses advertised (a daemon bound to one
    address passes ``[host]``; a wildcard such as ``0.0.0.0`` means every interface). None: every
    interface, advertising each non-loopback IPv4 address of the host.
    """

    def __init__(
        self,
        *,
        node_id: str,
        namespace: str,
        grpc_port: int,
        api_port: int,
        version: str,
        on_found: Callable[[Advert], None],
        on_lost: Callable[[str], None],
        interfaces: InterfacesType | None = None,
    ) -> None:
        self._node_id = node_id
        self._namespace = namespace
        self._grpc_port = grpc_port
        self._api_port = api_port
        self._version = version
        self._on_found = on_found
        self._on_lost = on_lost
        self._interfaces = _specific_interfaces(interfaces)
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: ServiceInfo | None = None
        # Every instance name this process registered (current and replaced): never reported as peers.
        self._own_names: set[str] = set()
        self._reported: dict[str, Advert] = {}  # instance name (lower case) -> last advert reported
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    @property
    def service_name(self) -> str | None:
        """Our registered instance name (``exo-<id prefix>-<random>._exo._tcp.local.``), once started."""
        return self._info.name if self._info is not None else None

    def peers(self) -> list[Advert]:
        """Adverts currently known (same namespace, not ourselves): lets a registry re-probe a peer it
        dropped for silence while its advert is still alive."""
        return list(self._reported.values())

    async def start(self) -> None:
        """Register our service and start browsing. Raises DiscoveryError when that is impossible."""
        if self._aiozc is not None or self._closed:
            raise DiscoveryError("Discovery.start() called twice or after close()")
        try:
            if self._interfaces is None:
                self._aiozc = AsyncZeroconf(ip_version=IPVersion.V4Only)
            else:
                self._aiozc = AsyncZeroconf(interfaces=self._interfaces)
            self._info = await self._register(self._node_id)
            self._browser = AsyncServiceBrowser(
                self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_service_state_change]
            )
        except Exception as e:
            await self._shutdown()
            raise DiscoveryError(f"mDNS discovery failed to start: {type(e).__name__}: {e}") from e
        log.info(
            "advertising %s (node %s, namespace %r) at %s",
            self._info.name,
            self._node_id,
            self._namespace,
            ", ".join(self._info.parsed_addresses()),
        )

    async def update_node_id(self, node_id: str) -> None:
        """Advertise a new node id (after a duplicate-id regeneration): the new service is registered
        first, then the old one is withdrawn with a goodbye."""
        if self._aiozc is None or self._closed:
            self._node_id = node_id
            return
        old = self._info
        try:
            self._info = await self._register(node_id)
        except Exception as e:
            raise DiscoveryError(f"could not re-register under node id {node_id}: {e}") from e
        self._node_id = node_id
        if old is not None:
            await (await self._aiozc.async_unregister_service(old))
        log.info("now advertising %s (node %s)", self._info.name, node_id)

    async def close(self) -> None:
        """Withdraw our service (goodbye packets) and stop browsing. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        await self._shutdown()

    # -- internals -------------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        for task in self._resolving.values():
            task.cancel()
        if self._resolving:
            await asyncio.gather(*self._resolving.values(), return_exceptions=True)
        self._resolving.clear()
        aiozc, self._aiozc = self._aiozc, None
        browser, self._browser = self._browser, None
        if aiozc is None:
            return
        try:
            if browser is not None:
                await browser.async_cancel()
            # async_close() sends the goodbyes for every registered service before closing the sockets.
            await aiozc.async_close()
        except Exception:
            log.warning("error while shutting down zeroconf", exc_info=True)

    def _new_info(self, node_id: str) -> ServiceInfo:
        # A random suffix makes the name unique per process: several daemons per host, or two nodes
        # with the same (copied) id, never collide.
        instance = f"exo-{node_id[:12]}-{secrets.token_hex(4)}"
        return ServiceInfo(
            SERVICE_TYPE,
            f"{instance}.{SERVICE_TYPE}",
            port=self._grpc_port,
            properties={
                "node_id": node_id,
                "grpc_port": str(self._grpc_port),
                "api_port": str(self._api_port),
                "version": self._version,
                "namespace": self._namespace,
            },
            server=f"{instance}.local.",
            parsed_addresses=_advertised_addresses(self._interfaces),
            host_ttl=_TTL_S,
            other_ttl=_TTL_S,
        )

    async def _register(self, node_id: str) -> ServiceInfo:
        assert self._aiozc is not None
        for attempt in range(_REGISTER_ATTEMPTS):
            info = self._new_info(node_id)
            self._own_names.add(info.name.lower())
            try:
                # The outer await probes the name; the inner one waits for the announcements to be sent.
                await (await self._aiozc.async_register_service(info))
                return info
            except NonUniqueNameException:
                log.warning("service name %s already taken (attempt %d)", info.name, attempt + 1)
        raise DiscoveryError(f"no unique service name after {_REGISTER_ATTEMPTS} attempts")

    def _on_service_state_change(
        self,
        zeroconf: Zeroconf,  # the keyword names are zeroconf's handler protocol
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        key = name.lower()
        if key in self._own_names or self._closed:
            return
        pending = self._resolving.pop(key, None)
        if pending is not None:
            pending.cancel()
        if state_change is ServiceStateChange.Removed:
            self._forget(key)
            return
        # Resolving (SRV/TXT/A) may need a network round trip: do it in a task, one per service.
        self._resolving[key] = asyncio.get_running_loop().create_task(
            self._resolve(zeroconf, service_type, name, key)
        )

    async def _resolve(self, zc: Zeroconf, service_type: str, name: str, key: str) -> None:
        try:
            await self._resolve_and_report(zc, service_type, name, key)
        except Exception:
            log.warning("resolving %s failed", name, exc_info=True)
        finally:
            if self._resolving.get(key) is asyncio.current_task():
                del self._resolving[key]

    async def _resolve_and_report(self, zc: Zeroconf, service_type: str, name: str, key: str) -> None:
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(zc, _RESOLVE_TIMEOUT_MS):
            log.debug("%s did not resolve within %d ms", name, _RESOLVE_TIMEOUT_MS)
            return
        advert = _parse_advert(info)
        if advert is None:
            return
        if advert.namespace != self._namespace:
            log.debug(
                "ignoring %s of namespace %r (ours: %r)", name, advert.namespace, self._namespace
            )
            self._forget(key)  # it may have moved out of our namespace
            return
        previous = self._reported.get(key)
        if previous == advert:
            return
        self._reported[key] = advert
        if previous is not None and previous.node_id != advert.node_id:
            self._report_gone(previous.node_id)
        self._call(self._on_found, advert)

    def _forget(self, key: str) -> None:
        advert = self._reported.pop(key, None)
        if advert is not None:
            self._report_gone(advert.node_id)

    def _report_gone(self, node_id: str) -> None:
        survivors = [a for a in self._reported.values() if a.node_id == node_id]
        if survivors:
            # Another service still advertises this id (duplicate ids): point the caller at it instead.
            self._call(self._on_found, survivors[-1])
        else:
            self._call(self._on_lost, node_id)

    def _call(self, callback: Callable[..., None], arg: object) -> None:
        try:
            callback(arg)
        except Exception:
            log.exception("%s(%r) raised", getattr(callback, "__name__", "callback"), arg)


def _parse_advert(info: ServiceInfo) -> Advert | None:
    props = info.decoded_properties
    missing = [f for f in _TXT_FIELDS if not props.get(f)]
    if missing:
        log.debug("%s lacks TXT %s", info.name, ", ".join(missing))
        return None
    try:
        grpc_port, api_port = int(props["grpc_port"] or ""), int(props["api_port"] or "")
    except ValueError:
        log.debug("%s has non-numeric ports in TXT", info.name)
        return None
    host = _pick_address(info.parsed_addresses(IPVersion.V4Only)) or _pick_address(
        info.parsed_scoped_addresses(IPVersion.V6Only)
    )
    if host is None:
        log.debug("%s has no address", info.name)
        return None
    return Advert(
        node_id=props["node_id"] or "",
        host=host,
        grpc_port=grpc_port,
        api_port=api_port,
        version=props["version"] or "",
        namespace=props["namespace"] or "",
    )


def _pick_address(addresses: list[str]) -> str | None:
    """The first advertised address on one of our own subnets (reachable without a router), else the
    first non-loopback one, else the first."""
    if not addresses:
        return None
    networks = _local_networks()
    for addr in addresses:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
        if not ip.is_loopback and any(ip in net for net in networks):
            return addr
    for addr in addresses:
        if not ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback:
            return addr
    return addresses[0]


def _local_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            addr = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            nets.append(ipaddress.ip_network(f"{addr}/{ip.network_prefix}", strict=False))
    return nets


def _specific_interfaces(interfaces: InterfacesType | None) -> InterfacesType | None:
    """None (every interface) for a list holding a wildcard address: a daemon bound to 0.0.0.0 may pass
    its bind address as is."""
    if isinstance(interfaces, list | tuple) and any(i in ("0.0.0.0", "::", "") for i in interfaces):
        return None
    if isinstance(interfaces, tuple):
        return list(interfaces)  # zeroconf accepts lists only
    return interfaces


def _advertised_addresses(interfaces: InterfacesType | None) -> list[str]:
    """The IPv4 addresses peers should dial: the given interface addresses, else every non-loopback IPv4
    address of this host (loopback only when there is nothing else: a lone development machine)."""
    if isinstance(interfaces, list | tuple):
        chosen = [i for i in interfaces if isinstance(i, str) and ipaddress.ip_address(i).version == 4]
        if chosen:
            return chosen
    all_v4 = sorted(
        {ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)}
    )
    routable = [a for a in all_v4 if not ipaddress.ip_address(a).is_loopback]
    return routable or all_v4 or ["127.0.0.1"]
