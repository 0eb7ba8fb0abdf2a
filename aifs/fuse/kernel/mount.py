"""Mount and unmount a FUSE filesystem without libfuse.

As root: open ``/dev/fuse`` and call ``mount(2)`` with the fd in the data
string. Otherwise ``fusermount3`` mounts and passes the fd back over a Unix
socket named by ``_FUSE_COMMFD`` (SCM_RIGHTS), as libfuse does.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import logging
import os
import re
import socket
import stat
import subprocess

from aifs.errors import ConfigError

log = logging.getLogger(__name__)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_SYNCHRONOUS, MS_DIRSYNC, MS_NOATIME, MS_NODIRATIME = 16, 128, 1024, 2048
MNT_DETACH = 2

# generic mount options and their flags (mount(8)); "x" clears the flag
FLAG_OPTIONS = {
    "ro": MS_RDONLY, "rw": -MS_RDONLY, "nosuid": MS_NOSUID, "suid": -MS_NOSUID,
    "nodev": MS_NODEV, "dev": -MS_NODEV, "noexec": MS_NOEXEC, "exec": -MS_NOEXEC,
    "sync": MS_SYNCHRONOUS, "async": -MS_SYNCHRONOUS, "dirsync": MS_DIRSYNC,
    "noatime": MS_NOATIME, "atime": -MS_NOATIME, "nodiratime": MS_NODIRATIME,
    "relatime": 0, "strictatime": 0,
}
# options the fuse kernel module takes in the data string
KERNEL_OPTIONS = ("allow_other", "default_permissions", "max_read", "blksize")
# libfuse options that name the mount, not the kernel's business
NAME_OPTIONS = ("fsname", "subtype")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _split(options: set[str]) -> tuple[int, list[str], dict[str, str]]:
    """Mount flags, the kernel's data options, and the naming options."""
    flags = MS_NOSUID | MS_NODEV
    data: list[str] = []
    names: dict[str, str] = {}
    for option in sorted(options):
        key, _, value = option.partition("=")
        if key in FLAG_OPTIONS:
            bit = FLAG_OPTIONS[key]
            flags = flags | bit if bit >= 0 else flags & ~-bit
        elif key in KERNEL_OPTIONS:
            data.append(option)
        elif key in NAME_OPTIONS:
            names[key] = value
        else:
            raise ConfigError(f"unknown mount option {option!r}")
    return flags, data, names


def mount(mountpoint: str, options: set[str]) -> int:
    """Mount on ``mountpoint``; return the open ``/dev/fuse`` fd of the session."""
    flags, data, names = _split(options)
    subtype = names.get("subtype", "aifs")
    source = names.get("fsname", subtype)
    if os.geteuid() != 0:
        return _mount_with_fusermount(mountpoint, options)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    st = os.stat(mountpoint)
    data = [f"fd={fd}", f"rootmode={stat.S_IFMT(st.st_mode):o}",
            f"user_id={os.getuid()}", f"group_id={os.getgid()}", *data]
    result = _libc.mount(source.encode(), mountpoint.encode(), f"fuse.{subtype}".encode(),
                         flags, ",".join(data).encode())
    if result != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise ConfigError(f"cannot mount on {mountpoint}: {os.strerror(err)}")
    return fd


def _mount_with_fusermount(mountpoint: str, options: set[str]) -> int:
    theirs, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        result = subprocess.run(["fusermount3", "-o", ",".join(sorted(options)), "--",
                                 mountpoint], env=env, pass_fds=(theirs.fileno(),),
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise ConfigError(f"cannot mount on {mountpoint}: "
                              f"{result.stderr.strip() or 'fusermount3 failed'}")
        fds = array.array("i")
        _, ancillary, _, _ = ours.recvmsg(1, socket.CMSG_LEN(fds.itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:fds.itemsize])
        if not fds:
            raise ConfigError(f"cannot mount on {mountpoint}: fusermount3 passed no fd")
        return fds[0]
    finally:
        theirs.close()
        ours.close()


def unmount(mountpoint: str) -> None:
    """Detach the mount (lazily, as libfuse does: open files keep it until closed)."""
    if os.geteuid() == 0:
        if _libc.umount2(mountpoint.encode(), MNT_DETACH) == 0:
            return
        err = ctypes.get_errno()
        if err == 22:  # EINVAL: not mounted (any more)
            return
        log.warning("umount2 %s: %s", mountpoint, os.strerror(err))
    subprocess.run(["fusermount3", "-u", "-z", "-q", mountpoint], capture_output=True)


def connection_id(mountpoint: str) -> int | None:
    """The FUSE connection's number (``/sys/fs/fuse/connections/N``) of the
    mount at ``mountpoint``, from /proc/self/mountinfo (no request to the
    filesystem); None if it is not found."""
    # (realpath of the mount itself would stat it: a request this very
    # daemon must answer; its parent directory is not on the mount)
    absolute = os.path.abspath(mountpoint)
    wanted = os.path.join(os.path.realpath(os.path.dirname(absolute)),
                          os.path.basename(absolute))
    found = None
    try:
        with open("/proc/self/mountinfo") as info:
            for line in info:
                fields = line.split()
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
                if point == wanted and " - fuse" in line:
                    found = int(fields[2].split(":")[1])  # the last mount there wins
    except (OSError, ValueError, IndexError):
        return None
    return found


def abort(connection: int) -> None:
    """End a FUSE connection: every request waiting on it fails at once."""
    try:
        with open(f"/sys/fs/fuse/connections/{connection}/abort", "w") as control:
            control.write("1")
    except OSError as exc:
        log.warning("cannot abort FUSE connection %d: %s", connection, exc.strerror)
