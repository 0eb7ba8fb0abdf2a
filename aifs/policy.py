"""Path policies: which files are checkpoints, datasets or weights, and how a
checkpoint is laid out (its commit markers, staging names and units).

A pattern is matched against a path relative to the mount root, like a
``.gitignore`` line: ``NAME`` (no slash) matches the last component,
``NAME/`` matches any directory above the file, anything else matches the
whole path (``*`` crosses slashes). The first matching rule wins; the
configured rules come before the built-in ones, and the xattr
``user.aifs.policy`` on a file or any directory above it overrides both.

The built-in rules recognise the layouts of the common frameworks (files,
then what commits them):

- torch.save: ``*.pt``, ``*.pth``, ``*.ckpt``; the file itself, often
  written as ``x.tmp`` and renamed.
- PyTorch DCP: ``*.distcp``; ``.metadata`` (renamed from ``.metadata.tmp``).
- DeepSpeed: ``global_step*/``; ``latest``.
- Megatron-LM: ``iter_*/``; ``latest_checkpointed_iteration.txt``.
- HF Trainer: ``checkpoint-*/``; the rename of ``tmp-checkpoint-*``, and
  ``trainer_state.json`` inside.
- torchsnapshot: ``.snapshot_metadata``.
- Orbax: ``*.orbax-checkpoint-tmp-*/`` renamed; ``commit_success.txt``.
- NeMo: ``*.nemo``, ``*.ckpt``; the removal of ``*-unfinished``.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass
from functools import lru_cache

from aifs import xattrs
from aifs.errors import ConfigError

CHECKPOINT = "checkpoint"
DATASET = "dataset"
WEIGHTS = "weights"
DEFAULT = "default"
POLICIES = (CHECKPOINT, DATASET, WEIGHTS, DEFAULT)
POLICY_XATTR = xattrs.POLICY

#: Directories that hold one checkpoint each (a retention unit).
CHECKPOINT_DIRS = ("global_step*/", "iter_[0-9]*/", "checkpoint-*/", "tmp-checkpoint-*/",
                   "*.orbax-checkpoint-tmp-*/", "step_[0-9]*/", "step-[0-9]*/")

BUILTIN_RULES: tuple[tuple[str, str], ...] = (
    *((pattern, CHECKPOINT) for pattern in CHECKPOINT_DIRS),
    *((pattern, CHECKPOINT) for pattern in (
        "*.pt", "*.pth", "*.ckpt", "*.nemo", "*.distcp", ".metadata", "__*.metadata",
        ".metadata.tmp", "*.pt.tmp", "*.pth.tmp", "*.ckpt.tmp", "latest",
        "latest_checkpointed_iteration.txt", ".snapshot_metadata", "commit_success.txt",
        "*-unfinished")),
    *((pattern, WEIGHTS) for pattern in ("*.safetensors", "*.gguf", "*.bin", "*.onnx")),
    *((pattern, DATASET) for pattern in (
        "*.tar", "*.parquet", "*.arrow", "*.tfrecord", "*.tfrecords", "*.npy", "*.npz",
        "*.jpg", "*.jpeg", "*.png", "*.webp", "*.wav", "*.flac", "*.mds", "*.jsonl")),
)

#: A checkpoint's commit markers: each reaches the lake only after every other
#: checkpoint file under its directory that was written before it.
DEFAULT_MARKERS = (".metadata", "__*.metadata", "latest", "latest_checkpointed_iteration.txt",
                   "trainer_state.json", ".snapshot_metadata", "commit_success.txt")

#: Names a checkpoint is written under before a rename commits it: held back
#: from the lake (up to ``staging_hold`` seconds) so they are promoted once,
#: under their final name.
DEFAULT_STAGING = ("tmp-checkpoint-*/", "*.orbax-checkpoint-tmp-*/", "*.tmp", "*.tmp-*/")


@lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(pattern))


def matches(pattern: str, path: str) -> bool:
    """Whether ``path`` (relative, no trailing slash) matches ``pattern``."""
    parts = path.split("/")
    if pattern.endswith("/"):
        regex = _compiled(pattern[:-1])
        return any(regex.match(part) for part in parts[:-1])
    if "/" not in pattern:
        return bool(_compiled(pattern).match(parts[-1]))
    return bool(_compiled(pattern.lstrip("/")).match(path))


def parse_rules(entries: list[str]) -> tuple[tuple[str, str], ...]:
    """``PATTERN=POLICY`` entries from the configuration."""
    rules = []
    for entry in entries:
        pattern, sep, policy = entry.rpartition("=")
        pattern, policy = pattern.strip(), policy.strip()
        if not sep or not pattern:
            raise ConfigError(f"policy rule {entry!r}: expected PATTERN=POLICY")
        if policy not in POLICIES:
            raise ConfigError(f"policy rule {entry!r}: unknown policy {policy!r} "
                              f"(one of {', '.join(POLICIES)})")
        rules.append((pattern, policy))
    return tuple(rules)


@dataclass(frozen=True)
class Policies:
    """The compiled rules of one mount."""

    rules: tuple[tuple[str, str], ...] = BUILTIN_RULES
    markers: tuple[str, ...] = DEFAULT_MARKERS
    staging: tuple[str, ...] = DEFAULT_STAGING

    @classmethod
    def from_config(cls, rules: list[str], markers: list[str], staging: list[str]) -> Policies:
        return cls(parse_rules(rules) + BUILTIN_RULES,
                   tuple(m for m in markers if m), tuple(s for s in staging if s))

    def by_rules(self, path: str) -> str:
        first = self._rules.first(path)
        return self.rules[first][1] if first is not None else DEFAULT

    def is_marker(self, path: str) -> bool:
        return self._markers.first(path) is not None

    def is_staging(self, path: str) -> bool:
        return self._staging.first(path) is not None

    @functools.cached_property
    def _rules(self) -> PatternSet:
        return PatternSet(tuple(pattern for pattern, _ in self.rules))

    @functools.cached_property
    def _markers(self) -> PatternSet:
        return PatternSet(self.markers)

    @functools.cached_property
    def _staging(self) -> PatternSet:
        return PatternSet(self.staging)


    def unit_of(self, path: str) -> str | None:
        """The checkpoint a checkpoint file belongs to, as a path: its nearest
        checkpoint directory, else the file itself; None for a marker outside
        any checkpoint directory (it speaks for the whole root)."""
        parts = path.split("/")
        for depth in range(len(parts) - 2, -1, -1):
            if any(fnmatch.fnmatchcase(parts[depth], pattern[:-1])
                   for pattern in CHECKPOINT_DIRS):
                return "/".join(parts[:depth + 1])
        if self.is_marker(path):
            return None
        if fnmatch.fnmatchcase(parts[-1], "*.distcp"):
            return "/".join(parts[:-1])
        return path


class PatternSet:
    """Patterns matched the way :func:`matches` matches one, all at once: three
    combined regexes (names, directories, whole paths) instead of one regex
    per pattern, since every file's policy is looked up when it is opened."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        kinds: tuple[list[str], list[str], list[str]] = ([], [], [])
        for index, pattern in enumerate(patterns):
            if pattern.endswith("/"):
                kind, text = 1, pattern[:-1]
            elif "/" not in pattern:
                kind, text = 0, pattern
            else:
                kind, text = 2, pattern.lstrip("/")
            kinds[kind].append(f"(?P<p{index}>{fnmatch.translate(text)})")
        self.names, self.directories, self.paths = (
            re.compile("|".join(k)) if k else None for k in kinds)

    def first(self, path: str) -> int | None:
        """The index of the first pattern that matches ``path`` (None: none)."""
        parts = path.split("/")
        found = [self.names.match(parts[-1]) if self.names else None,
                 self.paths.match(path) if self.paths else None]
        if self.directories is not None:
            found += [self.directories.match(part) for part in parts[:-1]]
        indexes = [int(m.lastgroup[1:]) for m in found if m is not None and m.lastgroup]
        return min(indexes) if indexes else None
