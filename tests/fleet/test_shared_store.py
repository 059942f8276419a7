"""The shared store: machines (each its own local store root) publishing to and fetching from one S3
bucket (a real SeaweedFS on loopback) or one folder (a shared mount, simulated by a local folder:
real NFS semantics are not tested here), with digest-verified local caches.

"Machines" are store objects with their own local roots in one process, or separate processes for
the races; what a real network adds (latency, partitions) is simulated only by a server restart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from qerl.pipeline.config import config_hash, key_payload
from qerl.pipeline.store.artifact_store import ArtifactStore, open_store
from qerl.pipeline.store.manifest import ArtifactError, BuildResult, Manifest
from qerl.pipeline.store.retention_policy import RetentionConfig
from qerl.pipeline.store.shared import (
    BlobMismatchError,
    PosixStore,
    S3Store,
    SharedStoreError,
    blob_path,
    fetch,
    fetch_record,
    list_records,
    manifest_path,
    open_shared,
    publish,
    publish_record,
)

from tests.fleet.seaweed import S3Server, start_seaweed

pytestmark = pytest.mark.fleet
ROOT = Path(__file__).resolve().parents[2]
CODE = "v1"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    logging.getLogger(__name__).info("SeaweedFS started in %.2f s", server.started_s)
    yield server
    server.stop(hard=True)


@pytest.fixture
def s3_uri(seaweed: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{seaweed.create_bucket(f'qerl-{uuid.uuid4().hex[:12]}')}/team"


@pytest.fixture(params=["posix", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_uri")
    (tmp_path / "shared").mkdir()
    return str(tmp_path / "shared")


def _writer(text: str, calls: list[str] | None = None, size: int = 3000):
    def build(out: Path) -> BuildResult:
        if calls is not None:
            calls.append(text)
        (out / "adapter").mkdir()
        (out / "adapter" / "weights.bin").write_bytes(text.encode() * (size // len(text)))
        (out / "metrics.json").write_text(json.dumps({"text": text}))
        return BuildResult(mode="test", metrics={"n": 2})

    return build


def _machine(tmp_path: Path, name: str, uri: str) -> ArtifactStore:
    return ArtifactStore(tmp_path / name / "store", open_shared(uri))


def _built(store: ArtifactStore) -> list[dict]:
    return [b for b in store.builds() if b["event"] == "built"]


def _same_files(a: Manifest, b: Manifest) -> None:
    assert {n: r.sha256 for n, r in a.files.items()} == {n: r.sha256 for n, r in b.files.items()}
    for name in a.files:
        assert (a.dir / name).read_bytes() == (b.dir / name).read_bytes()


def _corrupt(shared, path: str) -> None:
    data = bytearray(shared.read(path))
    data[0] ^= 0xFF
    shared.write(path, bytes(data))


# ---- one machine builds, another hits ---------------------------------------------------------------
def test_second_machine_hits_without_building(tmp_path, uri, caplog):
    a, b = _machine(tmp_path, "a", uri), _machine(tmp_path, "b", uri)
    made, cached = a.produce("demo", {"x": 1}, {}, CODE, _writer("hello"))
    assert not cached and a.shared.has(manifest_path("demo", made.key))
    calls: list[str] = []
    with caplog.at_level(logging.INFO, logger="qerl.artifacts"):
        got, cached = b.produce("demo", {"x": 1}, {}, CODE, _writer("other", calls))
    assert cached and calls == [] and _built(b) == []
    assert f"fetched demo/{made.key} from {b.shared.describe()}" in caplog.text
    assert got.dir == b.path_for("demo", made.key) and got.digest == made.digest
    _same_files(made, got)
    assert b.get("demo", made.key, verify="full") is not None  # a local hit now, verified
    assert not any((tmp_path / "b" / "store" / "tmp").iterdir())


def test_fetch_skips_pruned_files(tmp_path, uri):
    a, b = _machine(tmp_path, "a", uri), ArtifactStore(tmp_path / "b" / "store")
    made, _ = ArtifactStore(a.root).produce("demo", {}, {}, CODE, _writer("p"))  # local only at first
    a.prune("demo", made.key, ["adapter/weights.bin"], "test")
    pruned, cached = a.produce("demo", {}, {}, CODE, _writer("never"))  # a hit: published now
    assert cached and pruned.pruned
    assert not a.shared.has(blob_path(made.files["adapter/weights.bin"].sha256))
    got = fetch(a.shared, "demo", made.key, b)
    assert got is not None and got.pruned == pruned.pruned
    assert not (got.dir / "adapter" / "weights.bin").exists() and (got.dir / "metrics.json").is_file()
    assert b.get("demo", made.key, verify="full") is not None


def test_local_hit_missing_from_shared_is_published(tmp_path, uri):
    local_only = ArtifactStore(tmp_path / "a" / "store")
    made, _ = local_only.produce("demo", {}, {}, CODE, _writer("before the uri"))
    a = _machine(tmp_path, "a", uri)
    assert not a.shared.has(manifest_path("demo", made.key))
    hit, cached = a.produce("demo", {}, {}, CODE, _writer("never"))
    assert cached and a.shared.has(manifest_path("demo", made.key))
    calls: list[str] = []
    got, cached = _machine(tmp_path, "b", uri).produce("demo", {}, {}, CODE, _writer("x", calls))
    assert cached and calls == [] and got.digest == made.digest


def test_loser_takes_the_winners_artifact(tmp_path, uri):
    """B builds while A publishes other bytes for the key first: B's publish loses, B's local copy is
    replaced by A's, and both use one artifact."""
    a, b = _machine(tmp_path, "a", uri), _machine(tmp_path, "b", uri)
    won: list[Manifest] = []

    def b_build(out: Path) -> BuildResult:
        won.append(a.produce("demo", {}, {}, CODE, _writer("from A"))[0])  # A wins meanwhile
        return _writer("from B")(out)

    got, cached = b.produce("demo", {}, {}, CODE, b_build)
    assert not cached and len(_built(b)) == 1  # B did build
    assert got.digest == won[0].digest
    assert (got.dir / "metrics.json").read_text() == json.dumps({"text": "from A"})
    assert Manifest.load(b.path_for("demo", got.key)).digest == won[0].digest
    assert b.get("demo", got.key, verify="full").digest == won[0].digest


# ---- corruption -------------------------------------------------------------------------------------
def test_corrupt_blob_is_refused_and_rebuilt(tmp_path, uri, caplog):
    a, b = _machine(tmp_path, "a", uri), _machine(tmp_path, "b", uri)
    made, _ = a.produce("demo", {}, {}, CODE, _writer("good"))
    sha = made.files["adapter/weights.bin"].sha256
    _corrupt(a.shared, blob_path(sha))
    with pytest.raises(BlobMismatchError, match=r"demo/\w+: file adapter/weights.bin has sha256 \w+") as err:
        fetch(b.shared, "demo", made.key, b)
    assert sha in str(err.value) and made.key in str(err.value)
    assert not any((b.root / "tmp").iterdir())
    calls: list[str] = []
    with caplog.at_level(logging.WARNING, logger="qerl.artifacts"):
        got, cached = b.produce("demo", {}, {}, CODE, _writer("good", calls))
    assert not cached and calls == ["good"] and len(_built(b)) == 1
    assert "adapter/weights.bin" in caplog.text and "rebuilds" in caplog.text
    assert got.digest == made.digest
    assert b.shared.has(manifest_path("demo", made.key))  # the shared manifest stays
    # B's rebuild had the right bytes: it put them back, so the next machine fetches cleanly
    c = _machine(tmp_path, "c", uri)
    got_c, cached = c.produce("demo", {}, {}, CODE, _writer("never", calls))
    assert cached and calls == ["good"]
    _same_files(made, got_c)


# ---- races between processes ---------------------------------------------------------------------------
_PUBLISHER = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.fleet.test_shared_store import run_publisher
print(json.dumps(run_publisher(*sys.argv[2:])))
"""


class IgnoresCondition:
    """A shared store whose put-if-absent is a plain overwrite (a server that ignores If-None-Match)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self.inner.write(path, data)
        return True


def run_publisher(root: str, uri: str, text: str, go: str, ignore: str) -> dict:
    """One machine of the race: say it is ready, wait for ``go``, build ``text`` bytes, publish."""
    shared = open_shared(uri)
    store = ArtifactStore(Path(root), IgnoresCondition(shared) if ignore == "1" else shared)
    Path(root).with_name("ready").touch()
    while not Path(go).exists():
        time.sleep(0.005)

    def build(out: Path) -> BuildResult:
        result = _writer(text, size=200_000)(out)
        time.sleep(0.5)  # long enough that the racers overlap on a loaded 2-core machine
        return result

    manifest, cached = store.produce("race", {}, {}, CODE, build)
    local = Manifest.load(store.path_for("race", manifest.key))
    problems = store.problems(local, full=True)
    return {
        "digest": manifest.digest,
        "local": local.digest,
        "problems": problems,
        "cached": cached,
        "text": json.loads((local.dir / "metrics.json").read_text())["text"],
    }


def _race(tmp_path: Path, uri: str, n: int, ignore: bool) -> list[dict]:
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PUBLISHER,
                str(ROOT),
                str(tmp_path / f"m{i}" / "store"),
                uri,
                f"machine {i}",
                str(go),
                "1" if ignore else "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )  # fmt: skip
        for i in range(n)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"m{i}" / "ready").exists() for i in range(n)):  # all imported, waiting
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a publisher died"
        time.sleep(0.05)
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def _complete(shared, manifest: Manifest) -> None:
    """Every file of ``manifest`` has its blob in ``shared``, with the right bytes."""
    for name, rec in manifest.files.items():
        assert hashlib.sha256(shared.read(blob_path(rec.sha256)) or b"").hexdigest() == rec.sha256, name


def test_concurrent_publishers_agree_on_one_manifest(tmp_path, uri):
    results = _race(tmp_path, uri, 6, ignore=False)
    shared = open_shared(uri)
    key = ArtifactStore.key("race", {}, {}, CODE)
    final = Manifest.model_validate_json(shared.read(manifest_path("race", key)))
    assert shared.paths("manifests") == [manifest_path("race", key)]  # exactly one manifest
    assert {r["digest"] for r in results} == {r["local"] for r in results} == {final.digest}
    assert sum(not r["cached"] for r in results) >= 2  # it was a race: several built
    assert all(r["problems"] == [] for r in results)
    assert len({r["text"] for r in results}) == 1  # every machine holds the same bytes
    _complete(shared, final)


def test_fleet_database_lets_one_machine_build(tmp_path, uri, postgres, monkeypatch):
    """With the coordination database (real PostgreSQL) the build lock is fleet-wide: of 6 racing
    machines one builds, the others wait and fetch its artifact."""
    monkeypatch.setenv("QERL_FLEET_DB", postgres.url)
    results = _race(tmp_path, uri, 6, ignore=False)
    assert sum(not r["cached"] for r in results) == 1
    assert len({r["digest"] for r in results}) == 1 and all(r["problems"] == [] for r in results)


def test_a_lost_lease_publishes_no_manifest(tmp_path, uri, monkeypatch):
    from qerl.pipeline.fleet import coordination

    def lost() -> None:
        raise coordination.LeaseLostError("lease night-1 lost (test)")

    monkeypatch.setattr(coordination, "ensure_leases", lost)
    a = _machine(tmp_path, "a", uri)
    with pytest.raises(coordination.LeaseLostError):
        a.produce("demo", {}, {}, CODE, _writer("late"))
    key = ArtifactStore.key("demo", {}, {}, CODE)
    assert not a.shared.has(manifest_path("demo", key)) and a.shared.paths("manifests") == []
    with pytest.raises(coordination.LeaseLostError):
        publish_record(a.shared, "night-1", b"{}")
    assert list_records(a.shared) == []


def test_publishers_without_the_condition_still_complete(tmp_path, uri):
    """A store that ignores the condition (put-if-absent overwrites): the guarantee left is that every
    manifest the store holds is complete and each process uses a complete artifact that was, when it
    read it back, the one in the store; processes may use different bytes (last writer stays)."""
    results = _race(tmp_path, uri, 6, ignore=True)
    shared = open_shared(uri)
    key = ArtifactStore.key("race", {}, {}, CODE)
    final = Manifest.model_validate_json(shared.read(manifest_path("race", key)))
    assert shared.paths("manifests") == [manifest_path("race", key)]
    _complete(shared, final)  # the last manifest read back is complete
    # each process uses a complete local artifact: the one it read back, whole and verified
    assert all(r["problems"] == [] and r["digest"] == r["local"] for r in results)
    assert final.digest in {r["digest"] for r in results}


def test_publish_adopts_what_is_there_and_checks_it(tmp_path, uri):
    """A publish that finds a manifest returns it (uploading nothing), once it has checked that it is
    readable and that every blob it names is there."""
    shared = open_shared(uri)
    first = _machine(tmp_path, "a", uri).produce("demo", {}, {}, CODE, _writer("one"))[0]
    second = ArtifactStore(tmp_path / "b" / "store").produce("demo", {}, {}, CODE, _writer("two"))[0]
    assert publish(shared, second, second.dir).digest == first.digest
    assert publish(IgnoresCondition(shared), second, second.dir).digest == first.digest
    assert not shared.has(blob_path(second.files["metrics.json"].sha256))  # the loser uploads nothing
    path = manifest_path("demo", first.key)
    holed = first.model_copy(deep=True)
    holed.files["metrics.json"].sha256 = "0" * 64
    shared.write(path, holed.model_dump_json().encode())
    with pytest.raises(ArtifactError, match="blobs are missing: metrics.json"):
        publish(shared, second, second.dir)
    shared.write(path, b"{}")
    with pytest.raises(ArtifactError, match=f"the manifest of demo/{first.key} cannot be read"):
        publish(shared, second, second.dir)


def _put_race(stores: list, path: str) -> list[int]:
    """Each store object (its own client) in its own thread puts ``path`` if absent, all at once:
    which won."""
    import threading

    barrier, wins = threading.Barrier(len(stores)), []

    def put(i: int) -> None:
        barrier.wait()
        if stores[i].put_if_absent(path, f"writer {i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(len(stores))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return wins


def test_put_if_absent_has_one_winner_under_concurrency(uri):
    """The store's own condition (SeaweedFS's If-None-Match, POSIX link): 8 writers at once, 3 times.
    (SeaweedFS 4.48 serialises concurrent conditional puts of one key: some wait 1-2 s.)"""
    stores = [open_shared(uri) for _ in range(8)]
    for trial in range(3):
        wins = _put_race(stores, f"race/{trial}")
        assert len(wins) == 1 and stores[0].read(f"race/{trial}") == f"writer {wins[0]}".encode()


class LandsAfterUs:
    """A store ignoring the condition, where another writer's complete manifest lands right after our
    put and before our read-back."""

    def __init__(self, inner, theirs: bytes):
        self.inner, self.theirs = inner, theirs

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self.inner.write(path, data)
        self.inner.write(path, self.theirs)
        return True


def test_read_back_adopts_a_manifest_that_overwrote_ours(tmp_path, uri):
    shared = open_shared(uri)
    theirs = ArtifactStore(tmp_path / "c" / "store").produce("demo", {}, {}, CODE, _writer("from C"))[0]
    for name, rec in theirs.files.items():  # C's blobs are up before its manifest, as publish does
        shared.upload(blob_path(rec.sha256), theirs.dir / name)
    b = ArtifactStore(
        tmp_path / "b" / "store", LandsAfterUs(shared, theirs.model_dump_json(indent=2).encode())
    )
    got, cached = b.produce("demo", {}, {}, CODE, _writer("from B"))
    assert not cached and got.digest == theirs.digest
    assert b.get("demo", got.key, verify="full").digest == theirs.digest
    _same_files(theirs, got)


# ---- the S3 server ----------------------------------------------------------------------------------------
def test_fetch_after_s3_restart(tmp_path, s3_uri, seaweed):
    a, b = _machine(tmp_path, "a", s3_uri), _machine(tmp_path, "b", s3_uri)
    made, _ = a.produce("demo", {}, {}, CODE, _writer("survives"))
    t0 = time.monotonic()
    seaweed.restart()
    restart_s = time.monotonic() - t0
    calls: list[str] = []
    got, cached = b.produce("demo", {}, {}, CODE, _writer("x", calls))
    assert cached and calls == [] and restart_s < 30
    _same_files(made, got)


def test_s3_rides_out_a_short_outage(tmp_path, s3_uri, seaweed):
    """The server is down (crashed) when a read starts and back within the retry window."""
    import threading

    a = _machine(tmp_path, "a", s3_uri)
    made, _ = a.produce("demo", {}, {}, CODE, _writer("outage"))
    seaweed.stop(hard=True)
    restarter = threading.Timer(1.5, seaweed.start)
    restarter.start()
    try:
        b = _machine(tmp_path, "b", s3_uri)
        got, cached = b.produce("demo", {}, {}, CODE, _writer("x"))
    finally:
        restarter.join()
    assert cached and got.digest == made.digest


def test_s3_outage_past_the_window_is_an_error(tmp_path, seaweed, monkeypatch):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    store = S3Store("qerl-nothing", "x", retry_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(
        SharedStoreError, match="s3://qerl-nothing/x at http://127.0.0.1:.*read manifests/a/b.json"
    ):
        store.read("manifests/a/b.json")
    assert time.monotonic() - t0 < 10


def _closed_port() -> int:
    from tests.fleet.seaweed import free_ports

    return free_ports(1)[0]


def test_s3_credentials_required_and_never_shown(tmp_path, seaweed, s3_uri, monkeypatch):
    import boto3
    import botocore
    from botocore.config import Config

    bucket = s3_uri.split("/")[2]
    shared = open_shared(s3_uri)
    shared.write("probe", b"x")
    anonymous = boto3.session.Session().client(
        "s3", endpoint_url=seaweed.endpoint, region_name="us-east-1",
        config=Config(signature_version=botocore.UNSIGNED, retries={"total_max_attempts": 1}),
    )  # fmt: skip
    for call in (
        lambda: anonymous.get_object(Bucket=bucket, Key="team/probe"),
        lambda: anonymous.put_object(Bucket=bucket, Key="team/other", Body=b"y"),
        lambda: anonymous.list_objects_v2(Bucket=bucket),
    ):
        with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):
            call()
    assert seaweed.secret_key not in shared.describe() and "team" in shared.describe()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key[::-1])  # a wrong secret
    wrong = open_shared(s3_uri)
    with pytest.raises(SharedStoreError) as err:
        wrong.read("probe")
    text = str(err.value) + repr(err.value) + str(err.value.__cause__)
    assert "SignatureDoesNotMatch" in text or "AccessDenied" in text or "InvalidAccessKeyId" in text
    assert seaweed.secret_key not in text and seaweed.secret_key[::-1] not in text
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(SharedStoreError):
        open_shared(s3_uri).read("probe")  # no credentials at all


# ---- records ---------------------------------------------------------------------------------------
def test_run_records(uri):
    shared = open_shared(uri)
    assert list_records(shared) == [] and fetch_record(shared, "night-1") is None
    publish_record(shared, "night-1", b'{"status": "running"}')
    publish_record(shared, "night-1", b'{"status": "completed"}')  # the lock holder overwrites
    publish_record(shared, "night-2", b"{}")
    assert fetch_record(shared, "night-1") == b'{"status": "completed"}'
    assert list_records(shared) == ["night-1", "night-2"]
    with pytest.raises(ValueError, match="bad run id"):
        publish_record(shared, "../x", b"")


# ---- the config --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, why",
    [
        ("s3://AKIA:hunter2secret@bucket/x", "must not carry credentials"),
        ("s3://token@bucket", "must not carry credentials"),
        ("s3://bucket/x?X-Amz-Signature=hunter2secret", "query string"),
        ("gs://bucket/x", "unsupported scheme 'gs'"),
        ("http://host/x", "unsupported scheme 'http'"),
        ("relative/path", "relative path"),
        ("./shared", "relative path"),
        ("file://host/x", "file:///abs/path"),
        ("s3://B", "not an S3 bucket name"),
    ],
)
def test_uri_validation(bad, why):
    with pytest.raises(ValueError, match=why) as err:
        RetentionConfig(uri=bad)
    assert "hunter2secret" not in str(err.value)


def test_uri_forms_and_keys(tmp_path):
    assert RetentionConfig().uri is None and open_shared(None) is None and open_shared("") is None
    for good in ("s3://qerl-store", "s3://qerl-store/team/a", str(tmp_path), f"file://{tmp_path}"):
        assert RetentionConfig(uri=good).uri == good
    assert isinstance(open_shared(f"file://{tmp_path}"), PosixStore)
    with pytest.raises(SharedStoreError, match="is the share mounted"):
        open_shared(str(tmp_path / "absent"))
    # a resource field: never in a key or the run id
    from qerl.pipeline.config import apply_overrides
    from qerl.pipeline.planning.run_config import load_run_config
    from qerl.pipeline.planning.runs import run_id_for

    plain = load_run_config()
    shared = apply_overrides(plain, ["store.uri=s3://qerl-store/team"])
    assert shared.store.uri == "s3://qerl-store/team"
    assert run_id_for(shared) == run_id_for(plain) and config_hash(shared) == config_hash(plain)
    assert "qerl-store" not in json.dumps(key_payload(shared))
    assert config_hash(RetentionConfig(uri="s3://qerl-a")) == config_hash(RetentionConfig())
    keyed = [
        ArtifactStore.key("s", {"store": RetentionConfig(uri=u)}, {}, CODE) for u in (None, "s3://qerl-a")
    ]
    assert keyed[0] == keyed[1]
    with pytest.raises(ValueError, match="must not carry credentials") as err:
        apply_overrides(plain, {"store": {"uri": "s3://AKIA:hunter2secret@qerl-store"}})
    assert "hunter2secret" not in str(err.value)


def test_open_store(tmp_path):
    (tmp_path / "shared").mkdir()
    store = open_store(tmp_path / "work", RetentionConfig(uri=str(tmp_path / "shared")))
    assert store.root == (tmp_path / "work" / "store").resolve() and isinstance(store.shared, PosixStore)
    assert open_store(tmp_path / "work", RetentionConfig()).shared is None
    assert open_store(tmp_path / "work").shared is None
