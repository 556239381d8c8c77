"""The real ethtool backend: the ``SIOCETHTOOL`` ioctl, as ``ethtool -S`` and ``ethtool -m`` use it.

No ``ethtool`` binary is needed. Each call fills one of the structs of
``include/uapi/linux/ethtool.h`` in a ctypes buffer and hands its address to the
kernel in ``struct ifreq.ifr_data``:

* ``ETHTOOL_GSSET_INFO`` (``struct ethtool_sset_info``: cmd, reserved, u64 sset_mask,
  u32 data[]) counts the ``ETH_SS_STATS`` strings;
* ``ETHTOOL_GSTRINGS`` (``struct ethtool_gstrings``: cmd, string_set, len, then
  ``len`` names of ``ETH_GSTRING_LEN`` = 32 NUL-padded bytes) names them;
* ``ETHTOOL_GSTATS`` (``struct ethtool_stats``: cmd, n_stats, u64 data[]) reads them;
* ``ETHTOOL_GMODULEINFO`` (``struct ethtool_modinfo``: cmd, type, eeprom_len,
  reserved[8]) and ``ETHTOOL_GMODULEEEPROM`` (``struct ethtool_eeprom``: cmd, magic,
  offset, len, data[]) read the plugged module's EEPROM.

The kernel sizes its answers to GSTRINGS and GSTATS by asking the driver again, not by
the count we pass in, so a driver whose stat count grows between two calls (channels
changed meanwhile) writes past a buffer sized exactly. Buffers therefore get generous
headroom, and a count that changed between calls is reported as ``EAGAIN``.

The ioctl API has no way to read CMIS pages beyond 00h (that needs the netlink
``ETHTOOL_MSG_MODULE_EEPROM_GET``): through it a QSFP-DD/OSFP module yields module
temperature and voltage at most, and mlx5 refuses CMIS modules outright (``EINVAL``,
with "cable type not recognized" in the kernel log on every call). After any "no
module" answer the interface is therefore not asked again for ``module_retry_s``,
which keeps an agent polling every second from filling the kernel log.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

from .optics import ModuleEeprom, ModuleStandard
from .sources._sysfs import read_sysfs_text
from .sources.netdev import parse_speed

__all__ = ["IoctlEthtool"]

_log = logging.getLogger(__name__)

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSTATS = 0x1D
ETHTOOL_GSSET_INFO = 0x37
ETHTOOL_GMODULEINFO = 0x42
ETHTOOL_GMODULEEEPROM = 0x43
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
_IFNAMSIZ = 16
_IFREQ_SIZE = 40
"""sizeof(struct ifreq) on 64-bit Linux; a 32-bit kernel reads the first 32 bytes."""
_MAX_EEPROM_BYTES = 64 * 1024

# Answers meaning "nothing to read here": the driver lacks the operation, the interface
# vanished after it was listed, or (module EEPROM) the cage is empty or the module
# does not answer. Anything else is an error the caller counts.
_NOT_SUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENODEV})
_NO_MODULE = _NOT_SUPPORTED | {errno.EIO, errno.ENXIO, errno.EINVAL, errno.EREMOTEIO, errno.ENOENT}


class IoctlEthtool:
    """Driver statistics and module EEPROMs of this machine's interfaces, read through ``SIOCETHTOOL``.

    Honours the `ridethrough.collector.sources.ethtool.EthtoolBackend` protocol.
    Not thread-safe: one source owns one instance.
    """

    def __init__(
        self,
        *,
        sysfs_root: str | Path = "/sys",
        physical_only: bool = True,
        module_retry_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Read interfaces listed under ``<sysfs_root>/class/net``.

        Args:
            sysfs_root: where sysfs is mounted; interfaces and link speeds come from it.
            physical_only: list only interfaces backed by a device (a ``device``
                link): NICs, not lo, bridges, veths or tunnels.
            module_retry_s: after an interface answered "no module", skip its module
                EEPROM for this long (a module plugged in meanwhile waits that long).
            clock: monotonic seconds, for ``module_retry_s``.
        """
        self._net = Path(sysfs_root) / "class" / "net"
        self._physical_only = physical_only
        self._module_retry_s = module_retry_s
        self._clock = clock
        self._socket: socket.socket | None = None
        self._quiet: set[tuple[str, str, int]] = set()
        self._no_module_until: dict[str, float] = {}

    def interfaces(self) -> list[str]:
        """Interface names, sorted.

        Raises:
            OSError: ``class/net`` cannot be listed.
        """
        names = sorted(os.listdir(self._net))
        if self._physical_only:
            return [n for n in names if (self._net / n / "device").exists()]
        return [n for n in names if (self._net / n).is_dir()]

    def stats(self, ifname: str) -> dict[str, int]:
        """``ethtool -S``: the driver's statistics by name, in the driver's order; empty if it has none.

        Raises:
            OSError: the ioctl failed for a reason other than "not supported"; ``EAGAIN``
                when the driver's stat count changed between calls (try again later).
        """
        try:
            count = self._stat_count(ifname)
            if count == 0:
                return {}
            names = self._stat_names(ifname, count)
            values = self._stat_values(ifname, count)
        except OSError as exc:
            if exc.errno in _NOT_SUPPORTED:
                self._once(ifname, "stats", exc)
                return {}
            raise
        return dict(zip(names, values, strict=True))

    def module_eeprom(self, ifname: str) -> ModuleEeprom | None:
        """``ethtool -m``: the plugged module's EEPROM; None when there is none to read.

        None covers a driver without module access, an empty cage and a module that
        does not answer; each is logged once per interface and reason, and the
        interface is not asked again for ``module_retry_s``.

        Raises:
            OSError: any other ioctl failure.
            ValueError: the driver reported an unknown module type or a silly length.
        """
        now = self._clock()
        if now < self._no_module_until.get(ifname, now):
            return None
        try:
            code, length = self._module_info(ifname)
            if not 0 < length <= _MAX_EEPROM_BYTES:
                raise ValueError(f"{ifname}: module EEPROM length {length}")
            data = self._module_bytes(ifname, length)
        except OSError as exc:
            if exc.errno in _NO_MODULE:
                self._once(ifname, "module EEPROM", exc)
                self._no_module_until[ifname] = now + self._module_retry_s
                return None
            raise
        self._no_module_until.pop(ifname, None)
        return ModuleEeprom(ModuleStandard.from_ethtool(code), data)

    def speed_mbps(self, ifname: str) -> int | None:
        """The link speed from sysfs, Mbit/s; None while unknown (link down, virtual NIC).

        Raises:
            OSError: other than ENOENT/EINVAL reading ``speed``.
            ValueError: ``speed`` holds garbage.
        """
        try:
            text = read_sysfs_text(self._net / ifname / "speed")
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINVAL):
                return None
            raise
        return parse_speed(text)

    def close(self) -> None:
        """Close the socket the ioctls go through (reopened on next use)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    # --- the ioctls ------------------------------------------------------------------------------

    def _ioctl(self, ifname: str, buffer: ctypes.Array[ctypes.c_char]) -> None:
        name = ifname.encode()
        if not 0 < len(name) < _IFNAMSIZ:
            raise OSError(errno.ENODEV, f"bad interface name {ifname!r}")
        if self._socket is None:
            # Any socket will do: SIOCETHTOOL goes to the device named in the ifreq.
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        ifreq = struct.pack(f"{_IFNAMSIZ}sP", name, ctypes.addressof(buffer)).ljust(_IFREQ_SIZE, b"\0")
        fcntl.ioctl(self._socket.fileno(), SIOCETHTOOL, ifreq)

    def _stat_count(self, ifname: str) -> int:
        buffer = ctypes.create_string_buffer(16 + 4)
        struct.pack_into("=IIQ", buffer, 0, ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS)
        self._ioctl(ifname, buffer)
        (mask,) = struct.unpack_from("=Q", buffer, 8)
        if not mask & (1 << ETH_SS_STATS):
            return 0  # the driver has no ETH_SS_STATS set (lo)
        return int(struct.unpack_from("=I", buffer, 16)[0])

    def _stat_names(self, ifname: str, count: int) -> list[str]:
        room = _with_headroom(count)
        buffer = ctypes.create_string_buffer(12 + room * ETH_GSTRING_LEN)
        struct.pack_into("=III", buffer, 0, ETHTOOL_GSTRINGS, ETH_SS_STATS, count)
        self._ioctl(ifname, buffer)
        _check_count(ifname, "GSTRINGS", int(struct.unpack_from("=I", buffer, 8)[0]), count, room)
        raw = buffer.raw[12:12 + count * ETH_GSTRING_LEN]
        return [_gstring(raw[i:i + ETH_GSTRING_LEN]) for i in range(0, len(raw), ETH_GSTRING_LEN)]

    def _stat_values(self, ifname: str, count: int) -> list[int]:
        room = _with_headroom(count)
        buffer = ctypes.create_string_buffer(8 + room * 8)
        struct.pack_into("=II", buffer, 0, ETHTOOL_GSTATS, count)
        self._ioctl(ifname, buffer)
        _check_count(ifname, "GSTATS", int(struct.unpack_from("=I", buffer, 4)[0]), count, room)
        return list(struct.unpack_from(f"={count}Q", buffer, 8))

    def _module_info(self, ifname: str) -> tuple[int, int]:
        buffer = ctypes.create_string_buffer(4 * 11)
        struct.pack_into("=I", buffer, 0, ETHTOOL_GMODULEINFO)
        self._ioctl(ifname, buffer)
        code, length = struct.unpack_from("=II", buffer, 4)
        return int(code), int(length)

    def _module_bytes(self, ifname: str, length: int) -> bytes:
        buffer = ctypes.create_string_buffer(16 + length)
        struct.pack_into("=IIII", buffer, 0, ETHTOOL_GMODULEEEPROM, 0, 0, length)
        self._ioctl(ifname, buffer)
        (got,) = struct.unpack_from("=I", buffer, 12)
        return buffer.raw[16:16 + min(int(got), length)]

    def _once(self, ifname: str, what: str, exc: OSError) -> None:
        key = (ifname, what, exc.errno or 0)
        if key not in self._quiet:
            self._quiet.add(key)
            _log.info("ethtool: %s: no %s (%s); skipping it quietly", ifname, what, exc.strerror or exc)


def _with_headroom(count: int) -> int:
    # See the module docstring: the kernel may answer for more entries than we asked.
    return 2 * count + 64


def _check_count(ifname: str, call: str, answered: int, asked: int, room: int) -> None:
    if answered > room:
        # Cannot happen with the headroom above unless a driver grew its stats more than
        # twofold between two syscalls; say so loudly rather than trust the buffer.
        raise OSError(errno.EOVERFLOW, f"{ifname}: {call} answered {answered} entries, room for {room}")
    if answered != asked:
        raise OSError(errno.EAGAIN, f"{ifname}: stat count changed from {asked} to {answered} during {call}")


def _gstring(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", errors="replace")
