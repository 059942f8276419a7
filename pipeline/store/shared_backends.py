"""The shared store's two kinds, behind one protocol (``SharedStore``): ``S3Store`` (any S3-compatible
server) and ``PosixStore`` (a folder on a mount every machine sees), and ``store.uri``'s rules
(``check_uri``, ``open_shared``). What is stored where, and how it is published and fetched:
``qerl.pipeline.store.shared``.

Transport: one boto3 client per ``S3Store``, with short connect and read timeouts; a request that
cannot reach the server, times out or gets a 5xx is tried again for up to ``retry_s`` (30 s) in all,
so a restarted server is ridden out, a dead one is an error (``SharedStoreError``, naming the store
and the object, never a credential).
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
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from qerl.pipeline.store.files import (
    atomic_write_bytes,
    fsync_dir,
)

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
