"""The job socket at the edge of the machine: bind it safely, learn who sent, remove it at stop.

A Unix datagram socket with ``SO_PASSCRED``: the kernel attaches each sender's pid, uid and gid
(``SCM_CREDENTIALS``), translated into the agent's pid namespace, so who sent a message never
depends on what the message claims.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path

DEFAULT_SOCKET_MODE = 0o660
"""Permissions of the socket file: the agent's user and group may send. Trainers running as other
users need the group (or a ``socket_mode`` of 0o666, which lets any local user report steps)."""
_MAX_SOCKET_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_UCRED = struct.Struct("iII")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
ANCILLARY_BYTES = socket.CMSG_SPACE(_UCRED.size)
"""Room `recvmsg` needs for the credentials."""


def bind_job_socket(path: Path, mode: int = DEFAULT_SOCKET_MODE) -> socket.socket:
    """A non-blocking datagram socket bound at ``path`` that learns each sender's credentials.

    Creates the parent directory and replaces a stale socket file (one nobody is bound to).

    Raises:
        FileExistsError: something other than a socket is at ``path``; it is left alone.
        OSError: another process serves ``path``, or the path is too long for a Unix socket.
    """
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH_BYTES:
        raise OSError(f"job socket path {str(path)!r} is longer than {_MAX_SOCKET_PATH_BYTES} bytes")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(os.fspath(path))
        # bind applies the umask; set the documented mode (the window between is read-only for others)
        os.chmod(path, mode)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def remove_stale(path: Path) -> None:
    """Remove a socket file nobody is bound to (left over from a crash); refuse anything else at ``path``.

    Raises:
        FileExistsError: ``path`` is not a socket.
        OSError: a process serves ``path``.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(f"job socket path {str(path)!r} exists and is not a socket; refusing to replace it "
                              "(remove it, or point agent.job_socket elsewhere)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except ConnectionRefusedError:  # a socket file nobody is bound to: left over from a crash
            os.unlink(path)
            return
        except OSError as exc:  # e.g. a stream socket someone listens on (EPROTOTYPE)
            raise OSError(f"job socket {str(path)!r} is in use by another process: {exc}") from exc
    raise OSError(f"job socket {str(path)!r} is in use by another process (another agent?)")


def credentials(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, int]:
    """The sender's (pid, uid) from ``recvmsg`` ancillary data; (0, 0) when there is none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid, uid, _gid = _UCRED.unpack_from(data)
            return pid, uid
    return 0, 0


def file_id(path: Path) -> tuple[int, int]:
    """(device, inode) of the file at ``path`` itself (a link is not followed)."""
    info = os.lstat(path)
    return info.st_dev, info.st_ino


def unlink_if_ours(path: Path, ours: tuple[int, int]) -> None:
    """Remove ``path`` if it is still the file `file_id` saw when we bound it (another agent may own it now)."""
    try:
        if file_id(path) == ours:
            os.unlink(path)
    except FileNotFoundError:
        pass
