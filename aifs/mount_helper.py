"""The mount(8) / umount(8) helper: ``mount -t fuse.aifs`` and fstab lines.

mount(8) runs ``/sbin/mount.fuse.aifs SPEC DIR [-sfnv] [-o OPTIONS]`` and
umount(8) runs ``/sbin/umount.fuse.aifs DIR [-flnrv]``; both are the script
``mount/mount.aifs``, which runs this module. Options are translated to an
``aifs mount`` command line:

- ``config=PATH`` and every aifs option (``cache_dir=/nvme/x``,
  ``cache-size=500G``, ``allow_other``, ``policy=runs/*/=checkpoint``) become
  the matching ``aifs mount`` flags;
- options meant for mount(8), systemd or fstab alone (``_netdev``, ``nofail``,
  ``noauto``, ``x-systemd.*``, ``defaults``, ``rw``, ...) are dropped;
- anything else is passed to FUSE with ``-o`` (``ro``, ``default_permissions``).

SPEC is the lake URL; ``none`` (or an empty SPEC) takes the lake from the
config file. (Not ``aifs``: mount(8) turns a SPEC that names an existing path,
such as a directory ``aifs`` where it runs, into that absolute path.)
Unmounting goes through ``aifs umount``, which waits until every closed file
is in the lake; ``umount -l`` through ``aifs umount --lazy``, which detaches
at once though files are open (the daemon serves them until their last close).
"""

from __future__ import annotations

import os
import sys

from aifs.config import REMOVED, option_fields

#: options that only mean something to mount(8), fstab or systemd
IGNORED = {"_netdev", "auto", "noauto", "nofail", "user", "nouser", "users", "owner",
           "group", "defaults", "rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec",
           "async", "sync", "atime", "noatime", "relatime", "strictatime", "nodiratime"}
IGNORED_PREFIXES = ("x-", "comment=", "helper=", "_")
#: SPEC values that mean "the lake named in the config file"
NO_LAKE = {"", "none"}
#: config options with a command-line name other than --NAME
FLAG_NAMES = {"policy_rules": "--policy", "fuse_options": "-o"}
#: config options a mount helper must not set (the positional arguments decide)
POSITIONAL = {"lake", "mountpoint", "foreground"}


class HelperError(Exception):
    pass


def _options() -> dict[str, str]:
    """Option name (with '_' or '-') -> its config field kind."""
    out = {}
    for f in option_fields():
        if f.name in POSITIONAL:
            continue
        out[f.name] = f.metadata["kind"]
        out[f.name.replace("_", "-")] = f.metadata["kind"]
    out["policy"] = "list"
    return out


def _mount_flags() -> set[str]:
    """The option strings ``aifs mount`` accepts."""
    from aifs.mount_options import mount_options
    return {flag for strings in mount_options() for flag in strings}


def mount_command(argv: list[str], aifs: str = "aifs"
                  ) -> tuple[list[str], dict[str, str], bool]:
    """``SPEC DIR [-sfnv] [-o OPTS] [-t TYPE]`` -> the ``aifs mount`` command
    line, the AIFS_* variables for options it has no flag for, and whether
    mount(8) only pretends (``-f``)."""
    positional: list[str] = []
    options: list[str] = []
    flags: set[str] = set()
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            options += next(args, "").split(",")
        elif arg.startswith("-o") and len(arg) > 2:
            options += arg[2:].split(",")
        elif arg in ("-t", "-N"):
            value = next(args, "")
            if arg == "-N":
                raise HelperError(f"mount namespaces (-N {value}) are not supported")
        elif arg.startswith("-") and len(arg) > 1:
            flags |= set(arg[1:])  # -s sloppy, -f fake, -n no mtab, -v verbose
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise HelperError("usage: mount.fuse.aifs LAKE_URL|none MOUNTPOINT [-o OPTIONS]")
    spec, mountpoint = positional
    known = _options()
    flags_known = _mount_flags()
    command = [aifs, "mount"]
    env: dict[str, str] = {}
    extra: list[str] = []
    for option in (o.strip() for o in options):
        if not option or option in IGNORED or option.startswith(IGNORED_PREFIXES):
            continue
        name, has_value, value = option.partition("=")
        field = "policy_rules" if name == "policy" else name.replace("-", "_")
        flag = FLAG_NAMES.get(field, "--" + field.replace("_", "-"))
        if name == "config":
            command += ["--config", value]
            continue
        if field in REMOVED:  # an fstab line written for an earlier release still mounts
            print(f"mount.aifs: option {name} was removed ({REMOVED[field]}); ignored",
                  file=sys.stderr)
            continue
        if name not in known:
            extra.append(option)  # a FUSE option
            continue
        if not has_value:
            if known[name] != "bool":
                raise HelperError(f"option {name} needs a value ({name}=...)")
            value = "true"
        if flag not in flags_known:
            env["AIFS_" + field.upper()] = value  # e.g. checkpoint_markers: no flag
        elif field == "allow_other":
            if value.lower() in ("1", "true", "yes", "on"):
                command.append(flag)
        else:
            command += [flag, value]
    for option in extra:
        command += ["-o", option]
    if spec not in NO_LAKE:
        command.append(spec)
    command.append(os.path.abspath(mountpoint))
    return command, env, "f" in flags


def umount_command(argv: list[str], aifs: str = "aifs") -> list[str]:
    """``DIR [-flnrv] [-t TYPE]`` -> the ``aifs umount`` command line."""
    positional = []
    lazy = False
    args = iter(argv)
    for arg in args:
        if arg in ("-t", "-N"):
            next(args, None)
        elif not arg.startswith("-"):
            positional.append(arg)
        elif not arg.startswith("--"):
            lazy = lazy or "l" in arg  # umount -l: detach though files are open
    if len(positional) != 1:
        raise HelperError("usage: umount.fuse.aifs MOUNTPOINT")
    return [aifs, "umount", *(["--lazy"] if lazy else []), os.path.abspath(positional[0])]


def main(argv: list[str]) -> int:
    prog, args = (argv[0], argv[1:]) if argv else ("mount.fuse.aifs", [])
    aifs = os.path.join(os.path.dirname(sys.executable), "aifs")
    try:
        if prog.startswith("umount"):
            command = umount_command(args, aifs)
        else:
            command, env, fake = mount_command(args, aifs)
            if fake:
                return 0
            os.environ.update(env)
    except HelperError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    os.execv(command[0], command)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
