"""Capture what the ethtool source reads (driver stats, module EEPROM, link speed) into a fixture folder.

Usage (on the machine to capture, as root, with ridethrough installed: it reads through
the agent's own ioctl backend, so the fixture holds exactly what the agent would see)::

    python tests/tools/capture_ethtool.py --out tests/fixtures/ethtool/<name>
    python tests/tools/capture_ethtool.py --out /tmp/node7 --interface 'ens*' --interface 'eth*'

The folder gets one sub-folder per interface, the layout
``ridethrough.collector.sources.ethtool.DirectoryEthtool`` replays:

* ``stats.txt``: the driver statistics in ``ethtool -S`` text format;
* ``speed``: ``/sys/class/net/<if>/speed`` as the kernel printed it;
* ``eeprom.bin`` and ``eeprom_type``: the module EEPROM as ``ETHTOOL_GMODULEEEPROM``
  returned it, and the standard ``ETHTOOL_GMODULEINFO`` reported (``sff8636``, ...).

Module serial numbers are overwritten with spaces unless ``--keep-serials`` is given,
so no asset identifiers end up in the repository (the EEPROM's checksum bytes are left
as they were; nothing here checks them). What could not be read, and why, is listed in
``capture.txt`` at the folder's root, with the kernel, the date and each interface's driver.
Physical interfaces only, unless ``--all-interfaces``.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from ridethrough.collector.ethtool_ioctl import IoctlEthtool
from ridethrough.collector.optics import ModuleEeprom, ModuleStandard

# Where each layout keeps the vendor serial number (16 ASCII bytes).
_SERIAL_OFFSETS = {
    ModuleStandard.SFF_8079: 68,  # A0h bytes 68-83
    ModuleStandard.SFF_8472: 68,
    ModuleStandard.SFF_8636: 196,  # upper page 00h bytes 196-211
    ModuleStandard.SFF_8436: 196,
    ModuleStandard.CMIS: 166,  # upper page 00h bytes 166-181
}
_CMIS_IDS = frozenset({0x18, 0x19, 0x1B, 0x1E, 0x1F, 0x20})
_SERIAL_LEN = 16


def blank_serial(eeprom: ModuleEeprom) -> bytes:
    """The EEPROM image with the vendor serial number replaced by spaces."""
    data = bytearray(eeprom.data)
    standard = eeprom.standard
    if data and data[0] in _CMIS_IDS:
        standard = ModuleStandard.CMIS  # drivers report CMIS modules as SFF-8636
    start = _SERIAL_OFFSETS[standard]
    if len(data) >= start + _SERIAL_LEN:
        data[start:start + _SERIAL_LEN] = b" " * _SERIAL_LEN
    return bytes(data)


def format_stats(stats: dict[str, int]) -> str:
    """``ethtool -S`` text for ``stats``, in the driver's order."""
    return "NIC statistics:\n" + "".join(f"     {name}: {value}\n" for name, value in stats.items())


def _driver(net: Path, ifname: str) -> str:
    link = net / ifname / "device" / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else "-"


def _why(exc: Exception) -> str:
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, str(exc)) if isinstance(code, int) else str(exc)


def capture_interface(backend: IoctlEthtool, ifname: str, out: Path, *, keep_serials: bool) -> list[str]:
    """Write one interface's files under ``out/<ifname>``; return notes on what was missing."""
    folder = out / ifname
    folder.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    try:
        stats = backend.stats(ifname)
        if stats:
            (folder / "stats.txt").write_text(format_stats(stats), encoding="ascii")
        else:
            notes.append(f"{ifname} stats: none")
    except OSError as exc:
        notes.append(f"{ifname} stats: {_why(exc)}")
    try:
        eeprom = backend.module_eeprom(ifname)
        if eeprom is None:
            notes.append(f"{ifname} module EEPROM: none readable")
        else:
            data = eeprom.data if keep_serials else blank_serial(eeprom)
            (folder / "eeprom.bin").write_bytes(data)
            (folder / "eeprom_type").write_text(eeprom.standard.value + "\n", encoding="ascii")
    except (OSError, ValueError) as exc:
        notes.append(f"{ifname} module EEPROM: {_why(exc)}")
    return notes


def _manifest(net: Path, interfaces: Sequence[str], notes: Sequence[str]) -> str:
    lines = [
        "# Captured by tests/tools/capture_ethtool.py",
        f"# kernel: {os.uname().release}",
        f"# date: {datetime.now(UTC).strftime('%Y-%m-%d')}",
        "# interfaces and drivers:",
        *(f"{name} {_driver(net, name)}" for name in interfaces),
        "# not captured, and why:",
        *notes,
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    parser.add_argument("--out", type=Path, required=True, help="fixture folder to create")
    parser.add_argument("--interface", action="append", help="glob of interfaces to keep (repeatable)")
    parser.add_argument("--all-interfaces", action="store_true", help="also virtual ones (lo, bridges, veths)")
    parser.add_argument("--keep-serials", action="store_true", help="keep module serial numbers")
    parser.add_argument("--force", action="store_true", help="write into an existing --out")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists; pass --force to write into it")
    backend = IoctlEthtool(sysfs_root=args.sysfs_root, physical_only=not args.all_interfaces)
    net = args.sysfs_root / "class" / "net"
    names = [n for n in backend.interfaces()
             if args.interface is None or any(fnmatch.fnmatchcase(n, p) for p in args.interface)]
    notes: list[str] = []
    for name in names:
        notes += capture_interface(backend, name, args.out, keep_serials=args.keep_serials)
        speed = net / name / "speed"
        try:
            (args.out / name / "speed").write_bytes(speed.read_bytes())
        except OSError as exc:
            notes.append(f"{name} speed: {_why(exc)}")
    backend.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capture.txt").write_text(_manifest(net, names, notes), encoding="ascii")
    print(f"captured {len(names)} interface(s) into {args.out}; {len(notes)} note(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
