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

The two kinds of shared store, the URI rules and the transport: ``qerl.pipeline.store.shared_backends``.

Limits: nothing deletes from the shared store (retention, ``qerl gc``, works on the local cache only:
the shared store's blobs and manifests stay until removed by hand); a local prune, heal or re-key
is not published.
"""

from __future__ import annotations

import logging
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from qerl.pipeline.store.files import (
    atomic_write_text,
    disk_full,
    human_bytes,
    is_disk_full,
)
from qerl.pipeline.store.layout import MANIFEST, TMP_DIR
from qerl.pipeline.store.manifest import ArtifactError, FileRecord, Manifest
from qerl.pipeline.store.shared_backends import (  # noqa: F401  (the store's API, re-exported)
    PosixStore,
    S3Store,
    SharedStore,
    SharedStoreError,
    check_uri,
    open_shared,
)

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


class BlobMismatchError(ArtifactError):
    """A fetched file's sha256 is not its manifest's: the shared store's blob is corrupt."""

    def __init__(self, message: str, expected: str):
        super().__init__(message)
        self.expected = expected

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.expected))


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
