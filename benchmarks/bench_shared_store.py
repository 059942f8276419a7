"""Benchmark: what a cache hit costs with a shared store, next to a local hit.

Two artifacts: ``small`` (a 4 KB table and a metrics file) and ``adapter`` (about 33 MB in four files:
two safetensors shards of 20 and 10 MB, a 3 MB tokenizer file and a small config, random bytes). Each
is produced once on machine A (its own local store) and published; then, per repeat:

* local hit, first lookup: ``produce`` on a new store object over A's store (integrity's ``once``
  mode hashes every file the first time; no shared store);
* local hit, same object: ``produce`` again on that object (stat only);
* local hit + shared check: a first lookup on a store object that has the shared store, which also asks
  the shared store whether it holds the manifest (one HEAD on S3, one stat on POSIX);
* fetch: ``produce`` on a new machine B (an empty local store, the same shared store): the manifest
  is read, each blob streamed into B's tmp/ and hashed while written, then renamed into objects/;
* publish: ``publish`` of A's artifact to an empty shared store (blobs, then the manifest).

Shared stores: S3 on a SeaweedFS ``weed mini`` on loopback (``tests/fleet/seaweed.py``; no network in
between, so what a real network adds is not measured) and POSIX (a folder on the same disk standing
in for a shared mount: page cache, no NFS). Median of ``--repeats`` runs (default 5), in ms.

Run: ``qerl bench shared_store`` (writes ``benchmarks/results/shared-store.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "shared-store.md"

from qerl.pipeline.store.artifact_store import ArtifactStore  # noqa: E402
from qerl.pipeline.store.manifest import BuildResult  # noqa: E402
from qerl.pipeline.store.shared import PosixStore, open_shared, publish  # noqa: E402

MB = 1 << 20
ARTIFACTS = {
    "small": {"table.parquet": 4096, "metrics.json": 200},
    "adapter": {
        "adapter/model-00001.safetensors": 20 * MB,
        "adapter/model-00002.safetensors": 10 * MB,
        "adapter/tokenizer.json": 3 * MB,
        "adapter/adapter_config.json": 800,
    },
}


def writer(files: dict[str, int], seed: int):
    def build(out: Path) -> BuildResult:
        for name, size in files.items():
            path = out / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size) if size > 4096 else bytes([seed % 256]) * size)
        return BuildResult(mode="bench")

    return build


def never(out: Path) -> BuildResult:
    raise AssertionError("a hit must not build")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def measure(base: Path, name: str, uri: str, repeats: int) -> dict[str, float]:
    files = ARTIFACTS[name]
    base = base / uuid.uuid4().hex[:8]  # machines of their own for each store and artifact
    a_root = base / f"a-{name}" / "store"
    shared = open_shared(uri)
    made, _ = ArtifactStore(a_root, shared).produce(name, {}, {}, "v1", writer(files, 1))
    rows: dict[str, list[float]] = {k: [] for k in ("first", "same", "shared-check", "fetch", "publish")}
    for i in range(repeats):
        plain = ArtifactStore(a_root)
        rows["first"].append(timed(lambda s=plain: s.produce(name, {}, {}, "v1", never)))
        rows["same"].append(timed(lambda s=plain: s.produce(name, {}, {}, "v1", never)))
        with_shared = ArtifactStore(a_root, shared)
        rows["shared-check"].append(timed(lambda s=with_shared: s.produce(name, {}, {}, "v1", never)))
        b = ArtifactStore(base / f"b-{name}-{i}" / "store", open_shared(uri))
        rows["fetch"].append(timed(lambda s=b: s.produce(name, {}, {}, "v1", never)))
        assert b.get(name, made.key, verify="full").digest == made.digest
        empty = fresh_target(base, uri)
        rows["publish"].append(timed(lambda t=empty: publish(t, made, made.dir)))
    return {k: statistics.median(v) for k, v in rows.items()}


def fresh_target(base: Path, uri: str):
    """An empty shared store of the same kind as ``uri``: a new prefix of its bucket (the first write
    to a new SeaweedFS bucket allocates its volumes, about 0.2 s, which is not the publish's cost)."""
    if uri.startswith("s3://"):
        return open_shared(f"{uri}-{uuid.uuid4().hex[:8]}")
    folder = base / f"posix-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    return PosixStore(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tests.fleet.seaweed import start_seaweed

    with tempfile.TemporaryDirectory(prefix="qerl-bench-shared-") as tmp:
        base = Path(tmp)
        server = start_seaweed(base / "seaweed")
        try:
            os.environ.update(server.env())
            (base / "posix").mkdir()
            backends = {"S3 (SeaweedFS, loopback)": None, "POSIX (local folder)": str(base / "posix")}
            results = {}
            for label, uri in backends.items():
                if uri is None:
                    uri = f"s3://{server.create_bucket(f'qerl-{uuid.uuid4().hex[:12]}')}/team"
                for name in ARTIFACTS:
                    results[(label, name)] = measure(base, name, uri, args.repeats)
            started = server.started_s
        finally:
            server.stop(hard=True)
    sizes = {n: sum(f.values()) / MB for n, f in ARTIFACTS.items()}
    lines = [
        "## Shared store: what a cache hit costs",
        "",
        "Command: `qerl bench shared_store`. No goal: the price of a fleet's shared store beside a local hit.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
        f"S3 is SeaweedFS on loopback (started in {started:.2f} s), POSIX a folder on the same disk; "
        f"ms, median of {args.repeats}.",
        "",
        "| store | artifact | local hit, first lookup | local hit, same object | local hit + shared check | fetch | publish |",
        "|---|---|---|---|---|---|---|",
    ]
    for (label, name), r in results.items():
        lines.append(
            f"| {label} | {name} ({sizes[name]:.1f} MB) | {r['first']:.1f} | {r['same']:.2f} | "
            f"{r['shared-check']:.1f} | {r['fetch']:.1f} | {r['publish']:.1f} |"
        )
    lines += [
        "",
        "A fetch streams each blob into the local store, hashing it as it is written; a local first "
        "lookup hashes every file once. Loopback only: a real network adds its latency and bandwidth.",
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
