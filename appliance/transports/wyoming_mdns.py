"""The Wyoming server's mDNS advertisement (``wyoming.zeroconf``): ``_wyoming._tcp.local.``, what
Home Assistant's Wyoming integration discovers, with the ``zeroconf`` package.

* A unique name: a name another box already advertises (two boxes of one image, both
  ``chattts-ubuntu``) is taken with a number added (zeroconf's name-conflict probe,
  ``allow_name_change``); the log and health (``mdns``, degraded) say which name it got, so both
  boxes stay discoverable and a person sees why one is called ``-2``.
* The address followed: a wildcard host (``0.0.0.0``) is advertised with the address of the
  interface that routes to the mDNS group, read again every :data:`RECHECK_S`; a new one
  (DHCP, another network) is announced at once.
* Failures named: no ``zeroconf`` package, or an advertisement that fails (no multicast, no
  interface), is the ``mdns`` condition with its reason (Home Assistant can still add the box by
  host and port); a failed one is tried again every :data:`RECHECK_S`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Any, Optional

from ..core import ConditionFlag

log = logging.getLogger("appliance.transports.wyoming_server")

MDNS_GROUP = "224.0.0.251"
SERVICE = "_wyoming._tcp.local."
RECHECK_S = 30.0
"""Seconds between two looks at the advertised address (and retries of a failed advertisement)."""


def route_ip() -> str:
    """This host's address on the interface that routes to the mDNS group (127.0.0.1 if none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((MDNS_GROUP, 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def warn_loopback(ip: str, port: int, host: str) -> bool:
    """Log a warning when the address to advertise is a loopback one (Home Assistant on another
    machine cannot reach it; the shipped ``config.local.yaml`` listens on ``127.0.0.1``), saying
    how to listen on the LAN. Returns True when it warned."""
    try:
        loopback = ipaddress.ip_address(ip).is_loopback
    except ValueError:
        loopback = ip == "localhost"
    if loopback:
        why = (f"wyoming.uris listens on {host}" if host not in ("0.0.0.0", "::", "")
               else "this host has no route to the LAN")
        log.warning("wyoming.zeroconf: advertising %s:%d, a loopback address (%s): Home Assistant on another "
                    "machine finds the box but cannot connect. Listen on the LAN: set wyoming.uris to "
                    "[\"tcp://0.0.0.0:%d\"] (every interface) or tcp://<this box's LAN address>:%d", ip, port, why,
                    port, port)
    return loopback


class Advertiser:
    """One mDNS advertisement, kept up (module docstring).

    Args:
        name: the wanted instance name. host, port: the tcp URI's. flag: the ``mdns`` condition.
    """

    def __init__(self, name: str, host: str, port: int, flag: ConditionFlag) -> None:
        self.want, self.host, self.port, self.flag = name, host, port, flag
        self.name: Optional[str] = None          # the name it got
        self.ip: Optional[str] = None
        self._zc: Any = None
        self._info: Any = None
        self._task: Optional[asyncio.Task] = None

    def _address(self) -> str:
        return self.host if self.host not in ("0.0.0.0", "::", "") else route_ip()

    async def start(self) -> None:
        """Advertise (never raises: a failure is the condition), then keep it up."""
        try:
            from zeroconf.asyncio import AsyncZeroconf  # noqa: F401
        except ImportError:
            self.flag.set("wyoming.zeroconf is on but the zeroconf package is not installed (pip install "
                          "zeroconf): Home Assistant does not discover the box; add it by host and port")
            log.warning("wyoming.zeroconf is on but the zeroconf package is not installed (pip install zeroconf); "
                        "add the box in Home Assistant by host and port instead")
            return
        await self._register()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="wyoming mdns")

    async def _register(self) -> None:
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        ip = self._address()
        warn_loopback(ip, self.port, self.host)
        info = AsyncServiceInfo(SERVICE, f"{self.want}.{SERVICE}", port=self.port,
                                addresses=[socket.inet_aton(ip)], properties={"program": "chattts-appliance"})
        try:
            zc = self._zc or AsyncZeroconf()
            self._zc = zc
            await zc.async_register_service(info, allow_name_change=True)
        except Exception as e:  # noqa: BLE001 - discovery is optional; the server runs anyway
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self.flag.set(f"cannot advertise {self.want} on {ip}:{self.port} over mDNS ({why}): Home Assistant "
                          f"does not discover the box (add it by host and port); retrying every {RECHECK_S:g} s")
            log.warning("wyoming.zeroconf: cannot advertise %s on %s:%d: %s", self.want, ip, self.port, why)
            return
        self._info, self.ip = info, ip
        self.name = info.name[: -len(SERVICE) - 1]
        if self.name != self.want:
            self.flag.set(f"the mDNS name {self.want} is taken by another device on the network: advertised as "
                          f"{self.name} (set wyoming.zeroconf_name to a name of its own)")
            log.warning("wyoming.zeroconf: %s is taken on this network; advertised as %s", self.want, self.name)
        else:
            self.flag.clear()
        log.info("wyoming: advertised as %s at %s:%d", info.name, ip, self.port)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_S)
            try:
                if self._info is None:
                    await self._register()
                    continue
                ip = self._address()
                if ip != self.ip:
                    log.info("wyoming.zeroconf: the address changed from %s to %s; announcing it", self.ip, ip)
                    self._info.addresses = [socket.inet_aton(ip)]
                    await self._zc.async_update_service(self._info)
                    self.ip = ip
            except Exception as e:  # noqa: BLE001 - the advertisement must never stop the server
                log.warning("wyoming.zeroconf: re-announcing failed: %s", e)

    async def stop(self) -> None:
        """Withdraw the advertisement."""
        if self._task is not None:
            self._task.cancel()
        if self._zc is not None:
            try:
                if self._info is not None:
                    await self._zc.async_unregister_service(self._info)
                await self._zc.async_close()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                log.warning("wyoming: zeroconf shutdown: %s", e)
            self._zc = None


__all__ = ["Advertiser", "route_ip", "warn_loopback", "MDNS_GROUP"]
