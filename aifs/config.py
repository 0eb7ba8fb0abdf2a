"""Mount configuration: one table of options, read from defaults, a TOML file,
``AIFS_*`` environment variables and the command line (later wins).

Every option the code accepts is a field of :class:`Config`; the README's
configuration reference is generated from the same table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aifs.errors import ConfigError
from aifs.policy import DEFAULT_MARKERS, DEFAULT_STAGING, Policies

log = logging.getLogger(__name__)

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}


def parse_size(value: str | int) -> int:
    """Parse ``64M``, ``10GiB`` or a plain byte count."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(value).lower())
    if not match:
        raise ConfigError(f"not a size: {value!r} (use bytes or a suffix such as 512M, 20G)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def default_lake_url() -> str:
    """The embedded default lake: a local directory, no configuration needed."""
    base = "/var/lib/aifs" if os.geteuid() == 0 else os.path.expanduser("~/.local/share/aifs")
    return "file://" + os.path.join(base, "lake")


def _option(default: Any, doc: str, kind: str = "str", env: bool = True) -> Any:
    return field(default=default, metadata={"doc": doc, "kind": kind, "env": env})


@dataclass
class Config:
    """Options of one mount. ``doc`` metadata feeds the README reference."""

    lake: str = _option("", "Lake URL: s3://BUCKET[/PREFIX], file:///DIR or a path. "
                        "Empty means the embedded local-directory lake.")
    mountpoint: str = _option("", "Directory to mount on.", env=False)
    cache_dir: str = _option("", "Local (NVMe) directory for cached blocks and metadata. "
                             "Default: /var/cache/aifs/<id> (root) or ~/.cache/aifs/<id>.")
    cache_size: int = _option(parse_size("20G"), "Capacity of the block cache in bytes "
                              "(suffixes K, M, G, T).", "size")
    block_size: int = _option(parse_size("8M"), "Size of cached blocks and range GETs.", "size")
    memory_cache: int = _option(parse_size("256M"), "Bytes of recently used blocks kept in "
                                "memory to answer reads without disk I/O.", "size")
    readahead_max: int = _option(parse_size("128M"), "Largest sequential readahead window "
                                 "per open file.", "size")
    kernel_readahead: int = _option(parse_size("16M"), "Kernel readahead window of the "
                                    "mount (sysfs read_ahead_kb); with it the mount's async "
                                    "request queue grows to twice max_connections (fusectl, "
                                    "mounted where missing). Needs root; 0 keeps the kernel "
                                    "defaults (128K, 12 requests).", "size")
    metadata_ttl: float = _option(60.0, "Seconds a directory listing, and the kernel's "
                                  "attribute and entry caches, stay valid before the lake "
                                  "is asked again.", "float")
    endpoint_url: str = _option("", "S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS).")
    region: str = _option("", "S3 region (default: the AWS credential chain's, else us-east-1).")
    profile: str = _option("", "AWS profile name for credentials.")
    path_style: bool = _option(True, "Use path-style S3 addressing (needed by most "
                               "non-AWS servers).", "bool")
    sign_payload: bool = _option(False, "SHA-256 sign the bodies of uploads (SigV4); off, "
                                 "bodies are sent as UNSIGNED-PAYLOAD, which saves about a "
                                 "core-second per GiB uploaded.", "bool")
    max_connections: int = _option(32, "Concurrent lake requests (connection pool size).", "int")
    request_timeout: float = _option(30.0, "Seconds before a lake request is abandoned and "
                                     "retried.", "float")
    retries: int = _option(5, "Attempts for a lake request that fails transiently.", "int")
    promote_delay: float = _option(2.0, "Seconds after its last change (and close) before a "
                                   "file is promoted to the lake, so quick rewrites "
                                   "coalesce.", "float")
    promote_workers: int = _option(4, "Files promoted to the lake at once.", "int")
    multipart_threshold: int = _option(parse_size("16M"), "Files of at least this size are "
                                       "uploaded in parts (multipart).", "size")
    part_size: int = _option(parse_size("8M"), "Size of the first parts of a multipart "
                             "upload (at least 5M); parts double every 1000 so any object "
                             "fits in 10,000.", "size")
    parts_in_flight: int = _option(8, "Parts of one file uploaded at once.", "int")
    promote_busy_rate: int = _option(parse_size("32M"), "Bytes per second promotion reads "
                                     "of its local copies while applications keep the "
                                     "mount busy (a DataLoader reading beside a checkpoint "
                                     "upload); full speed when idle or when someone waits "
                                     "(sync, unmount, a full cache); 0: never slowed.",
                                     "size")
    pack_threshold: int = _option(parse_size("1M"), "Files smaller than this when promoted "
                                  "are packed into pack objects (dataset and default "
                                  "policies; at most block_size); 0 packs nothing.", "size")
    pack_size: int = _option(parse_size("64M"), "Target size of a pack object.", "size")
    pack_wait: float = _option(2.0, "Seconds without a new small file before a pack that "
                               "is not full is put (at most ten times this after its first "
                               "file); a full pack goes at once.", "float")
    pack_compact_below: float = _option(0.5, "Packs whose live share falls below this are "
                                        "rewritten without their dead bytes (compaction).",
                                        "float")
    fold_shard_records: int = _option(8192, "A fold of more records than this is split "
                                      "by directory into shard objects of about this many "
                                      "records, so that a new node reads only the "
                                      "directories it lists.", "int")
    stale_upload_age: float = _option(86400.0, "Seconds after which an unfinished multipart "
                                      "upload that no mount of this cache owns is aborted, "
                                      "at mount and by aifs gc (one whose creation reply "
                                      "was lost, or left by a lost node).", "float")
    pack_gc_grace: float = _option(3600.0, "Seconds a pack nothing refers to any more is kept "
                                   "before it is deleted, so nodes that have not yet read "
                                   "the newest journals can still read from it.", "float")
    fsync: str = _option("local", "What fsync waits for: 'local' (the data is durable on "
                         "the local disk) or 'lake' (the file is in the lake).")
    direct_writes: bool = _option(True, "Pass writes of write-only handles to the daemon "
                                  "past the kernel's page cache (FUSE direct I/O): faster, "
                                  "and written data is cached once, not twice.", "bool")
    fuse_binding: str = _option("auto", "How aifs speaks FUSE: 'kernel' (its own session "
                                "on /dev/fuse: 1 MiB requests, readdirplus, passthrough), "
                                "'pyfuse3' (libfuse 3), or 'auto' (kernel where it mounts, "
                                "else pyfuse3).")
    passthrough: bool = _option(True, "With the kernel binding: reads and writes of files "
                                "whose whole content is on the local disk go from the kernel "
                                "straight to it (FUSE passthrough; needs root on the host "
                                "and Linux 6.9+; else served by the daemon).", "bool")
    fuse_poll_us: int = _option(50, "With the kernel binding: microseconds the daemon "
                                "keeps polling for the next request after answering one, "
                                "while requests come that close together, before it "
                                "sleeps (a woken CPU costs more than the poll); 0: never.",
                                "int")
    dir_prefetch: bool = _option(True, "Fetch the rest of a directory of small objects "
                                 "ahead of readers going through it (a first epoch, in "
                                 "order or shuffled), many GETs at once; what is fetched "
                                 "and not opened yet is at most an eighth of the cache "
                                 "(256 MiB).", "bool")
    list_ahead: int = _option(1, "When a walker (`find`, `du`, `os.walk`, a DataLoader "
                              "indexing its dataset) opens a subdirectory, the next this "
                              "many of its siblings (in readdir order) are listed in the "
                              "background, so that it finds them listed; 0: none.", "int")
    object_attrs: bool = _option(False, "Read the POSIX attributes (mode, owner, mtime, "
                                 "symlinks) of objects other tools wrote (s3fs's metadata) "
                                 "with one HEAD per object on its first lookup. Off, they "
                                 "show the listing's size and mtime and the default mode, "
                                 "and their xattrs are read when asked for. Objects aifs "
                                 "wrote carry theirs in its journals either way.", "bool")
    policy_rules: list[str] = field(default_factory=list, metadata={
        "doc": "Extra PATTERN=POLICY rules (policies: checkpoint, dataset, weights, "
               "default), checked before the built-in ones; the xattr user.aifs.policy "
               "on a file or directory overrides both.", "kind": "list", "env": True})
    checkpoint_markers: list[str] = field(default_factory=lambda: list(DEFAULT_MARKERS),
                                          metadata={
        "doc": "Names of checkpoint commit markers: a marker reaches the lake only after "
               "every checkpoint file under its directory written before it.",
        "kind": "list", "env": True})
    checkpoint_staging: list[str] = field(default_factory=lambda: list(DEFAULT_STAGING),
                                          metadata={
        "doc": "Names a checkpoint is written under before a rename commits it; held "
               "back from the lake so they are promoted once, under the final name.",
        "kind": "list", "env": True})
    staging_hold: float = _option(300.0, "Seconds a file under a staging name waits for "
                                  "its rename before it is promoted anyway.", "float")
    checkpoint_keep: int = _option(2, "Newest checkpoints of each checkpoint directory "
                                   "kept on the local tier after promotion (evicted last).",
                                   "int")
    stream_checkpoints: str = _option("auto", "Upload parts of a checkpoint file written "
                                      "sequentially while it is still being written: true, "
                                      "false, or auto (S3 lakes only; a local-directory lake "
                                      "shares the writer's disk).")
    stream_large_files: str = _option("auto", "Upload parts of any other file written "
                                      "sequentially from empty while it is still being "
                                      "written, once it reaches multipart_threshold: true, "
                                      "false, or auto (S3 lakes only; a local-directory "
                                      "lake shares the writer's disk).")
    stream_parts_in_flight: int = _option(2, "Parts of a streamed file uploaded at once "
                                          "while it is still being written (after close: "
                                          "parts_in_flight).", "int")
    recovered_max: int = _option(parse_size("1G"), "Bytes the recovery directory "
                                 "(<cache_dir>/recovered: files not published because a "
                                 "write failed or a crash came) keeps at most, and never "
                                 "more than a tenth of the cache disk; the oldest files go "
                                 "first, a log line each.", "size")
    allow_other: bool = _option(False, "Let users other than the mounting one access the "
                                "mount (FUSE allow_other).", "bool")
    metrics_port: int = _option(0, "TCP port of the Prometheus metrics endpoint "
                                "(/metrics, and /metrics.json); 0 serves none.", "int")
    metrics_address: str = _option("127.0.0.1", "Address the metrics endpoint binds to "
                                   "(0.0.0.0 exposes it to the network).")
    unmount_timeout: float = _option(0.0, "Seconds an unmount or a stop signal waits for "
                                     "pending changes to reach the lake before the daemon "
                                     "exits anyway (they stay in the cache directory and the "
                                     "next mount promotes them); 0 waits as long as it takes.",
                                     "float")
    log_level: str = _option("info", "Logging level: debug, info, warning, error.")
    log_format: str = _option("text", "Log line format: 'text', or 'json' (one object per "
                              "line: time, level, logger, message).")
    log_file: str = _option("", "Log file of a daemonized mount (default: "
                            "<cache_dir>/aifs.log).")
    foreground: bool = _option(False, "Stay in the foreground instead of daemonizing.",
                               "bool", env=False)
    fuse_options: list[str] = field(default_factory=list, metadata={
        "doc": "Extra FUSE mount options (-o).", "kind": "list", "env": False})

    # -- derived values -------------------------------------------------
    def resolved_lake(self) -> str:
        lake = self.lake or default_lake_url()
        if "://" not in lake:
            lake = "file://" + os.path.abspath(lake)
        return lake

    def streams_large_files(self) -> bool:
        """``stream_large_files`` for this lake. On a local-directory lake the
        streamed parts are written to the disk the writer writes to: in the
        write benchmark that made 2 GiB writes 2.4 times slower until close
        and reached the lake no sooner, so ``auto`` streams to S3 only."""
        return self._streams(self.stream_large_files)

    def streams_checkpoints(self) -> bool:
        """``stream_checkpoints`` for this lake, ``auto`` as above: on a
        local-directory lake a streamed 1 GiB ``torch.save`` took 1.1-3.3 s,
        0.5-0.9 s without (same mount options otherwise, alternated)."""
        return self._streams(self.stream_checkpoints)

    def _streams(self, choice: str) -> bool:
        if choice == "auto":
            return self.resolved_lake().startswith("s3://")
        return choice == "true"

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).absolute()
        ident = hashlib.sha256(
            f"{self.resolved_lake()}\0{os.path.abspath(self.mountpoint)}".encode()
        ).hexdigest()[:16]
        base = "/var/cache/aifs" if os.geteuid() == 0 else os.path.expanduser("~/.cache/aifs")
        return Path(base) / ident

    def policies(self) -> Policies:
        return Policies.from_config(self.policy_rules, self.checkpoint_markers,
                                    self.checkpoint_staging)

    def validate(self) -> None:
        if self.block_size < 64 * 1024 or self.block_size > 1 << 30:
            raise ConfigError("block_size must be between 64K and 1G")
        if self.cache_size < self.block_size * 4:
            raise ConfigError("cache_size must hold at least four blocks")
        if self.metadata_ttl < 0:
            raise ConfigError("metadata_ttl must not be negative")
        if self.max_connections < 1 or self.retries < 1:
            raise ConfigError("max_connections and retries must be at least 1")
        if self.part_size < 5 << 20 or self.part_size > 5 << 30:
            raise ConfigError("part_size must be between 5M and 5G")
        if self.multipart_threshold < self.part_size:
            raise ConfigError("multipart_threshold must be at least part_size")
        if self.promote_delay < 0 or self.promote_workers < 1 or self.parts_in_flight < 1:
            raise ConfigError("promote_delay must not be negative; promote_workers and "
                              "parts_in_flight must be at least 1")
        if not 0 <= self.fuse_poll_us <= 10_000:
            raise ConfigError("fuse_poll_us must be between 0 and 10000")
        if self.fuse_binding not in ("auto", "kernel", "pyfuse3"):
            raise ConfigError("fuse_binding must be 'auto', 'kernel' or 'pyfuse3', not "
                              f"{self.fuse_binding!r}")
        if self.fsync not in ("local", "lake"):
            raise ConfigError(f"fsync must be 'local' or 'lake', not {self.fsync!r}")
        for name in ("stream_large_files", "stream_checkpoints"):
            choice = str(getattr(self, name)).strip().lower()
            if choice in _BOOL_WORDS:
                choice = str(_BOOL_WORDS[choice]).lower()
            setattr(self, name, choice)
            if choice not in ("auto", "true", "false"):
                raise ConfigError(f"{name} must be 'auto', 'true' or 'false', not {choice!r}")
        if self.staging_hold < 0 or self.checkpoint_keep < 0:
            raise ConfigError("staging_hold and checkpoint_keep must not be negative")
        self.policies()
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"unknown log level {self.log_level!r}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be 'text' or 'json', not {self.log_format!r}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port, not {self.metrics_port}")
        if self.unmount_timeout < 0:
            raise ConfigError("unmount_timeout must not be negative")
        if self.fold_shard_records < 1:
            raise ConfigError("fold_shard_records must be at least 1")
        if self.pack_threshold < 0 or self.pack_size < 1 << 20:
            raise ConfigError("pack_threshold must not be negative; pack_size must be at "
                              "least 1M")
        if not 0 <= self.pack_compact_below <= 1 or self.pack_wait < 0 \
                or self.pack_gc_grace < 0 or self.stale_upload_age < 0:
            raise ConfigError("pack_compact_below must be between 0 and 1; pack_wait and "
                              "pack_gc_grace and stale_upload_age must not be negative")


#: options an earlier release had, with why they went: a file that still names
#: one mounts (with a warning), as it did
REMOVED = {
    "fuse_native": "the C read loop is gone: every request is answered in Python",
    "fuse_transport": "FUSE over io_uring is gone: requests come on /dev/fuse",
}


def option_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(Config))


def _convert(f: dataclasses.Field, value: Any, source: str) -> Any:
    kind = f.metadata["kind"]
    try:
        if kind == "size":
            return parse_size(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            return _BOOL_WORDS[str(value).strip().lower()]
        if kind == "list":
            return [str(v) for v in value] if isinstance(value, list) else str(value).split(",")
        return str(value)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{source}: bad value {value!r} for {f.name}") from exc


def load_config(config_file: str | None, overrides: dict[str, Any],
                environ: Mapping[str, str] | None = None) -> Config:
    """Build a Config from defaults < TOML file < AIFS_* variables < overrides."""
    environ = os.environ if environ is None else environ
    cfg = Config()
    fields = {f.name: f for f in option_fields()}
    if config_file:
        try:
            with open(config_file, "rb") as fp:
                data = tomllib.load(fp)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {config_file}") from exc
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
        for name, value in data.items():
            key = name.replace("-", "_")
            if key in REMOVED:
                log.warning("%s: option %r was removed (%s); ignored", config_file, name,
                            REMOVED[key])
                continue
            if key not in fields:
                raise ConfigError(f"{config_file}: unknown option {name!r}")
            setattr(cfg, key, _convert(fields[key], value, config_file))
    for name, why in REMOVED.items():
        if "AIFS_" + name.upper() in environ:
            log.warning("AIFS_%s: option %s was removed (%s); ignored", name.upper(), name,
                        why)
    for f in fields.values():
        var = "AIFS_" + f.name.upper()
        if f.metadata["env"] and var in environ:
            setattr(cfg, f.name, _convert(f, environ[var], var))
    for name, value in overrides.items():
        if value is not None:
            setattr(cfg, name, _convert(fields[name], value, "--" + name.replace("_", "-")))
    cfg.validate()
    return cfg
