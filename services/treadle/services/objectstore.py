"""The object store: one interface, two backends (local directory, S3 via ``minio``).

Objects are immutable blobs addressed by key. Every write returns an ``ObjectRef``
(URI + sha256 + size) and every read through a ref verifies both, so corrupted or
swapped bytes raise ``IntegrityError`` instead of flowing on. A *published directory*
(weights, checkpoints) is a set of files under a prefix plus a ``MANIFEST.json`` written
last: readers that find the manifest know every file it lists is complete.

Local writes go to a temporary file and are renamed into place, so a reader never sees
a partial object. S3 puts are atomic per object by the protocol.

Outages (design invariant 2: they cost time, never data): a store that does not answer
for now (S3 down or restarting, a 5xx, a local disk that went read-only) raises
``StoreUnreachableError``, and every operation of a store that services use
(``open_store``) retries it with backoff for ``patience_s`` (``OUTAGE_PATIENCE_S``)
before raising it: a service waits out an outage of minutes where it is (its bus
messages kept in progress by their heartbeats) instead of failing or giving messages up.
Errors that retrying cannot fix (credentials, a missing bucket, a missing object, a
sha256 mismatch) are raised at once; so is anything during ``open_store``'s first check,
so that a wrong endpoint fails fast.

The API is synchronous (minio is); async code calls it through ``asyncio.to_thread``.
Not here: caching, garbage collection of old objects, multipart tuning.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from treadle.proto.v1 import common_pb2
from treadle.services.errors import (
    IntegrityError,
    ObjectNotFoundError,
    StoreUnavailableError,
    StoreUnreachableError,
)
from treadle.services.sections import ObjectStoreSection

log = logging.getLogger(__name__)
T = TypeVar("T")

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "treadle-manifest/1"
MANIFEST_MEDIA_TYPE = "application/json; type=treadle-manifest"
_CHUNK = 1 << 20
OUTAGE_PATIENCE_S = 600.0  # seconds open_store's stores retry an unreachable store
# errnos of a local store that may pass: read-only (remount), I/O error, full, stale NFS
_OUTAGE_ERRNOS = {errno.EROFS, errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.ESTALE,
                  errno.ETIMEDOUT, errno.ENOTCONN, errno.EAGAIN}  # fmt: skip

ObjectRef = common_pb2.ObjectRef


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object."""

    key: str  # key relative to the store root/prefix
    size_bytes: int


@dataclass(frozen=True)
class ManifestEntry:
    """One file of a published directory."""

    path: str  # relative path inside the directory, '/'-separated
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Manifest:
    """A published directory: its files (with hashes) and free-form metadata."""

    prefix: str
    files: tuple[ManifestEntry, ...]
    metadata: Mapping[str, Any]
    created_at: float

    def to_json(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "prefix": self.prefix,
            "created_at": self.created_at,
            "metadata": dict(self.metadata),
            "files": [
                {"path": f.path, "sha256": f.sha256, "size_bytes": f.size_bytes} for f in self.files
            ],
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(data)
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
            files = tuple(
                ManifestEntry(str(f["path"]), str(f["sha256"]), int(f["size_bytes"]))
                for f in doc["files"]
            )
            return cls(
                str(doc["prefix"]), files, dict(doc.get("metadata", {})), float(doc["created_at"])
            )
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"manifest {where} is malformed: {e}") from None


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex sha256, size) of a file, streamed."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}: use relative 'a/b/c' paths without '..'")
    return key


def _check_ref(ref: ObjectRef) -> None:
    if not _SHA256_HEX.fullmatch(ref.sha256):
        raise IntegrityError(
            f"{ref.uri[:200]}: the reference carries no valid sha256 ({ref.sha256[:80]!r}); "
            "refusing to read an object that cannot be verified"
        )


def _verify(data: bytes, ref: ObjectRef) -> bytes:
    if ref.size_bytes and len(data) != ref.size_bytes:
        raise IntegrityError(
            f"{ref.uri}: size is {len(data)} bytes, reference says {ref.size_bytes}"
        )
    digest = sha256_bytes(data)
    if ref.sha256 and digest != ref.sha256:
        raise IntegrityError(
            f"{ref.uri}: sha256 is {digest}, reference says {ref.sha256} "
            "(corrupted or replaced object; refusing to use it)"
        )
    return data


class ObjectStore(ABC):
    """Immutable blobs by key; refs carry integrity data."""

    patience_s: float = 0.0
    """Seconds an operation retries while the store is unreachable (0: raise at once)."""

    def _patiently(self, what: str, op: Callable[[], T]) -> T:
        """``op()``, retried with backoff while it raises StoreUnreachableError, for up to
        ``patience_s``; logs when the outage starts and ends."""
        if self.patience_s <= 0:
            return op()
        deadline = time.monotonic() + self.patience_s
        delay = 0.5
        started = 0.0
        while True:
            try:
                result = op()
            except StoreUnreachableError as e:
                now = time.monotonic()
                if now + delay > deadline:
                    raise StoreUnreachableError(
                        f"{e} (still failing after {self.patience_s:.0f}s of retries)"
                    ) from None
                if not started:
                    started = now
                    log.warning("object store unreachable on %s (%s); retrying for up to %.0fs",
                                what, e, self.patience_s)  # fmt: skip
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if started:
                log.info("object store reachable again (%s, after %.1fs)", what,
                         time.monotonic() - started)  # fmt: skip
            return result

    # --- backend primitives -------------------------------------------------------------
    @abstractmethod
    def uri(self, key: str) -> str:
        """URI of ``key`` (file:///... or s3://bucket/...)."""

    @abstractmethod
    def key_of(self, uri: str) -> str:
        """Inverse of ``uri``; ValueError if the URI belongs to another store."""

    @abstractmethod
    def _write_stream(self, key: str, stream: BinaryIO, size: int, media_type: str) -> None: ...

    @abstractmethod
    def _open(self, key: str) -> Iterator[bytes]:
        """Yield the object's bytes in chunks; ObjectNotFoundError if absent."""

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _list(self, prefix: str) -> list[ObjectInfo]: ...

    # --- operations built on them --------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._patiently(f"stat {key}", lambda: self._exists(_check_key(key)))

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if absent)."""
        self._patiently(f"delete {key}", lambda: self._delete(_check_key(key)))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key."""
        return self._patiently(f"list {prefix or '/'}", lambda: self._list(prefix))

    def delete_dir(self, prefix: str, objects: Sequence[ObjectInfo] | None = None) -> int:
        """Remove the directory ``prefix`` (every object under ``prefix/``; ``objects``:
        those objects when the caller has listed them), its manifest first so that it
        stops counting as published before any of its files goes. Returns how many."""
        prefix = _check_key(prefix.rstrip("/")) + "/"
        found = self.list(prefix) if objects is None else objects
        keys = sorted((o.key for o in found if o.key.startswith(prefix)),
                      key=lambda k: k != prefix + MANIFEST_NAME)  # fmt: skip
        for key in keys:
            self.delete(key)
        self._forget_dir(prefix)
        return len(keys)

    def _forget_dir(self, prefix: str) -> None:  # noqa: B027 (a hook; most backends keep nothing)
        """After ``delete_dir``: what the backend keeps of an emptied directory (none)."""

    def put_bytes(self, key: str, data: bytes, media_type: str = "") -> ObjectRef:
        _check_key(key)
        self._patiently(
            f"put {key}", lambda: self._write_stream(key, io.BytesIO(data), len(data), media_type)
        )
        return ObjectRef(
            uri=self.uri(key),
            sha256=sha256_bytes(data),
            size_bytes=len(data),
            media_type=media_type,
        )

    def put_file(self, key: str, path: Path, media_type: str = "") -> ObjectRef:
        _check_key(key)
        digest, size = sha256_file(path)

        def put() -> None:
            with path.open("rb") as f:
                self._write_stream(key, f, size, media_type)

        self._patiently(f"put {key}", put)
        return ObjectRef(uri=self.uri(key), sha256=digest, size_bytes=size, media_type=media_type)

    def get_bytes(self, ref: ObjectRef | str) -> bytes:
        """Read an object. Given an ObjectRef, verify its sha256 and size (a ref without a
        well-formed sha256 is refused: it could not be verified)."""
        if isinstance(ref, str):
            key = _check_key(ref)
            return self._patiently(f"get {key}", lambda: b"".join(self._open(key)))
        _check_ref(ref)
        key = self.key_of(ref.uri)
        data = self._patiently(f"get {key}", lambda: b"".join(self._open(key)))
        return _verify(data, ref)

    def get_file(self, ref: ObjectRef, dest: Path) -> Path:
        """Stream an object into ``dest`` (verified; nothing left behind on mismatch)."""
        _check_ref(ref)
        key = self.key_of(ref.uri)
        dest.parent.mkdir(parents=True, exist_ok=True)
        return self._patiently(f"get {key}", lambda: self._get_file(ref, key, dest))

    def _get_file(self, ref: ObjectRef, key: str, dest: Path) -> Path:
        h = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in self._open(key):
                    h.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
            if (ref.size_bytes and size != ref.size_bytes) or (
                ref.sha256 and h.hexdigest() != ref.sha256
            ):
                raise IntegrityError(
                    f"{ref.uri}: got {size} bytes with sha256 {h.hexdigest()}, reference says "
                    f"{ref.size_bytes} bytes with sha256 {ref.sha256}"
                )
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dest

    def publish_dir(
        self,
        prefix: str,
        files: Mapping[str, Path | bytes],
        metadata: Mapping[str, Any] | None = None,
    ) -> ObjectRef:
        """Upload ``files`` (relative path -> file or bytes) under ``prefix``, manifest last.

        Returns the ref of the manifest; that ref is what travels on the bus.
        """
        prefix = _check_key(prefix.rstrip("/"))
        if MANIFEST_NAME in files:
            raise ValueError(f"{MANIFEST_NAME} is reserved for the manifest itself")
        entries = []
        for rel in sorted(files):
            src = files[rel]
            key = f"{prefix}/{_check_key(rel)}"
            ref = (
                self.put_bytes(key, src)
                if isinstance(src, bytes)
                else self.put_file(key, Path(src))
            )
            entries.append(ManifestEntry(rel, ref.sha256, ref.size_bytes))
        manifest = Manifest(prefix, tuple(entries), dict(metadata or {}), time.time())
        return self.put_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.to_json(), MANIFEST_MEDIA_TYPE)

    def read_manifest(self, ref: ObjectRef | str) -> Manifest:
        """Read a manifest by ref (verified) or by its directory prefix (unverified)."""
        if isinstance(ref, str):
            key = f"{ref.rstrip('/')}/{MANIFEST_NAME}"
            if not self.exists(key):
                raise ObjectNotFoundError(
                    f"no published directory at {self.uri(ref)}: {MANIFEST_NAME} is missing "
                    "(never published, or publication did not finish)"
                )
            return Manifest.from_json(self.get_bytes(key), self.uri(key))
        return Manifest.from_json(self.get_bytes(ref), ref.uri)

    def fetch_dir(self, ref: ObjectRef | str, dest: Path) -> Manifest:
        """Download a published directory into ``dest``, verifying every file."""
        manifest = self.read_manifest(ref)
        for entry in manifest.files:
            file_ref = ObjectRef(
                uri=self.uri(f"{manifest.prefix}/{entry.path}"),
                sha256=entry.sha256,
                size_bytes=entry.size_bytes,
            )
            self.get_file(file_ref, dest / entry.path)
        return manifest


class LocalObjectStore(ObjectStore):
    """Objects as files under a root directory."""

    def __init__(self, root: Path, shared_read: bool = False):
        self.root = root.resolve()
        self.file_mode = 0o644 if shared_read else 0o600  # object_store.shared_read
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StoreUnavailableError(
                f"local object store {root}: it or a folder above it is a file "
                "(check run.output_dir / object_store settings)"
            ) from None
        except PermissionError as e:
            raise StoreUnavailableError(
                f"local object store {root}: cannot create it ({e.strerror})"
            ) from None

    def uri(self, key: str) -> str:
        return (self.root / key).as_uri()

    def key_of(self, uri: str) -> str:
        prefix = self.root.as_uri() + "/"
        if not uri.startswith(prefix):
            raise ValueError(f"{uri} is not inside the local object store at {self.root}")
        from urllib.parse import unquote

        return _check_key(unquote(uri[len(prefix) :]))

    def _path(self, key: str) -> Path:
        """The file of ``key``; a key whose path goes through a symlink is refused, so an
        object can never be read from or written to outside the root."""
        path = self.root / _check_key(key)
        at = self.root
        for part in path.relative_to(self.root).parts:
            at = at / part
            if at.is_symlink():
                raise ValueError(
                    f"object key {key!r} goes through a symlink ({at}); the local object store "
                    "does not follow symlinks"
                )
        return path

    def _os_error(self, what: str, e: OSError) -> StoreUnavailableError:
        """``e`` as a typed error: an outage that may pass (read-only, I/O error, full) is
        StoreUnreachableError, anything else StoreUnavailableError."""
        cls = StoreUnreachableError if e.errno in _OUTAGE_ERRNOS else StoreUnavailableError
        return cls(f"local object store {self.root}: cannot {what}: {e.strerror or e}")

    def _write_stream(self, key: str, stream: BinaryIO, size: int, media_type: str) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        except OSError as e:
            raise self._os_error(f"write {key}", e) from None
        try:
            with os.fdopen(fd, "wb") as f:
                if self.file_mode != 0o600:  # mkstemp's
                    os.fchmod(f.fileno(), self.file_mode)
                shutil.copyfileobj(stream, f, _CHUNK)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise self._os_error(f"write {key}", e) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _open(self, key: str) -> Iterator[bytes]:
        path = self._path(key)
        try:
            f = os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"object not found: {self.uri(key)}") from None
        except OSError as e:
            raise self._os_error(f"read {key}", e) from None
        with f:
            try:
                while chunk := f.read(_CHUNK):
                    yield chunk
            except OSError as e:
                raise self._os_error(f"read {key}", e) from None

    def _exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise self._os_error(f"delete {key}", e) from None

    def _forget_dir(self, prefix: str) -> None:
        """Remove the emptied folders of ``prefix`` (a folder something was written
        into meanwhile stays)."""
        top = self._path(prefix.rstrip("/"))
        if not top.is_dir():
            return
        for folder in [*sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True), top]:
            try:
                folder.rmdir()
            except OSError:  # not empty
                pass

    def _list(self, prefix: str) -> list[ObjectInfo]:
        # the walk starts at the prefix's folder, not the root: a run's store holds a
        # folder per policy version and checkpoint, and callers list one kind of them
        top = self.root
        for part in prefix.split("/")[:-1]:
            top = top / part
            try:
                if not stat.S_ISDIR(top.lstat().st_mode):  # absent, a file, or a link
                    return []
            except (FileNotFoundError, NotADirectoryError):
                return []
        out = []
        for path in top.rglob("*"):  # does not descend linked folders
            # lstat: a symlink planted in the store is no object (and its target's size
            # is not ours to report)
            try:
                st = path.lstat()
            except FileNotFoundError:  # renamed or deleted since the walk saw it
                continue
            if not stat.S_ISREG(st.st_mode) or path.name.endswith(".part"):
                continue
            key = path.relative_to(self.root).as_posix()
            if key.startswith(prefix):
                out.append(ObjectInfo(key, st.st_size))
        return sorted(out, key=lambda o: o.key)


class S3ObjectStore(ObjectStore):
    """Objects in an S3 bucket (MinIO, AWS S3, SeaweedFS, ...) through the minio client."""

    def __init__(self, cfg: ObjectStoreSection, prefix: str):
        import urllib3
        from minio import Minio

        if cfg.endpoint is None or cfg.access_key is None or cfg.secret_key is None:
            raise ValueError("the s3 backend needs endpoint, access_key and secret_key")
        endpoint = cfg.endpoint
        secure = cfg.secure
        for scheme in ("http://", "https://"):
            if endpoint.startswith(scheme):
                endpoint, secure = endpoint[len(scheme) :].rstrip("/"), scheme == "https://"
        self.endpoint = endpoint
        self.bucket = cfg.bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=cfg.connect_timeout_s, read=cfg.timeout_s),
            retries=urllib3.Retry(
                total=cfg.max_retries, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)
            ),
        )
        self._client = Minio(
            endpoint,
            access_key=cfg.access_key,
            secret_key=cfg.secret_key.get_secret_value(),
            secure=secure,
            region=cfg.region,
            http_client=http,
        )
        self._create_bucket = cfg.create_bucket
        self._bucket_checked = False

    # errors: translate the client's exceptions into ours, with what to do
    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from minio.error import S3Error
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchObject"):
                raise ObjectNotFoundError(f"object not found: {what}") from None
            if e.code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"):
                raise StoreUnavailableError(
                    f"S3 at {self.endpoint} rejected the request for {what} ({e.code}): "
                    "check object_store.access_key / object_store.secret_key"
                ) from None
            if e.code == "NoSuchBucket":
                raise StoreUnavailableError(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint}: create it or set "
                    "object_store.create_bucket = true"
                ) from None
            status = int(getattr(e.response, "status", 0) or 0)
            cls = StoreUnreachableError if status >= 500 else StoreUnavailableError
            raise cls(f"S3 at {self.endpoint} failed on {what}: {e.code}: {e.message}") from None
        except HTTPError as e:
            raise StoreUnreachableError(
                f"cannot reach S3 at {self.endpoint} ({what}): {type(e).__name__}: {e}. "
                "Is the server running and object_store.endpoint right?"
            ) from None

    def _ensure_bucket(self) -> None:
        if self._bucket_checked:
            return
        if not self._call(f"bucket {self.bucket}", self._client.bucket_exists, self.bucket):
            if not self._create_bucket:
                raise StoreUnavailableError(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint} and "
                    "object_store.create_bucket is false"
                )
            self._call(f"create bucket {self.bucket}", self._make_bucket_if_absent)
        self._bucket_checked = True

    def _make_bucket_if_absent(self) -> None:
        """Create the bucket; another service creating it at the same moment is success.

        Services started together (compose, the launcher) all find the bucket missing and
        race to create it: the losers get BucketAlreadyOwnedByYou (or, from some servers,
        BucketAlreadyExists). Either way the bucket is there; a bucket we cannot see with
        these credentials is still an error.
        """
        from minio.error import S3Error

        try:
            self._client.make_bucket(self.bucket)
        except S3Error as e:
            if e.code == "BucketAlreadyOwnedByYou":
                return
            if e.code == "BucketAlreadyExists" and self._client.bucket_exists(self.bucket):
                return
            raise

    def check(self) -> None:
        """Fail fast with a clear error when the endpoint, credentials or bucket are wrong."""
        self._ensure_bucket()

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def key_of(self, uri: str) -> str:
        head = f"s3://{self.bucket}/{self.prefix}"
        if not uri.startswith(head):
            raise ValueError(f"{uri} is not inside s3://{self.bucket}/{self.prefix}")
        return _check_key(uri[len(head) :])

    def _write_stream(self, key: str, stream: BinaryIO, size: int, media_type: str) -> None:
        self._ensure_bucket()
        self._call(
            self.uri(key),
            self._client.put_object,
            self.bucket,
            self.prefix + key,
            stream,
            size,
            content_type=media_type or "application/octet-stream",
        )

    def _open(self, key: str) -> Iterator[bytes]:
        self._ensure_bucket()
        from urllib3.exceptions import HTTPError

        resp = self._call(self.uri(key), self._client.get_object, self.bucket, self.prefix + key)
        try:
            yield from resp.stream(_CHUNK)
        except HTTPError as e:  # the connection broke mid-object
            raise StoreUnreachableError(
                f"S3 at {self.endpoint} broke off reading {self.uri(key)}: {type(e).__name__}: {e}"
            ) from None
        finally:
            resp.close()
            resp.release_conn()

    def _exists(self, key: str) -> bool:
        self._ensure_bucket()
        try:
            self._call(self.uri(key), self._client.stat_object, self.bucket, self.prefix + key)
        except ObjectNotFoundError:
            return False
        return True

    def _delete(self, key: str) -> None:
        self._ensure_bucket()
        self._call(self.uri(key), self._client.remove_object, self.bucket, self.prefix + key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        self._ensure_bucket()
        objs = self._call(
            f"list {self.uri(prefix)}",
            lambda: list(
                self._client.list_objects(self.bucket, prefix=self.prefix + prefix, recursive=True)
            ),
        )
        return sorted(
            (ObjectInfo(o.object_name[len(self.prefix) :], int(o.size or 0)) for o in objs),
            key=lambda o: o.key,
        )


def open_store(cfg: ObjectStoreSection, run_name: str, run_dir: Path) -> ObjectStore:
    """The store a run's config asks for (local: <run_dir>/store by default)."""
    if cfg.backend == "local":
        local = LocalObjectStore(cfg.root or run_dir / "store", cfg.shared_read)
        local.patience_s = OUTAGE_PATIENCE_S
        return local
    store = S3ObjectStore(cfg, cfg.prefix if cfg.prefix is not None else f"{run_name}/")
    store.check()  # at once: a wrong endpoint or key fails fast
    store.patience_s = OUTAGE_PATIENCE_S
    return store
