"""The shared store: one content-addressed store that several machines publish to and fetch from.

Each machine's ``ArtifactStore`` under ``<work>/store`` is its cache of the shared store (vLLM and
safetensors read local files). The shared store is an S3 bucket (``s3://bucket[/prefix]``: any
S3-compatible server; credentials and endpoint come from the environment boto3 reads,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``) or a directory on a mount every
machine sees (an absolute path or ``file:///path``: NFS, Lustre, JuiceFS). It is named by the run
config's ``store.uri`` (a resource field: never part of a key or the run id). Inside it::

    blobs/<sha256[:2]>/<sha256>      a file's bytes, named by their sha256 (shared by every artifact)
    manifests/<stage>/<key>.json     an artifact's manifest: its files' digests; written once
    runs/<run_id>/run.json           a run's record, overwritten by the holder of the run's lock

Publish (``publish``): the blobs go first, each skipped when it exists already (a blob's name is its
content); the manifest goes last and only if absent: on S3 a conditional put (``If-None-Match: *``;
a 412 means another writer won), on a mount a temp file in the manifest's folder hard-linked to the
final name (``link`` fails when the name exists) and then unlinked. Whoever lost adopts the winner's
manifest after checking it describes a complete artifact (every blob it names is there). A reader
never sees a manifest whose blobs are missing: the blobs were there before it.

Correct without the condition: a writer looks for the manifest before its blobs go up and again
just before its put, and after the put reads the manifest back and uses what it reads, so a server
that ignores ``If-None-Match`` (or a mount whose ``link`` is not atomic) cannot make it use a
manifest that is not in the store. What holds then: every manifest the store ever holds is complete
(each writer's blobs precede its manifest, and blobs are never deleted), and every publisher ends
with a complete artifact; but writers whose puts land within a few milliseconds of each other may
each read back their own manifest and use different bytes, the store keeping the last. With the
fleet database the build lock (``qerl.pipeline.fleet.coordination.build_lock``) keeps two machines
from building one key at once, so that race needs a server that ignores the condition and a fleet
without its database. SeaweedFS 4.48 honours the condition, also for concurrent puts (the fleet
suite checks it).

Fetch (``fetch``): the manifest is read, each file's blob is streamed into a folder under the local
store's tmp/, hashed while it is written, and refused (``BlobMismatchError``, an ``ArtifactError``
naming the key, the file and both digests) when its sha256 is not the manifest's; then the manifest
is written and the folder renamed into objects/, as ``ArtifactStore.produce`` does. The local
manifest is the shared one with the local files' sizes and mtimes. Files that retention pruned
(``Manifest.pruned``) are neither published nor fetched.

Before a manifest or a run record is published, ``qerl.pipeline.fleet.coordination.ensure_leases``
checks that this process still holds its run lease (``LeaseLostError`` otherwise), so a machine
whose night was taken over stops publishing.

Transport: one boto3 client per ``S3Store``, with short connect and read timeouts; a request that
cannot reach the server, times out or gets a 5xx is tried again for up to ``retry_s`` (30 s) in all,
so a restarted server is ridden out, a dead one is an error (``SharedStoreError``, naming the store
and the object, never a credential).

Limits: nothing deletes from the shared store (retention, ``qerl gc``, works on the local cache only:
the shared store's blobs and manifests stay until removed by hand); a local prune, heal or re-key
is not published.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar
from urllib.parse import urlsplit

from qerl.pipeline.store.files import (
    atomic_write_bytes,
    atomic_write_text,
    disk_full,
    fsync_dir,
    human_bytes,
    is_disk_full,
)
from qerl.pipeline.store.layout import MANIFEST, TMP_DIR
from qerl.pipeline.store.manifest import ArtifactError, FileRecord, Manifest

if TYPE_CHECKING:
    from qerl.pipeline.store.artifact_store import ArtifactStore

log = logging.getLogger("qerl.artifacts")

BLOBS = "blobs"
MANIFESTS = "manifests"
RUNS = "runs"
RECORD = "run.json"
_CHUNK = 1 << 20
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
T = TypeVar("T")


class SharedStoreError(RuntimeError):
    """The shared store could not be read or written; names the store and the object, no secret."""


class BlobMismatchError(ArtifactError):
    """A fetched file's sha256 is not its manifest's: the shared store's blob is corrupt."""

    def __init__(self, message: str, expected: str):
        super().__init__(message)
        self.expected = expected

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.expected))


class SharedStore(Protocol):
    """Where the fleet's artifacts are: paths are ``/``-separated, relative to the store's root."""

    def describe(self) -> str:
        """The store's URI (and endpoint), without any secret."""
        ...

    def read(self, path: str) -> bytes | None:
        """The object at ``path``, None when there is none."""
        ...

    def write(self, path: str, data: bytes) -> None:
        """Put ``data`` at ``path``, replacing what is there."""
        ...

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Put ``data`` at ``path`` unless something is there; whether this call created it."""
        ...

    def has(self, path: str) -> bool: ...

    def upload(self, path: str, src: Path) -> None:
        """Put the file ``src`` at ``path`` (replacing what is there)."""
        ...

    def download(self, path: str, dest: Path) -> str:
        """Stream the object at ``path`` into the new file ``dest``; returns the sha256 of the bytes
        written (hashed while writing). A missing object is a ``FileNotFoundError``."""
        ...

    def paths(self, prefix: str) -> list[str]:
        """Every object path under ``prefix`` (a folder: ``runs/``)."""
        ...


# ---- the URI ----------------------------------------------------------------------------------------
def check_uri(uri: str) -> str | None:
    """``uri`` if it names a shared store qerl can open (``s3://bucket[/prefix]``, an absolute path,
    ``file:///abs/path``), None if it is blank (unset); else a ``ValueError`` that says why and never
    repeats a credential."""
    text = uri.strip()
    if not text:
        return None
    if "://" not in text:
        if not text.startswith("/"):
            raise ValueError(
                f"store.uri '{text}' is a relative path: a shared mount must be named by an absolute "
                "path (or file:///abs/path)"
            )
        return text
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if "@" in parts.netloc:
        shown = f"{scheme}://***@{parts.netloc.rpartition('@')[2]}"
        raise ValueError(
            f"store.uri must not carry credentials ({shown}...): S3 credentials come from the "
            "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or QERL_CREDENTIALS_FILE)"
        )
    if parts.query or parts.fragment or "?" in text:
        raise ValueError(
            f"store.uri must not carry a query string or fragment ({scheme}://{parts.netloc}{parts.path}?...): "
            "settings and credentials come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)"
        )
    if scheme == "s3":
        if not _BUCKET.match(parts.netloc):
            raise ValueError(
                f"store.uri '{text}': '{parts.netloc}' is not an S3 bucket name "
                "(3-63 characters: lower-case letters, digits, '.', '-')"
            )
        if ".." in parts.path.split("/"):
            raise ValueError(f"store.uri '{text}': the prefix must not contain '..'")
        return text
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"store.uri '{text}': a file URI names a local path: file:///abs/path")
        if not parts.path.startswith("/") or parts.path == "/":
            raise ValueError(f"store.uri '{text}' does not name an absolute folder: file:///abs/path")
        return text
    raise ValueError(
        f"store.uri '{scheme}://{parts.netloc}{parts.path}' has an unsupported scheme '{scheme}': "
        "use s3://bucket[/prefix], an absolute path or file:///abs/path"
    )


def open_shared(uri: str | None) -> SharedStore | None:
    """The shared store ``uri`` names (``check_uri``), or None when it is unset (local only)."""
    text = check_uri(uri or "")
    if text is None:
        return None
    if text.startswith("/"):
        return PosixStore(Path(text))
    parts = urlsplit(text)
    if parts.scheme.lower() == "file":
        return PosixStore(Path(parts.path))
    return S3Store(parts.netloc, parts.path.strip("/"))


# ---- POSIX --------------------------------------------------------------------------------------------
class PosixStore:
    """A shared store in a folder on a mount every machine sees (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not self.root.is_absolute():
            raise ValueError(f"shared store path {root} is not absolute")
        if not self.root.is_dir():
            raise SharedStoreError(
                f"shared store {self.root} is not a folder: is the share mounted? (create it once by hand)"
            )

    def describe(self) -> str:
        return f"file://{self.root}"

    def _path(self, path: str) -> Path:
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"bad shared store path {path!r}")
        return self.root.joinpath(*parts)

    def read(self, path: str) -> bytes | None:
        try:
            return self._path(path).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        atomic_write_bytes(self._path(path), data)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        final = self._path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, final)  # fails when ``final`` exists: the first writer wins
            except FileExistsError:
                return False
            fsync_dir(final.parent)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def has(self, path: str) -> bool:
        return self._path(path).is_file()

    def upload(self, path: str, src: Path) -> None:
        final = self._path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, _CHUNK)
                fout.flush()
                os.fsync(fout.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(final.parent)

    def download(self, path: str, dest: Path) -> str:
        digest = hashlib.sha256()
        with open(self._path(path), "rb") as fin, open(dest, "wb") as fout:
            while chunk := fin.read(_CHUNK):
                digest.update(chunk)
                fout.write(chunk)
        return digest.hexdigest()

    def paths(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/"))
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not (p.name.startswith(".") and p.name.endswith(".tmp"))  # in progress
        )


# ---- S3 -------------------------------------------------------------------------------------------
def _retryable(err: BaseException) -> bool:
    """A transport failure or a server error worth another try (a restarting server)."""
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    seen: set[int] = set()
    exc: BaseException | None = err
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionError | ReadTimeoutError | ResponseStreamingError | IncompleteReadError):
            return True
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = exc.response.get("Error", {}).get("Code", "")
            return status >= 500 or code in ("SlowDown", "ConditionalRequestConflict", "RequestTimeout")
        exc = exc.__cause__ or exc.__context__
    return False


def _status(err: BaseException) -> tuple[int, str]:
    response = getattr(err, "response", None) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return status, str(response.get("Error", {}).get("Code", ""))


class S3Store:
    """A shared store in an S3 bucket (see the module docstring); one boto3 client per object."""

    def __init__(self, bucket: str, prefix: str = "", retry_s: float = 30.0):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.retry_s = retry_s
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(
            connect_timeout=5,
            read_timeout=60,
            retries={"total_max_attempts": 3, "mode": "standard"},
            # an S3-compatible server at its own address: bucket in the path, not in the host name
            s3={"addressing_style": "path"} if endpoint else None,
        )
        self._client = boto3.session.Session().client("s3", config=config)
        self._endpoint = endpoint

    def describe(self) -> str:
        from qerl.pipeline.fleet.settings import redact

        where = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        return where + (f" at {redact(self._endpoint)}" if self._endpoint else "")

    def _key(self, path: str) -> str:
        if path.startswith("/") or any(p in ("", ".", "..") for p in path.split("/")):
            raise ValueError(f"bad shared store path {path!r}")
        return f"{self.prefix}/{path}" if self.prefix else path

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried again on a transport failure or 5xx until ``retry_s`` have passed; a
        failure is a ``SharedStoreError`` naming the store and the object (its text holds no secret:
        botocore never puts credentials in an error)."""
        deadline = time.monotonic() + self.retry_s
        pause = 0.5
        while True:
            try:
                return fn()
            except Exception as err:
                if not _retryable(err) or time.monotonic() + pause > deadline:
                    if isinstance(err, FileNotFoundError | ValueError):
                        raise
                    raise SharedStoreError(f"{self.describe()}: {what} {path} failed: {err}") from err
                log.info(
                    "%s: %s %s failed (%s): trying again in %.1f s", self.describe(), what, path, err, pause
                )
                time.sleep(pause)
                pause = min(pause * 2, 4.0)

    def read(self, path: str) -> bytes | None:
        def get() -> bytes | None:
            try:
                return self._client.get_object(Bucket=self.bucket, Key=self._key(path))["Body"].read()
            except Exception as err:
                if _status(err)[0] == 404 or _status(err)[1] in ("NoSuchKey", "NotFound"):
                    return None
                raise

        return self._call("read", path, get)

    def write(self, path: str, data: bytes) -> None:
        self._call(
            "write", path, lambda: self._client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data)
        )

    def put_if_absent(self, path: str, data: bytes) -> bool:
        def put() -> bool:
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data, IfNoneMatch="*")
                return True
            except Exception as err:
                if _status(err)[0] == 412 or _status(err)[1] == "PreconditionFailed":
                    return False
                raise

        return self._call("conditional put", path, put)

    def has(self, path: str) -> bool:
        def head() -> bool:
            try:
                self._client.head_object(Bucket=self.bucket, Key=self._key(path))
                return True
            except Exception as err:
                if _status(err)[0] == 404 or _status(err)[1] in ("NoSuchKey", "NotFound", "404"):
                    return False
                raise

        return self._call("head", path, head)

    def upload(self, path: str, src: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
        self._call(
            "upload",
            path,
            lambda: self._client.upload_file(str(src), self.bucket, self._key(path), Config=config),
        )

    def download(self, path: str, dest: Path) -> str:
        def get() -> str:
            try:
                body = self._client.get_object(Bucket=self.bucket, Key=self._key(path))["Body"]
            except Exception as err:
                if _status(err)[0] == 404 or _status(err)[1] == "NoSuchKey":
                    raise FileNotFoundError(f"{self.describe()}: no object {path}") from None
                raise
            digest = hashlib.sha256()
            with contextlib.closing(body), open(dest, "wb") as fout:  # a retry starts the file anew
                for chunk in body.iter_chunks(_CHUNK):
                    digest.update(chunk)
                    fout.write(chunk)
            return digest.hexdigest()

        return self._call("download", path, get)

    def paths(self, prefix: str) -> list[str]:
        def listing() -> list[str]:
            out = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/")) + "/"
            )
            for page in pages:
                out += [o["Key"] for o in page.get("Contents", [])]
            cut = len(self.prefix) + 1 if self.prefix else 0
            return sorted(k[cut:] for k in out)

        return self._call("list", prefix, listing)


# ---- the protocol -----------------------------------------------------------------------------------
def blob_path(sha256: str) -> str:
    return f"{BLOBS}/{sha256[:2]}/{sha256}"


def manifest_path(stage: str, key: str) -> str:
    for part in (stage, key):
        if not _SEGMENT.match(part):
            raise ValueError(f"bad stage or key {part!r} for the shared store")
    return f"{MANIFESTS}/{stage}/{key}.json"


def record_path(run_id: str) -> str:
    if not _SEGMENT.match(run_id):
        raise ValueError(f"bad run id {run_id!r} for the shared store")
    return f"{RUNS}/{run_id}/{RECORD}"


def ensure_leases() -> None:
    """Raise ``LeaseLostError`` when this process no longer holds its run lease (the fleet's
    coordination database); a no-op on a single machine."""
    from qerl.pipeline.fleet.coordination import ensure_leases as check  # psycopg: imported when used

    check()


def _load(data: bytes, shared: SharedStore, stage: str, key: str) -> Manifest:
    try:
        manifest = Manifest.model_validate_json(data)
    except ValueError as err:
        raise ArtifactError(
            f"{shared.describe()}: the manifest of {stage}/{key} cannot be read ({err})"
        ) from None
    if (manifest.stage, manifest.key) != (stage, key):
        raise ArtifactError(
            f"{shared.describe()}: {manifest_path(stage, key)} describes {manifest.stage}/{manifest.key}"
        )
    return manifest


def _live(manifest: Manifest) -> dict[str, FileRecord]:
    """The files of ``manifest`` that the store holds (not pruned by retention)."""
    return {n: r for n, r in manifest.files.items() if n not in manifest.pruned}


def missing_blobs(shared: SharedStore, manifest: Manifest) -> list[str]:
    """Files of ``manifest`` whose blob the shared store lacks (an incomplete artifact)."""
    return [n for n, r in sorted(_live(manifest).items()) if not shared.has(blob_path(r.sha256))]


def publish(
    shared: SharedStore, manifest: Manifest, directory: Path, overwrite: Iterable[str] = ()
) -> Manifest:
    """Publish the local artifact in ``directory`` (``manifest``): blobs first, manifest last and
    only if absent; returns the manifest the shared store holds afterwards, ours or the winner's.

    ``overwrite``: sha256 digests of blobs to upload even if present (a fetch found them corrupt and
    this artifact has the right bytes). A winner's manifest that names a missing blob is an
    ``ArtifactError``."""
    path = manifest_path(manifest.stage, manifest.key)
    redo = set(overwrite)
    if (there := shared.read(path)) is None or redo:
        for name, rec in sorted(_live(manifest).items()):
            blob = blob_path(rec.sha256)
            if rec.sha256 in redo or not shared.has(blob):
                shared.upload(blob, directory / name)
        if there is None:  # another writer may have finished while our blobs went up
            there = shared.read(path)
    if there is None:
        ensure_leases()
        ours = manifest.model_dump_json(indent=2).encode()
        shared.put_if_absent(path, ours)
        there = shared.read(path)  # what is there now, whatever the condition did
        if there is None:
            raise SharedStoreError(f"{shared.describe()}: {path} is missing right after it was published")
        if there == ours:
            return manifest
    theirs = _load(there, shared, manifest.stage, manifest.key)
    if missing := missing_blobs(shared, theirs):
        raise ArtifactError(
            f"{shared.describe()}: the manifest of {manifest.stage}/{manifest.key} names files whose "
            f"blobs are missing: {', '.join(missing)}"
        )
    return theirs


def fetch(shared: SharedStore, stage: str, key: str, into: ArtifactStore) -> Manifest | None:
    """Copy (stage, key) from the shared store into the local store ``into``; None when the shared
    store has no such manifest. The caller holds the key's lock in ``into``. Each file is hashed while
    written and a mismatch is a ``BlobMismatchError``; a missing blob is an ``ArtifactError``."""
    data = shared.read(manifest_path(stage, key))
    if data is None:
        return None
    manifest = _load(data, shared, stage, key)
    # named as a build's folder (<stage>-<key>-<nonce>): gc's sweep of tmp/ sees the key's lock held
    tmp = into.root / TMP_DIR / f"{stage}-{key}-fetch{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for name, rec in sorted(_live(manifest).items()):
            dest = tmp / name
            if name.startswith("/") or ".." in Path(name).parts or name == MANIFEST:
                raise ArtifactError(f"{shared.describe()}: {stage}/{key} names a bad file {name!r}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                got = shared.download(blob_path(rec.sha256), dest)
            except FileNotFoundError:
                raise ArtifactError(
                    f"{shared.describe()}: artifact {stage}/{key}: the blob of {name} "
                    f"(sha256 {rec.sha256}) is missing"
                ) from None
            if got != rec.sha256:
                raise BlobMismatchError(
                    f"{shared.describe()}: artifact {stage}/{key}: file {name} has sha256 {got}, "
                    f"its manifest says {rec.sha256}: refusing the corrupt blob",
                    rec.sha256,
                )
            stat = dest.stat()
            manifest.files[name] = FileRecord(sha256=got, size=stat.st_size, mtime_ns=stat.st_mtime_ns)
        atomic_write_text(tmp / MANIFEST, manifest.model_dump_json(indent=2))
        final = into.install(tmp, stage, key)
    except Exception as err:
        if not is_disk_full(err):
            raise
        size = human_bytes(sum(r.size for r in _live(manifest).values()))
        raise disk_full(tmp, f"the {stage} artifact fetched from {shared.describe()}", size) from err
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    manifest.path = str(final)
    log.info("fetched %s/%s from %s", stage, key, shared.describe())
    return manifest


def publish_record(shared: SharedStore, run_id: str, data: bytes) -> None:
    """Put run ``run_id``'s record (``run.json``) in the shared store, replacing the one there: only
    the holder of the run's lock writes it (checked first: ``ensure_leases``)."""
    ensure_leases()
    shared.write(record_path(run_id), data)


def fetch_record(shared: SharedStore, run_id: str) -> bytes | None:
    return shared.read(record_path(run_id))


def list_records(shared: SharedStore) -> list[str]:
    """The run ids that have a record in the shared store."""
    return sorted(
        {p.split("/")[1] for p in shared.paths(RUNS) if p.count("/") == 2 and p.endswith(f"/{RECORD}")}
    )
