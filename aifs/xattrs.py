"""Every extended attribute name aifs answers, or stores, in one table.

The ``user.aifs.*`` names on the mount are the control plane: the CLI and
programs read or set them on a path (``getfattr -n user.aifs.state FILE``).
Reading an *action* name does the work and returns its JSON result; the
others are facts. What a user sets with ``setfattr`` outside this table is an
ordinary user xattr, kept in the lake with the object.
"""

from __future__ import annotations

PREFIX = "user.aifs."

# -- facts about any inode (read-only) ---------------------------------------
KEY = "user.aifs.key"                    # the lake key
ETAG = "user.aifs.etag"                  # the lake version this node knows (files)
PACK = "user.aifs.pack"                  # file: PACK@OFFSET of a packed file; directory: action
CACHED_BYTES = "user.aifs.cached_bytes"  # bytes of the file in the local cache
STATE = "user.aifs.state"                # local / uploading / in lake / checkpoint states
POLICY = "user.aifs.policy"              # cache policy; settable on a directory
PINNED = "user.aifs.pinned"              # "1": kept in the cache (node-local); settable

# -- facts about the mount (root only) ---------------------------------------
LAKE = "user.aifs.lake"                  # the lake URL
PID = "user.aifs.pid"                    # the daemon's process id
STATS = "user.aifs.stats"                # JSON: cache and promotion counters
PENDING = "user.aifs.pending"            # JSON: promotion queue, and why a sync gave up
METRICS = "user.aifs.metrics"            # JSON: everything `aifs status` shows
PACK_PROGRESS = "user.aifs.pack_progress"  # JSON: progress of a running `aifs gc`/pack

# -- actions: reading the name does the work ---------------------------------
SYNC = "user.aifs.sync"                  # promote what is under the path, then answer
WARMUP = "user.aifs.warmup"              # fetch the file (or tree) into the cache
GC = "user.aifs.gc"                      # compact packs, collect garbage, abort stale uploads
UNMOUNT_FLUSH = "user.aifs.unmount_flush"  # set "0": unmount without promoting first

# -- stored outside the mount -------------------------------------------------
#: on the local lake's files: an object's user metadata, one xattr per key
LOCAL_META_PREFIX = "user.aifs.meta."
#: on a local lake directory that is a marker object, not only a prefix
LOCAL_MARKER = "user.aifs.marker"
#: on the block cache's directories: the policy and class of the cached object
CACHE_POLICY = POLICY
CACHE_CLASS = PINNED
