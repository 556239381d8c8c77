"""Capture the sysfs files the netdev and infiniband sources read into a fixture tree.

Usage (on the machine to capture, as a user that can read its /sys)::

    python tests/tools/capture_sysfs.py --out tests/fixtures/sysfs/<name>
    python tests/tools/capture_sysfs.py --out /tmp/node7 --interface 'ens*' --interface lo

sysfs attributes report a size of 4096 whatever they hold and are generated
on read, so ``shutil.copytree`` cannot copy them: each file is read whole and
written back as text, keeping its trailing newline. Files the kernel refuses
to read (``carrier`` and ``speed`` fail with EINVAL on an admin-down link;
an IB counter fails when the PMA query does) are left out of the tree and
listed, with their errno, in ``capture.txt`` at its root, because a fixture
file cannot reproduce a read error.

Only the attributes the sources use are copied: no MAC addresses, GIDs or
GUIDs end up in the repository.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

NETDEV_ATTRIBUTES = ("carrier", "carrier_changes", "operstate", "mtu", "speed")
NETDEV_DIRECTORIES = ("statistics",)
IB_PORT_ATTRIBUTES = ("state", "phys_state", "rate", "link_layer")
IB_PORT_DIRECTORIES = ("counters", "hw_counters")


def _matches(name: str, patterns: Sequence[str] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _entries(directory: Path) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return []


def _files_in(directory: Path) -> Iterator[Path]:
    for name in _entries(directory):
        if (directory / name).is_file():
            yield directory / name


def relevant_files(
    sysfs_root: Path, *, interfaces: Sequence[str] | None, ib_devices: Sequence[str] | None
) -> Iterator[Path]:
    """Every sysfs file the sources read, as absolute paths under ``sysfs_root``."""
    net = sysfs_root / "class" / "net"
    for name in _entries(net):
        entry = net / name
        if not entry.is_dir():
            yield entry  # plain files such as bonding_masters: the sources must skip them
            continue
        if not _matches(name, interfaces):
            continue
        yield from (entry / a for a in NETDEV_ATTRIBUTES if (entry / a).exists())
        for directory in NETDEV_DIRECTORIES:
            yield from _files_in(entry / directory)
    infiniband = sysfs_root / "class" / "infiniband"
    for device in _entries(infiniband):
        if not _matches(device, ib_devices):
            continue
        ports = infiniband / device / "ports"
        for port in _entries(ports):
            base = ports / port
            yield from (base / a for a in IB_PORT_ATTRIBUTES if (base / a).exists())
            for directory in IB_PORT_DIRECTORIES:
                yield from _files_in(base / directory)


def capture(
    sysfs_root: Path,
    out: Path,
    *,
    interfaces: Sequence[str] | None = None,
    ib_devices: Sequence[str] | None = None,
) -> list[str]:
    """Copy the relevant files into ``out``; return ``"<path> <ERRNO>"`` for those unreadable."""
    unreadable: list[str] = []
    for source in relevant_files(sysfs_root, interfaces=interfaces, ib_devices=ib_devices):
        relative = source.relative_to(sysfs_root)
        try:
            text = source.read_bytes().decode("ascii", errors="replace")
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            unreadable.append(f"{relative.as_posix()} {code}")
            continue
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="ascii")
    return unreadable


def _manifest(sysfs_root: Path, unreadable: Sequence[str]) -> str:
    lines = [
        f"# Captured by tests/tools/capture_sysfs.py from {sysfs_root}",
        f"# kernel: {os.uname().release}",
        f"# date: {datetime.now(UTC).strftime('%Y-%m-%d')}",
        "# unreadable (left out of the tree), path and errno:",
        *unreadable,
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    parser.add_argument("--out", type=Path, required=True, help="fixture tree to create")
    parser.add_argument("--interface", action="append", help="glob of interfaces to keep (repeatable)")
    parser.add_argument("--ib-device", action="append", help="glob of IB devices to keep (repeatable)")
    parser.add_argument("--force", action="store_true", help="write into an existing --out")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists; pass --force to write into it")
    unreadable = capture(args.sysfs_root, args.out, interfaces=args.interface, ib_devices=args.ib_device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capture.txt").write_text(_manifest(args.sysfs_root, unreadable), encoding="ascii")
    print(f"captured {args.sysfs_root} into {args.out}; {len(unreadable)} unreadable", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
