"""The options of ``aifs mount``: the command line's, and the list of them
``mount.aifs`` (fstab lines) and the README's table are checked against."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["mount_arguments", "mount_options"]


class _Parser(argparse.ArgumentParser):
    """An argument parser that keeps the option strings it was given (what
    ``mount.aifs`` passes on; argparse lists them only in private fields)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: list[list[str]] = []  # (before: the parent adds --help)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.help != argparse.SUPPRESS:  # (not removed ones)
            self.options.append(list(action.option_strings))
        return action


def mount_options() -> list[list[str]]:
    """The option strings of each ``aifs mount`` option (``["--foreground", "-f"]``)."""
    mount = _Parser(add_help=True)
    mount_arguments(mount)
    return mount.options


def mount_arguments(mount: argparse.ArgumentParser) -> None:
    """Add the options of ``aifs mount`` to ``mount``."""
    mount.add_argument("targets", nargs="*", metavar="[LAKE_URL] MOUNTPOINT",
                       help="both may come from the config file instead")
    mount.add_argument("--config", "-c", help="TOML configuration file")
    mount.add_argument("--foreground", "-f", action="store_true", default=None,
                       help="stay in the foreground")
    mount.add_argument("--cache-dir")
    mount.add_argument("--cache-size", help="e.g. 20G")
    mount.add_argument("--block-size", help="e.g. 8M")
    mount.add_argument("--memory-cache", help="e.g. 256M")
    mount.add_argument("--readahead-max", help="e.g. 128M")
    mount.add_argument("--kernel-readahead", help="e.g. 16M")
    mount.add_argument("--metadata-ttl", type=float, help="seconds")
    mount.add_argument("--endpoint-url")
    mount.add_argument("--region")
    mount.add_argument("--profile")
    mount.add_argument("--path-style", choices=["true", "false"])
    mount.add_argument("--sign-payload", choices=["true", "false"])
    mount.add_argument("--max-connections", type=int)
    mount.add_argument("--request-timeout", type=float)
    mount.add_argument("--retries", type=int)
    mount.add_argument("--promote-delay", type=float, help="seconds")
    mount.add_argument("--promote-workers", type=int)
    mount.add_argument("--multipart-threshold", help="e.g. 16M")
    mount.add_argument("--part-size", help="e.g. 8M")
    mount.add_argument("--parts-in-flight", type=int)
    mount.add_argument("--promote-busy-rate", help="bytes/s, e.g. 32M; 0: never slowed")
    mount.add_argument("--pack-threshold", help="e.g. 1M; 0 packs nothing")
    mount.add_argument("--pack-size", help="e.g. 64M")
    mount.add_argument("--pack-wait", type=float, help="seconds")
    mount.add_argument("--pack-compact-below", type=float, help="live share, 0 to 1")
    mount.add_argument("--pack-gc-grace", type=float, help="seconds")
    mount.add_argument("--fold-shard-records", type=int, help="records per shard of a fold")
    mount.add_argument("--stale-upload-age", type=float, help="seconds")
    mount.add_argument("--fsync", choices=["local", "lake"])
    mount.add_argument("--direct-writes", choices=["true", "false"])
    mount.add_argument("--object-attrs", choices=["true", "false"])
    mount.add_argument("--dir-prefetch", choices=["true", "false"])
    mount.add_argument("--fuse-binding", choices=["auto", "kernel", "pyfuse3"])
    mount.add_argument("--passthrough", choices=["true", "false"])
    mount.add_argument("--fuse-poll-us", type=int, help="microseconds; 0: never poll")
    # removed options, still accepted (a unit or script written for an earlier
    # release mounts, with a warning: config.REMOVED)
    mount.add_argument("--fuse-native", dest="removed_fuse_native", help=argparse.SUPPRESS)
    mount.add_argument("--fuse-transport", dest="removed_fuse_transport",
                       help=argparse.SUPPRESS)
    mount.add_argument("--list-ahead", type=int, help="subdirectories; 0: none")
    mount.add_argument("--policy", dest="policy_rules", action="append", default=None,
                       metavar="PATTERN=POLICY", help="a policy rule (repeatable)")
    mount.add_argument("--staging-hold", type=float, help="seconds")
    mount.add_argument("--checkpoint-keep", type=int)
    mount.add_argument("--stream-checkpoints", choices=["auto", "true", "false"])
    mount.add_argument("--stream-large-files", choices=["auto", "true", "false"])
    mount.add_argument("--stream-parts-in-flight", type=int)
    mount.add_argument("--recovered-max", help="e.g. 1G")
    mount.add_argument("--allow-other", action="store_true", default=None)
    mount.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this "
                       "port (127.0.0.1 unless --metrics-address)")
    mount.add_argument("--metrics-address")
    mount.add_argument("--unmount-timeout", type=float, help="seconds")
    mount.add_argument("--log-level")
    mount.add_argument("--log-file")
    mount.add_argument("--log-format", choices=["text", "json"])
    mount.add_argument("-o", dest="fuse_options", action="append", default=None,
                       help="FUSE mount options")
    mount.add_argument("--clear-dead-mount", action="store_true",
                       help="detach a dead aifs mount (its daemon killed) on MOUNTPOINT "
                       "instead of refusing; the systemd unit restarts with it")
