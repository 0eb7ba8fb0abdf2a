"""A local directory as a lake (``file://``): the embedded default.

Key ``a/b/c`` is the file ``ROOT/a/b/c``; key ``a/`` (a directory marker) is
the directory ``ROOT/a``. ROOT is reached through a descriptor held open
(``/proc/self/fd/N``), so where it lies does not shorten keys; a key longer
than a path may be is reached through descriptors of directories on its way,
opened for the one call (:meth:`LocalStore._reach`), so keys are as long as a
local filesystem's paths (``MAX_KEY``), PATH_MAX and beyond.
Writes go to a temporary file renamed into place, so a reader never sees a
partial object and a replaced object gets a new ETag (derived from inode,
mtime and size). User metadata lives in ``user.`` xattrs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TypeVar

import trio
import xxhash

from aifs import xattrs
from aifs.errors import (
    BucketNotFound,
    InvalidKey,
    LakeError,
    LakeFull,
    ObjectNotFound,
    PreconditionFailed,
)
from aifs.lake.base import ListPage, ObjectInfo, ObjectStore
from aifs.lake.localfiles import (
    ASSEMBLY,
    MAX_KEY,
    copy_pieces,
    piece,
    reach,
    tiles,
    write_all,
)

T = TypeVar("T")
STAGING = ".aifs-uploads"
TMP_PREFIX = ".aifs-tmp-"
META_XATTR = xattrs.LOCAL_META_PREFIX
MARKER_XATTR = xattrs.LOCAL_MARKER
PAGE = 1000
def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _drop_marker(path: str) -> None:
    """A deleted marker leaves an implicit directory (while it has children).
    Another delete of it at the same moment (the delete round, a rename
    clearing its way) may remove an attribute first: gone is what both want."""
    for name in os.listxattr(path):
        if name == MARKER_XATTR or name.startswith(META_XATTR):
            try:
                os.removexattr(path, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise


class LocalStore(ObjectStore):
    def __init__(self, root: str, prefix: str = "", max_threads: int = 16) -> None:
        #: the lake directory as a person names it (messages, checks)
        self.where = os.path.abspath(root)
        #: the lake directory as its files are reached: through a descriptor
        #: held open (``/proc/self/fd/N``), so a key may be as long as a path
        #: relative to it can be, however deep the directory itself lies
        self.root = self.where
        self._root_fd: int | None = None
        try:
            fd = os.open(self.where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            pass  # (none there yet: check() says so)
        else:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                self._root_fd, self.root = fd, f"/proc/self/fd/{fd}"
            else:  # no /proc: paths from the root, and keys shorter by its length
                os.close(fd)
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        # without /proc (no descriptors to reach through) a path of the lake
        # directory holds at most PATH_MAX - 1 bytes
        self.max_key_bytes = MAX_KEY if self._root_fd is not None \
            else 4095 - len(os.path.join(self.root, self.prefix).encode()) - 1
        self.keys_nest = True
        self.description = f"file://{self.where}" + (f" (prefix {self.prefix})" if prefix
                                                      else "")
        self._limiter = trio.CapacityLimiter(max_threads)
        # upload id -> ETag of the object it made, for uploads completed by
        # this process: a local call has no reply to lose, but one cancelled
        # or failed after it ran is asked about (made_by_upload). Bounded.
        self._completed: OrderedDict[str, str] = OrderedDict()
        # upload id -> its parts' places in the assembly file, and its lock
        self._places: dict[str, dict[int, tuple[int, int]]] = {}
        self._upload_locks: dict[str, threading.Lock] = {}
        self._uploads_lock = threading.Lock()

    # -- helpers --------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no such object: {self._named(exc.filename)}") from exc
        except NotADirectoryError as exc:
            raise ObjectNotFound(f"no such object: {self._named(exc.filename)}") from exc
        except OSError as exc:
            where = f": {self._named(exc.filename)}" if exc.filename else ""
            # (a write's error names no file)
            message = f"local lake {self.where}: {exc.strerror}{where}"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LakeFull(message, quota=exc.errno == errno.EDQUOT) from exc
            raise LakeError(message) from exc

    def _named(self, path: object) -> str:
        """A path as a person names it (the lake directory's own path in front)."""
        text = os.fsdecode(path) if isinstance(path, (str, bytes)) else str(path)
        return self.where + text[len(self.root):] if text.startswith(self.root) else text

    async def aclose(self) -> None:
        if self._root_fd is not None:  # later calls (none are expected) go by name
            self.root = self.where
            os.close(self._root_fd)
            self._root_fd = None

    def _parts(self, key: str) -> list[str]:
        """The names on the way to ``key``'s file, checked (InvalidKey)."""
        full = self.prefix + key
        parts = full.rstrip("/").split("/") if full.rstrip("/") else []
        for part in parts:
            if part in ("", ".", "..") or "\0" in part:
                raise InvalidKey(f"key {key!r} cannot be stored in a local lake")
        if parts and parts[0] in (STAGING,) or any(p.startswith(TMP_PREFIX) for p in parts):
            raise InvalidKey(f"key {key!r} uses a name reserved by the local lake")
        return parts

    def _reach(self, key: str, make: bool = False) -> contextlib.AbstractContextManager[str]:
        """The path of ``key``'s file or directory, good inside a ``with``
        block (:func:`aifs.lake.localfiles.reach`). Called in a worker thread.
        Without /proc, keys are short enough to go from the root by name."""
        if self._root_fd is None:
            return contextlib.nullcontext(os.path.join(self.root, *self._parts(key)))
        return reach(self.root, self._parts(key), make)

    def _info(self, key: str, path: str, st: os.stat_result, with_meta: bool) -> ObjectInfo:
        meta: dict[str, str] = {}
        if with_meta:
            try:
                for name in os.listxattr(path):
                    if name.startswith(META_XATTR):
                        meta[name[len(META_XATTR):]] = os.getxattr(path, name).decode()
            except OSError:
                pass
        return ObjectInfo(key, 0 if key.endswith("/") else st.st_size, _etag(st),
                          st.st_mtime, meta)

    def _write_atomic(self, path: str, writer: Callable[[int], None],
                      metadata: Mapping[str, str] | None) -> os.stat_result:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writer(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        try:
            return self._publish(tmp, fd, path, metadata)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @staticmethod
    def _publish(tmp: str, fd: int, path: str,
                 metadata: Mapping[str, str] | None) -> os.stat_result:
        """The written file ``tmp`` (open as ``fd``, closed here) becomes the
        object at ``path``: its metadata, made durable, renamed into place."""
        try:
            for name, value in (metadata or {}).items():
                os.setxattr(fd, META_XATTR + name, value.encode())
            os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, path)
        except IsADirectoryError as exc:
            raise InvalidKey(f"{path}: a directory of that name exists") from exc
        return st

    # -- interface ------------------------------------------------------
    async def check(self) -> None:
        if not os.path.isdir(self.root):
            raise BucketNotFound(f"local lake directory {self.where} does not exist")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise LakeError(f"local lake directory {self.where} is not readable")
        await self._run(self._drop_stale_temporaries)

    def _drop_stale_temporaries(self) -> None:
        """Uploads whose creation a crash cut short (an hour old: not another
        mount's, still being created)."""
        staging = os.path.join(self.root, STAGING)
        if not os.path.isdir(staging):
            return
        for entry in os.scandir(staging):
            if entry.name.startswith(TMP_PREFIX) and \
                    entry.stat().st_mtime < time.time() - 3600:
                shutil.rmtree(entry.path, ignore_errors=True)

    async def head(self, key: str) -> ObjectInfo:
        self._parts(key)

        def do() -> ObjectInfo:
            with self._reach(key) as path:
                st = os.stat(path)
                if key.endswith("/") != os.path.isdir(path):
                    raise FileNotFoundError(errno.ENOENT, "not found", path)
                return self._info(key, path, st, True)
        return await self._run(do)

    async def get_range(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> bytes:
        self._parts(key)

        def do() -> bytes:
            with self._reach(key) as path:
                fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                if if_match is not None and _etag(st) != if_match:
                    raise PreconditionFailed(f"{key} changed in the lake")
                return os.pread(fd, length, start)
            finally:
                os.close(fd)
        return await self._run(do)

    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectInfo:
        self._parts(key)

        def do() -> ObjectInfo:
            with self._reach(key, make=True) as path:
                return placed(path)

        def placed(path: str) -> ObjectInfo:
            if key.endswith("/"):
                if data:
                    raise InvalidKey(f"directory marker {key!r} must be empty")
                os.makedirs(path, exist_ok=True)
                os.setxattr(path, MARKER_XATTR, b"1")
                for name, value in (metadata or {}).items():
                    os.setxattr(path, META_XATTR + name, value.encode())
                return self._info(key, path, os.stat(path), False)

            st = self._write_atomic(path, lambda fd: write_all(fd, data, 0), metadata)
            return ObjectInfo(key, st.st_size, _etag(os.stat(path)), st.st_mtime,
                              dict(metadata or {}))
        return await self._run(do)

    def _staging(self, upload_id: str) -> str:
        if not upload_id.isalnum():
            raise InvalidKey(f"bad upload id {upload_id!r}")
        return os.path.join(self.root, STAGING, upload_id)

    async def create_multipart(self, key: str,
                               metadata: dict[str, str] | None = None) -> str:
        self._parts(key)
        upload_id = uuid.uuid4().hex

        def do() -> str:
            # Built under a temporary name and renamed: an upload is never
            # visible without its key (a crash may come at any point).
            staging = self._staging(upload_id)
            tmp = os.path.join(os.path.dirname(staging), f"{TMP_PREFIX}{upload_id}")
            os.makedirs(tmp)
            with open(os.path.join(tmp, "key"), "w") as fp:
                fp.write(key)
            for name, value in (metadata or {}).items():
                os.setxattr(tmp, META_XATTR + name, value.encode())
            os.rename(tmp, staging)
            return upload_id
        return await self._run(do)

    async def upload_part(self, key: str, upload_id: str, part_number: int,
                          data: bytes, offset: int | None = None) -> str:
        if not 1 <= part_number <= 10000:
            raise InvalidKey(f"part number {part_number} out of range")
        staging = self._staging(upload_id)

        if offset is not None and offset < 0:
            raise InvalidKey(f"part {part_number} at a negative offset")

        def do() -> str:
            if not os.path.isdir(staging):
                raise ObjectNotFound(f"no such upload {upload_id}")
            with self._placing(upload_id) as places:
                if offset is None or not self._write_in_place(staging, places, part_number,
                                                              data, offset):
                    tmp = os.path.join(staging, f"{TMP_PREFIX}{uuid.uuid4().hex}")
                    with open(tmp, "wb") as fp:
                        fp.write(data)
                    os.rename(tmp, os.path.join(staging, f"part-{part_number:05d}"))
                    places.pop(part_number, None)
            return xxhash.xxh3_64_hexdigest(data)
        return await self._run(do)

    @contextlib.contextmanager
    def _placing(self, upload_id: str) -> Iterator[dict[int, tuple[int, int]]]:
        """Where each part of ``upload_id`` sent with its offset lies in the
        assembly file, held so that no two parts of the upload are placed at
        once. Kept in memory only: an upload is completed by the process
        that made it (a mount aborts those a crash left, by their ids); a
        part another process placed is one never sent (ObjectNotFound)."""
        with self._uploads_lock:
            lock = self._upload_locks.setdefault(upload_id, threading.Lock())
            places = self._places.setdefault(upload_id, {})
        with lock:
            yield places

    def _forget_upload(self, upload_id: str) -> None:
        with self._uploads_lock:
            self._upload_locks.pop(upload_id, None)
            self._places.pop(upload_id, None)

    @staticmethod
    def _write_in_place(staging: str, places: dict[int, tuple[int, int]], part_number: int,
                        data: bytes, offset: int) -> bool:
        """A part whose place in the object is known goes there at once, in
        the upload's one assembly file (``places`` says where). Completing
        such an upload is then a rename: the object's bytes are written once
        (parts in files of their own were read back and written again, 1 GiB
        more of the disk's time per GiB promoted). False, and nothing written,
        where the part would cover bytes of another part (one sent again
        longer or elsewhere): it then goes to a file of its own, as on S3
        every part is independent of the others."""
        end = offset + len(data)
        if any(number != part_number and at < end and offset < at + length
               for number, (at, length) in places.items()):
            return False
        fd = os.open(os.path.join(staging, ASSEMBLY), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            write_all(fd, data, offset)
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):  # (sent before without its offset)
            os.unlink(os.path.join(staging, f"part-{part_number:05d}"))
        places[part_number] = (offset, len(data))
        return True

    async def complete_multipart(self, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo:
        self._parts(key)
        staging = self._staging(upload_id)

        def do() -> ObjectInfo:
            with self._reach(key, make=True) as path:
                return completed(path)

        def completed(path: str) -> ObjectInfo:
            if not os.path.isdir(staging):
                raise ObjectNotFound(f"no such upload {upload_id}")
            metadata = {n[len(META_XATTR):]: os.getxattr(staging, n).decode()
                        for n in os.listxattr(staging) if n.startswith(META_XATTR)}
            with self._placing(upload_id) as places:
                pieces = [piece(staging, places, number) for number, _ in sorted(parts)]
            st = None
            if tiles(pieces):
                st = self._rename_assembly(staging, path, pieces[-1][1] + pieces[-1][2],
                                           metadata)
            if st is None:
                st = self._write_atomic(path, lambda fd: copy_pieces(fd, staging, pieces),
                                        metadata)
            shutil.rmtree(staging, ignore_errors=True)
            self._forget_upload(upload_id)
            info = ObjectInfo(key, st.st_size, _etag(os.stat(path)), st.st_mtime, metadata)
            self._completed[upload_id] = info.etag
            while len(self._completed) > 1024:
                self._completed.popitem(last=False)
            return info
        return await self._run(do)

    def _rename_assembly(self, staging: str, path: str, size: int,
                         metadata: dict[str, str]) -> os.stat_result | None:
        """The assembly file, cut to the object's size, becomes the object;
        None where it cannot be renamed there (the key's directory is another
        mount: EXDEV), and the caller copies it."""
        assembly = os.path.join(staging, ASSEMBLY)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        where = os.stat(directory)
        fd = os.open(assembly, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)  # a part sent again shorter left bytes past the end
            if where.st_mode & stat.S_ISGID:  # the group a file made there would get
                os.fchown(fd, -1, where.st_gid)
        except BaseException:
            os.close(fd)
            raise
        try:
            return self._publish(assembly, fd, path, metadata)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            return None

    def made_by_upload(self, info: ObjectInfo, upload_id: str,
                       parts: list[tuple[int, str]]) -> bool:
        return self._completed.get(upload_id) == info.etag

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        staging = self._staging(upload_id)
        await self._run(shutil.rmtree, staging, True)
        self._forget_upload(upload_id)

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        staging_root = os.path.join(self.root, STAGING)

        def do() -> list[tuple[str, str, float]]:
            found = []
            for entry in os.scandir(staging_root) if os.path.isdir(staging_root) else []:
                if not entry.name.isalnum():
                    continue  # one being created
                try:
                    with open(os.path.join(entry.path, "key")) as fp:
                        key = fp.read()
                    if key.startswith(prefix):
                        found.append((key, entry.name, entry.stat().st_mtime))
                except FileNotFoundError:
                    continue
            return found
        return await self._run(do)

    async def list_page(self, prefix: str, delimiter: str | None = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage:
        entries = await self._run(self._list_all, prefix, delimiter)
        if token:
            entries = [e for e in entries if (e if isinstance(e, str) else e.key) > token]
        page, rest = entries[:max_keys], entries[max_keys:]
        return self._page(page, bool(rest))

    async def iter_list(self, prefix: str,
                        delimiter: str | None = "/") -> AsyncIterator[ListPage]:
        # One directory scan for the whole listing, served in pages.
        entries = await self._run(self._list_all, prefix, delimiter)
        for start in range(0, max(len(entries), 1), PAGE):
            yield self._page(entries[start:start + PAGE], start + PAGE < len(entries))

    @staticmethod
    def _page(entries: list[ObjectInfo | str], more: bool) -> ListPage:
        objects = [e for e in entries if isinstance(e, ObjectInfo)]
        prefixes = [e for e in entries if isinstance(e, str)]
        last = entries[-1] if entries else None
        token = (last if isinstance(last, str) else last.key) if more and last else None
        return ListPage(objects, prefixes, token)

    def _list_all(self, prefix: str, delimiter: str | None) -> list[ObjectInfo | str]:
        """Sorted objects and common prefixes under ``prefix`` (S3 order)."""
        dir_part, _, start = prefix.rpartition("/")
        dir_key = dir_part + "/" if dir_part else ""
        try:
            self._parts(dir_key)
        except InvalidKey:
            return []
        out: list[ObjectInfo | str] = []
        if delimiter is None:
            self._walk(dir_key, start, out)
        elif delimiter == "/":
            self._scan(dir_key, start, out)
        else:
            raise InvalidKey("the local lake supports only '/' as delimiter")
        out.sort(key=lambda e: e if isinstance(e, str) else e.key)
        return out

    def _scan(self, dir_key: str, start: str, out: list[ObjectInfo | str]) -> None:
        try:
            with self._reach(dir_key) as directory:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            self._scan_fd(fd, dir_key, start, out)
        finally:
            os.close(fd)

    def _scan_fd(self, fd: int, dir_key: str, start: str, out: list[ObjectInfo | str]) -> None:
        top = self.prefix + dir_key == ""
        with os.scandir(fd) as it:  # (its entries stat relative to the descriptor)
            for entry in it:  # (once per object of a walk: what _info does, inline)
                name = entry.name
                if not name.startswith(start) or name.startswith(TMP_PREFIX) or (
                        top and name == STAGING):
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        out.append(dir_key + name + "/")
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        out.append(ObjectInfo(dir_key + name, st.st_size, _etag(st),
                                              st.st_mtime))
                except FileNotFoundError:
                    continue

    def _walk(self, dir_key: str, start: str, out: list[ObjectInfo | str]) -> None:
        found: list[ObjectInfo | str] = []
        self._scan(dir_key, start, found)
        if dir_key and not start:
            try:
                with self._reach(dir_key) as directory:
                    if os.path.isdir(directory) and (
                            not found or MARKER_XATTR in os.listxattr(directory)):
                        out.append(self._info(dir_key, directory, os.stat(directory), False))
            except (FileNotFoundError, NotADirectoryError):
                pass  # gone meanwhile (a directory on the way too)
        for item in found:
            if isinstance(item, str):
                self._walk(item, "", out)
            else:
                out.append(item)

    async def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            self._parts(key)

        def do() -> None:
            for key in keys:
                try:
                    with self._reach(key) as path:
                        if key.endswith("/"):
                            _drop_marker(path)
                            os.rmdir(path)
                        else:
                            os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                        raise
                # drop now-empty implicit parent directories (not markers), as S3 would
                parent = key.rstrip("/").rpartition("/")[0]
                while parent:
                    try:
                        with self._reach(parent + "/") as path:
                            if MARKER_XATTR in os.listxattr(path):
                                break
                            os.rmdir(path)
                    except OSError:
                        break
                    parent = parent.rpartition("/")[0]
        await self._run(do)

    async def copy(self, src: str, dst: str,
                   metadata: dict[str, str] | None = None) -> str:
        self._parts(src)
        self._parts(dst)

        def do() -> str:
            with self._reach(src) as src_path, self._reach(dst, make=True) as dst_path:
                return copied(src_path, dst_path)

        def copied(src_path: str, dst_path: str) -> str:
            src_info = self._info(src, src_path, os.stat(src_path), True)
            meta = src_info.metadata if metadata is None else metadata
            if src.endswith("/") or dst.endswith("/"):
                if not (src.endswith("/") and dst.endswith("/") and os.path.isdir(src_path)):
                    raise InvalidKey(f"cannot copy {src!r} to {dst!r}")
                os.makedirs(dst_path, exist_ok=True)
                os.setxattr(dst_path, MARKER_XATTR, b"1")
                for name, value in meta.items():
                    os.setxattr(dst_path, META_XATTR + name, value.encode())
                return self._info(dst, dst_path, os.stat(dst_path), False).etag

            def write(fd: int) -> None:
                with open(src_path, "rb") as fp:
                    while chunk := fp.read(1 << 22):
                        os.write(fd, chunk)
            self._write_atomic(dst_path, write, meta)
            return _etag(os.stat(dst_path))
        return await self._run(do)
