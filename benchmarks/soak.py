"""Soak: consecutive nights on a fleet with one fault injected into each, checked night by night
against the same nights run on one machine without faults.

``python benchmarks/soak.py --nights N --seed S [--out docs/results/soak.md]``

1. The learner model of the fleet suite (built as ``benchmarks/bench_fleet.py`` builds it), the
   arithmetic data set of ``tests.flows.test_nightly`` (480 problems, the most level 1 has) and its
   nightly config with 3 steps a night, every step's adapter kept, and a promotion margin of 0
   standard errors (so nights win and lose: the champion moves, and each night warm-starts from
   whichever night won last; night k depends on every night before it).
2. The reference: the N nights one after another on one machine, no fleet (``qerl run --night`` as
   subprocesses, a local store and registry): each night's final adapter weights digest, its
   registration (version, promoted) and its data slice.
3. The soak: PostgreSQL, Prefect, MLflow and S3 (SeaweedFS) servers on loopback (``tests/fleet``),
   two machines (``qerl worker`` process sessions, logical GPUs 0 and 1), the nightly deployment on
   their pool. Night by night: a flow run for the night, then that night's fault from the seeded
   schedule at a random point of it, then a wait until the night completes; an operator's restart
   only where qerl's own verdict says failed (a deadline, a full disk) or the janitor gave up.
4. After every night, the invariants (``check_night``); the soak stops at the first lost night
   (every later night depends on it).
5. The results page (and a JSON beside it).

Faults (``KINDS``; every kind appears once per cycle of the schedule):

- ``kill``: SIGKILL the whole process session of the machine running the night, then a replacement
  worker for it (same name, work dir and GPU); the janitor crashes the night and starts it again;
- ``restart-prefect``, ``restart-mlflow``, ``restart-postgres``, ``restart-s3``: the server restarted
  mid-night (stop, start, wait until it answers);
- ``corrupt-cache``: one byte flipped (size and mtime kept) in a file of a finished base artifact
  (quantize, dequantize, quality: served to every night) in the running machine's local store; the
  integrity check of the next lookup there must find it and fetch the artifact again;
- ``twice``: a second attempt at the running night: a second flow run of the deployment, and a
  ``qerl run --night`` typed on the other machine while the first attempt holds the night;
- ``deadline``: the night started with ``loop.deadline_h`` cut to a random fraction of the
  reference's attempt (a resource setting: the same run id), as if the clock jumped past it; then an
  operator starts the night again with the deployment's own config;
- ``disk-full``: the running machine's work dir (a tmpfs of its own) filled up mid-night and kept full
  (what retention frees is taken again); the operator frees it once the attempt has ended and starts
  the night again if it failed. Needs ``mount -t tmpfs`` (root): where mounting is refused the kind
  is left out, and the page says so.

Recovery's cost is measured against the same nights on the same fleet without faults: ``--kinds
none`` runs them (``--reference-from`` reuses an earlier soak's learner and reference nights), and
``--baseline`` gives that run's JSON to the soak with faults, whose page then sets each night against
its fault-free twin.

Besides the per-night invariants (``Soak.check``), every night is looked at again at the end
(``Soak.revisit``): a flow run of it that came after its check, or a COMPLETED one set to another
state since, fails it. ``--page-from soak.json`` writes the page again from a run's JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "fleet")]
OUT = ROOT / "docs" / "results" / "soak.md"
BASELINE_PAGE = ROOT / "docs" / "results" / "soak-fault-free.md"
KINDS = (
    "kill",
    "restart-prefect",
    "restart-mlflow",
    "restart-postgres",
    "restart-s3",
    "corrupt-cache",
    "twice",
    "deadline",
    "disk-full",
)
NO_FAULT = "none"  # ``--kinds none``: the same nights without faults, the baseline of recovery's cost
POINTS = (
    "train:1",
    "train:2",
    "train:3",
    "eval",
)  # where a fault hits: after k training steps, in evaluation
STEPS = 3
PROMPTS = 6
FIRST_NIGHT = dt.date(2026, 1, 1)
LINE = "soak"
MODEL = "qerl-soak"
MACHINES = (("machine-0", "0"), ("machine-1", "1"))
NIGHT_TIMEOUT_S = 900.0
OPERATOR_RESTARTS = 3  # an operator gives up on a night after this many restarts of it
JANITOR_PATIENCE_S = 120.0  # a crashed night the janitor has not started again by then: the operator does
SETTLE_S = 25.0  # longer than a janitor's sweep (its lease check: QERL_LEASE_REGAIN_S 8 + 5 s) and period
REPOSSESSOR_S = 15.0  # how often Prefect's server frees the slots of expired leases


def slot_lease_s() -> float:
    """How long a dead attempt's ``qerl-gpus`` slot stays taken: the lease qerl asks for (Prefect's
    default 300 s where qerl names none) and a loop of Prefect's repossessor."""
    import qerl.flows.fleet as fleet_flows

    return float(getattr(fleet_flows, "SLOT_LEASE_S", 300.0)) + REPOSSESSOR_S + 10.0  # and a margin


SLOT_LEASE_S = slot_lease_s()
TMPFS_SIZE = "512m"
BASE_STAGES = ("quantize", "dequantize", "quality")  # finished artifacts every night looks up
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
BASIC_AUTH_USER = "admin"


# ---- the schedule -------------------------------------------------------------------------------
@dataclass
class Fault:
    night: str
    kind: str
    at: str  # a POINTS entry; for a deadline: the fraction of the reference attempt it allows
    fraction: float | None = None


def schedule(nights: int, seed: int, kinds: tuple[str, ...]) -> list[Fault]:
    """One fault a night: the kinds in a fresh shuffled order each cycle (so with N >= 3 x kinds every
    kind appears at least 3 times), each at a random point of its night."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < nights:
        cycle = list(kinds)
        rng.shuffle(cycle)
        order += cycle
    out = []
    for i in range(nights):
        night = (FIRST_NIGHT + dt.timedelta(days=i)).isoformat()
        kind = order[i]
        if kind == NO_FAULT:
            out.append(Fault(night, kind, "no fault"))
        elif kind == "deadline":
            fraction = round(rng.uniform(0.3, 0.9), 2)
            out.append(Fault(night, kind, f"deadline at {fraction:.0%} of the reference attempt", fraction))
        elif kind == "twice":
            out.append(Fault(night, kind, "while the first attempt holds the night"))
        else:
            out.append(Fault(night, kind, rng.choice(POINTS)))
    return out


def describe_point(at: str) -> str:
    if at.startswith("train:"):
        return f"after training step {at.split(':')[1]}"
    return "in evaluation" if at == "eval" else at


# ---- small helpers (copied from tests/fleet/test_fleet_nights.py) ---------------------------------
def adapter_digest(work: Path, record: dict) -> str:
    """The sha256 of the night's final LoRA weights (``adapter_config.json`` names the machine's own
    path of the quantized base, so it differs between work dirs by design)."""
    key = record["steps"][-1]["manifests"]["train"]
    files = json.loads((work / "store" / "objects" / "train" / key / "manifest.json").read_text())["files"]
    return files["adapter/adapter_model.safetensors"]["sha256"]


def attempt_s(record: dict) -> float:
    started, ended = (dt.datetime.fromisoformat(record[k]) for k in ("started_at", "updated_at"))
    return (ended - started).total_seconds()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stamp(iso: str | None) -> dt.datetime:
    return dt.datetime.fromisoformat(iso) if iso else dt.datetime.min.replace(tzinfo=dt.UTC)


def night_label(night: str) -> str:
    return night.replace("-", "")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def builds(work: Path) -> list[dict]:
    path = work / "store" / "builds.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


# ---- the learner, data and config ----------------------------------------------------------------
def night_config(learner: Path, base: Path) -> dict:
    import tests.flows.test_nightly as nightly

    kept = nightly.N_PROBLEMS
    nightly.N_PROBLEMS = 480  # every distinct level-1 problem: 25 nights before the stream wraps
    try:
        data = nightly._dataset(base / "data.jsonl")
    finally:
        nightly.N_PROBLEMS = kept
    cfg = nightly._night_config(learner, data)
    cfg["loop"].update(name=LINE, steps=STEPS, prompts_per_step=PROMPTS, warm_start="champion")
    cfg["store"]["keep_adapters_every"] = 1
    # a night is promoted when it beats the champion at all: some nights win, some lose, so the
    # champion moves and later nights warm-start from different ones
    cfg.setdefault("registry", {}).update(promote_margin=0.0, promote_margin_se=0.0)
    cfg["train"]["lr"] = 5e-3  # at 1e-3 three steps hardly move the validation accuracy: no night would win
    return cfg


def build_learner(base: Path) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fleet import _learner

    return _learner(base)


# ---- the reference: one machine, no fleet, no faults ---------------------------------------------
@dataclass
class RefNight:
    night: str
    seconds: float
    attempt_s: float
    digest: str
    version: int
    promoted: bool
    promotion: str
    start_slot: int
    warm_start: str | None
    load: float = 0.0  # the 1-minute load average when the night ended


class Reference:
    """The nights run one after another by ``qerl run --night`` (optionally in a thread beside the
    fleet's start, ``background``); ``night(i)`` waits for night ``i``."""

    def __init__(self, cfg: dict, base: Path, nights: list[str], work: Path | None = None):
        import yaml

        self.base, self.nights = base, nights
        self.work = work or base / "reference"
        self.config = base / "reference.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("QERL_", "PREFECT_API", "MLFLOW_TRACKING"))
        }
        self.done: list[RefNight] = []
        self.error: str | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            for night in self.nights:
                self._one(night)
        except Exception as err:  # noqa: BLE001  (reported by night())
            with self._cond:
                self.error = f"{type(err).__name__}: {err}"
                self._cond.notify_all()

    def load(self, seconds: dict[str, float]) -> None:
        """The nights of a reference already run in ``self.work`` (``--reference-from``); a night's
        time from ``seconds`` (an earlier soak's JSON), else its record's attempt."""
        for night in self.nights:
            record = self.record(night)
            reg = record["registration"]
            warm = (record.get("plan") or {}).get("warm_start") or {}
            self.done.append(
                RefNight(
                    night,
                    seconds.get(night, attempt_s(record)),
                    attempt_s(record),
                    adapter_digest(self.work, record),
                    int(reg["version"]),
                    bool(reg["promoted"]),
                    reg["promotion"],
                    int(record["plan"]["start_slot"]),
                    warm.get("version"),
                )  # fmt: skip
            )

    def background(self) -> None:
        self._thread = threading.Thread(target=self.run, name="soak-reference", daemon=True)
        self._thread.start()

    def _one(self, night: str) -> None:
        started = time.monotonic()
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "qerl"), "run", "--night", night, "--config", str(self.config),
             "--work-dir", str(self.work)],
            env=self.env, capture_output=True, text=True, timeout=NIGHT_TIMEOUT_S,
        )  # fmt: skip
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(
                f"reference night {night} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        record = self.record(night)
        reg = record["registration"]
        warm = (record.get("plan") or {}).get("warm_start") or {}
        made = RefNight(
            night, seconds, attempt_s(record), adapter_digest(self.work, record), int(reg["version"]),
            bool(reg["promoted"]), reg["promotion"], int(record["plan"]["start_slot"]), warm.get("version"),
            os.getloadavg()[0],
        )  # fmt: skip
        with self._cond:
            self.done.append(made)
            self._cond.notify_all()
        print(f"reference {night}: {seconds:.1f} s, v{made.version} promoted={made.promoted}", flush=True)

    def record(self, night: str) -> dict:
        (path,) = list((self.work / "runs").glob(f"*-{night_label(night)}/run.json"))
        return json.loads(path.read_text())

    def night(self, i: int, timeout_s: float = 2 * NIGHT_TIMEOUT_S) -> RefNight:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.done) <= i:
                if self.error:
                    raise RuntimeError(f"the reference failed: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"reference night {i + 1} not done in {timeout_s:g} s")
                self._cond.wait(min(left, 5.0))
            return self.done[i]

    def cursor(self) -> int | None:
        data = read_json(self.work / "cursors" / f"{LINE}.json")
        return None if not data else max(s["next_slot"] for s in data["streams"].values())


# ---- the fleet's side ----------------------------------------------------------------------------
def http_json(method: str, url: str, **kw: Any) -> Any:
    import httpx

    got = httpx.request(method, url, timeout=kw.pop("timeout", 15), **kw)
    got.raise_for_status()
    return got.json() if got.content else None


def registered(fleet: Any) -> list[dict]:
    got = http_json(
        "GET",
        f"{fleet.tracking_uri}/api/2.0/mlflow/model-versions/search",
        params={"filter": f"name='{MODEL}'", "max_results": 1000},
        auth=(BASIC_AUTH_USER, fleet.secrets()[2]),
    )
    return got.get("model_versions", [])


def champion(fleet: Any) -> int | None:
    got = http_json(
        "GET",
        f"{fleet.tracking_uri}/api/2.0/mlflow/registered-models/get",
        params={"name": MODEL},
        auth=(BASIC_AUTH_USER, fleet.secrets()[2]),
    )
    for alias in got["registered_model"].get("aliases", []):
        if alias["alias"] == "champion":
            return int(alias["version"])
    return None


def gpu_slots(fleet: Any) -> int:
    return int(http_json("GET", f"{fleet.api}/v2/concurrency_limits/qerl-gpus")["active_slots"])


def gpu_locks_held(fleet: Any) -> list[str]:
    """The GPU lock files some process holds now (a try-lock of each, released at once)."""
    held = []
    for path in sorted(Path(fleet.env["QERL_GPU_LOCK_DIR"]).glob("gpu-*.lock")):
        with open(path, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(path.name)
                continue
            fcntl.flock(fh, fcntl.LOCK_UN)
    return held


def cursor_rows(fleet: Any) -> list[tuple[str, int, list]]:
    import psycopg

    with psycopg.connect(fleet.postgres.url, connect_timeout=10) as conn:
        rows = conn.execute("SELECT stream, next_slot, runs FROM qerl_cursors WHERE line = %s", (LINE,))
        return [(r[0], int(r[1]), list(r[2])) for r in rows.fetchall()]


def night_runs(fleet: Any, deployment: str, night: str) -> list[dict]:
    return [r for r in fleet.flow_runs(deployment) if (r.get("parameters") or {}).get("night") == night]


def attempt_of(flow_run: dict) -> dict:
    message = ((flow_run.get("state") or {}).get("message") or "")[:300]
    return {
        "id": flow_run["id"],
        "name": flow_run["name"],
        "state": flow_run["state_type"],
        "message": message,
        "end_time": flow_run.get("end_time"),
    }


def tmp_leftovers(work: Path, before: float) -> list[str]:
    """Unfinished build folders under the machine's store/tmp older than ``before`` (epoch s)."""
    tmp = work / "store" / "tmp"
    if not tmp.is_dir():
        return []
    return sorted(p.name for p in tmp.iterdir() if p.lstat().st_mtime < before)


def mount_tmpfs(path: Path) -> str | None:
    """Mount a tmpfs of ``TMPFS_SIZE`` on ``path``; None, or why it could not."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"mount exited {proc.returncode}")


def can_mount_tmpfs() -> str | None:
    probe = Path(tempfile.mkdtemp(prefix="qerl-soak-mount-"))
    try:
        why = mount_tmpfs(probe)
        if why is None:
            subprocess.run(["umount", str(probe)], capture_output=True)
        return why
    finally:
        shutil.rmtree(probe, ignore_errors=True)


# a ``qerl run --night`` typed on the other machine while the night runs: its heavy imports first, then
# it waits for the soak's word (a line on stdin) and runs the CLI in this process, so that it asks for
# the night while the first attempt holds it (a fresh process would take ~15 s to get there)
HAND_RUN = r"""
import json, sys
import torch, transformers, mlflow, psycopg, boto3  # noqa: F401
line = sys.stdin.readline()
if not line.strip():
    sys.exit(0)
sys.argv = ["qerl", *json.loads(line)]
from qerl.flows.cli import entry
entry()
"""

SWEEP = r"""
import json, sys
from pathlib import Path
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.shared import open_shared
work, uri, stage, key = sys.argv[1:5]
store = ArtifactStore(Path(work) / "store", open_shared(uri))
hit = store.get(stage, key)
print(json.dumps({"served": hit is not None}))
"""


@dataclass
class Corruption:
    night: str
    machine: str
    stage: str
    key: str
    file: str
    detected: str | None = None  # the night (or "final sweep") whose lookup found it
    healed: bool | None = None


@dataclass
class NightResult:
    night: str
    run_id: str
    fault: str
    at: str
    hit: str = ""
    machine: str = ""
    attempts: list[dict] = field(default_factory=list)
    operator_restarts: int = 0
    fleet_s: float = 0.0
    ref_s: float = 0.0
    checks: dict[str, list] = field(default_factory=dict)  # name -> [ok, detail]
    notes: list[str] = field(default_factory=list)
    completed: bool = False
    late: list[dict] = field(default_factory=list)  # flow runs of the night that came after its check
    load: float = 0.0  # the 1-minute load average when the night ended

    @property
    def failed_checks(self) -> list[str]:
        return [name for name, (ok, _) in self.checks.items() if not ok]

    @property
    def verdict(self) -> str:
        if not self.completed:
            return "LOST"
        bad = self.failed_checks
        return "ok" if not bad else "FAIL: " + ", ".join(bad)


class Soak:
    def __init__(self, fleet: Any, cfg: dict, ref: Reference, faults: list[Fault], seed: int):
        import yaml

        self.fleet, self.cfg, self.ref, self.faults, self.seed = fleet, cfg, ref, faults, seed
        self.config = fleet.write_config(cfg, "soak", store="soak", model=MODEL)
        self.deployment = fleet.deploy(self.config)
        self.fleet_cfg = yaml.safe_load(self.config.read_text())
        self.filled: Path | None = None
        self.machines: dict[str, Any] = {}
        for name, gpu in MACHINES:
            self.machines[name] = fleet.worker(name, gpu=gpu)
        self.results: list[NightResult] = []
        self.corruptions: list[Corruption] = []
        self.kills: list[float] = []  # monotonic times of kills (a killed attempt's slot lease outlives it)
        self.stops: list[float] = []  # and of the other attempts that ended without releasing theirs
        self.champion: int | None = None

    # -- machines --
    def work(self, name: str) -> Path:
        return self.machines[name].work

    def run_id(self, night: str) -> str:
        from qerl.pipeline.planning.run_config import RunConfig
        from qerl.pipeline.planning.runs import run_id_for

        return run_id_for(RunConfig.model_validate(self.fleet_cfg), dt.date.fromisoformat(night))

    def records(self, run_id: str) -> dict[str, dict]:
        out = {}
        for name in self.machines:
            rec = read_json(self.work(name) / "runs" / run_id / "run.json")
            if rec:
                out[name] = rec
        return out

    def running_on(self, run_id: str) -> str | None:
        """The machine whose record of the night says running, newest first."""
        live = [
            (r.get("updated_at") or "", n)
            for n, r in self.records(run_id).items()
            if r.get("status") == "running"
        ]
        return max(live)[1] if live else None

    def replace(self, name: str) -> None:
        """A replacement worker for machine ``name`` (same name, work dir and GPU)."""
        old = self.machines[name]
        with contextlib.suppress(ValueError):
            self.fleet.workers.remove(old)
        self.machines[name] = self.fleet.worker(name, gpu=old.gpu)

    # -- one night --
    def night(self, i: int, fault: Fault) -> NightResult:
        night = fault.night
        run_id = self.run_id(night)
        res = NightResult(night, run_id, fault.kind, fault.at)
        self.results.append(res)
        started_wall = time.time()
        offsets = {n: len(builds(self.work(n))) for n in self.machines}
        started = time.monotonic()
        hand = None
        if fault.kind == "deadline":
            ref = self.ref.night(i)
            seconds = max(1.0, fault.fraction * ref.attempt_s)
            res.hit = f"deadline {seconds:.1f} s into the attempt ({fault.fraction:.0%} of the reference's {ref.attempt_s:.1f} s)"
            params = json.loads(json.dumps(self.deployment_params()))
            params["config"]["loop"]["deadline_h"] = seconds / 3600.0
            first = http_json(
                "POST",
                f"{self.fleet.api}/deployments/{self.deployment}/create_flow_run",
                json={"parameters": {**params, "night": night}, "tags": ["qerl", "soak-deadline"]},
            )["id"]
        else:
            first = self.fleet.start_night(self.deployment, night)
            if fault.kind == "twice":
                hand = self.start_hand_run(night)
        try:
            self.inject(res, fault, run_id, first, offsets, hand)
            self.wait(res, fault, run_id, first)
        except Exception as err:
            res.notes.append(f"the soak stopped on this night: {type(err).__name__}: {err}")
            raise
        finally:
            res.fleet_s = time.monotonic() - started
            res.load = os.getloadavg()[0]
            if hand is not None:
                hand_verdict = self.end_hand_run(hand)
        ref = self.ref.night(i)
        res.ref_s = ref.seconds
        self.check(i, res, ref, started_wall)
        if hand is not None:
            res.checks["hand-started run"] = hand_verdict
        return res

    def end_hand_run(self, hand: subprocess.Popen) -> list:
        """[refused, what it said]: the ``qerl run --night`` typed on the other machine."""
        with contextlib.suppress(OSError, ValueError):
            hand.stdin.close()  # one that never got its word exits
        try:
            hand.wait(timeout=NIGHT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            hand.kill()
            hand.wait()
        said = hand.log_path.read_text(errors="replace") if hand.log_path.is_file() else ""
        lines = [ln for ln in said.splitlines() if "already running" in ln or "held by" in ln]
        if hand.returncode != 0 and lines:
            return [True, f"refused (exit {hand.returncode}): {lines[0].strip()[:300]}"]
        if hand.returncode == 0:
            return [True, "ran after the first attempt had ended: a re-run of the completed night (exit 0)"]
        return [False, f"exit {hand.returncode}, not a refusal: {said[-600:]}"]

    def deployment_params(self) -> dict:
        return http_json("GET", f"{self.fleet.api}/deployments/{self.deployment}")["parameters"]

    def start_hand_run(self, night: str) -> subprocess.Popen:
        log_path = self.fleet.base / f"hand-run-{night}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", HAND_RUN],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                env={**self.fleet.env}, start_new_session=True,
            )  # fmt: skip
        proc.log_path = log_path  # type: ignore[attr-defined]
        return proc

    def wait_point(self, at: str, offsets: dict[str, int], run_id: str, timeout_s: float) -> str | None:
        """The machine where the night reached ``at`` (new builds since the night began), or None when
        the night ended first."""
        deadline = time.monotonic() + timeout_s
        stage, need = ("train", int(at.split(":")[1])) if at.startswith("train:") else ("evaluate", 1)
        while time.monotonic() < deadline:
            for name in self.machines:
                new = builds(self.work(name))[offsets[name] :]
                if sum(1 for b in new if b.get("event") == "built" and b.get("stage") == stage) >= need:
                    return name
            recs = self.records(run_id)
            if any(r.get("status") == "completed" for r in recs.values()):
                return None
            time.sleep(0.05)
        raise RuntimeError(f"the night did not reach {at} in {timeout_s:g} s\n{self.fleet.logs()}")

    def wait_running(self, run_id: str, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            name = self.running_on(run_id)
            if name:
                return name
            if any(r.get("status") == "completed" for r in self.records(run_id).values()):
                return None
            time.sleep(0.05)
        raise RuntimeError(f"no attempt at {run_id} started in {timeout_s:g} s\n{self.fleet.logs()}")

    def inject(
        self, res: NightResult, fault: Fault, run_id: str, first: str, offsets: dict, hand: Any
    ) -> None:
        kind = fault.kind
        if kind == NO_FAULT:
            res.hit = "no fault"
            return
        if kind == "deadline":
            return  # the flow run carries it
        if kind == "twice":
            name = self.wait_running(run_id, NIGHT_TIMEOUT_S)
            if name is None:
                res.hit = "missed: the night completed before the second attempt"
                return
            res.machine = name
            steps = len((self.records(run_id).get(name) or {}).get("steps") or [])
            other = next(n for n in self.machines if n != name)
            args = [
                "run",
                "--night",
                fault.night,
                "--config",
                str(self.config),
                "--work-dir",
                str(self.work(other)),
            ]
            hand.stdin.write(json.dumps(args) + "\n")
            hand.stdin.flush()
            self.fleet.start_night(self.deployment, fault.night)
            res.hit = f"{name} running the night (step {steps} of {STEPS} recorded); the second attempts: a flow run and `qerl run --night` on {other}"
            return
        name = self.wait_point(fault.at, offsets, run_id, NIGHT_TIMEOUT_S)
        if name is None:
            res.hit = f"missed: the night completed before {describe_point(fault.at)}"
            return
        res.machine = name
        where = f"{name} {describe_point(fault.at)}"
        if kind == "kill":
            self.machines[name].kill()
            self.kills.append(time.monotonic())
            self.replace(name)
            res.hit = f"{where}: its whole session SIGKILLed, a replacement worker started"
        elif kind.startswith("restart-"):
            server = {"prefect": self.fleet.prefect, "mlflow": self.fleet.mlflow, "postgres": self.fleet.postgres,
                      "s3": self.fleet.s3}[kind.removeprefix("restart-")]  # fmt: skip
            t0 = time.monotonic()
            server.restart()
            res.hit = (
                f"{where}: {kind.removeprefix('restart-')} down and back in {time.monotonic() - t0:.1f} s"
            )
        elif kind == "corrupt-cache":
            res.hit = f"{where}: " + self.corrupt(name, fault)
        elif kind == "disk-full":
            res.hit = f"{where}: " + self.fill(name)
        else:
            raise ValueError(f"unknown fault kind {kind}")

    def corrupt(self, name: str, fault: Fault) -> str:
        """Flip one byte of a file of a finished base artifact in ``name``'s store, size and mtime kept."""
        rng = random.Random(f"{self.seed}-{fault.night}-{fault.kind}")
        objects = self.work(name) / "store" / "objects"
        candidates = []
        for stage in BASE_STAGES:
            for art in sorted((objects / stage).glob("*")):
                manifest = read_json(art / "manifest.json")
                if not manifest:
                    continue
                for fname, rec in sorted(manifest["files"].items()):
                    if (
                        fname not in manifest.get("pruned", {})
                        and rec["size"] > 0
                        and (art / fname).is_file()
                    ):
                        candidates.append((stage, art.name, fname))
        if not candidates:
            raise RuntimeError(f"{name} has no finished base artifact to corrupt")
        stage, key, fname = rng.choice(candidates)
        path = objects / stage / key / fname
        st = path.stat()
        offset = rng.randrange(st.st_size)
        with open(path, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ 0x01]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.corruptions.append(Corruption(fault.night, name, stage, key, fname))
        return f"byte {offset} of {stage}/{key[:8]}/{fname} flipped (size and mtime kept)"

    def fill(self, name: str) -> str:
        work = self.work(name)
        filler = work / "soak-filler.bin"
        free = shutil.disk_usage(work).free
        size = max(0, free - 16 * 1024)
        with open(filler, "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, size)
        self.filled = filler
        stop = self.topping = threading.Event()
        threading.Thread(target=self._keep_full, args=(filler, stop), daemon=True).start()
        return (
            f"its work dir filled ({size / 2**20:.0f} MiB, {shutil.disk_usage(work).free // 1024} KiB left) "
            "and kept full until the operator frees it"
        )

    @staticmethod
    def _keep_full(filler: Path, stop: threading.Event) -> None:
        """What the machine's retention frees is taken again (as by another process writing), so the
        disk stays full until the operator frees it."""
        while not stop.wait(0.1):
            with contextlib.suppress(OSError):
                free = shutil.disk_usage(filler.parent).free
                if free > 32 * 1024:
                    with open(filler, "r+b") as fh:
                        end = os.fstat(fh.fileno()).st_size
                        os.posix_fallocate(fh.fileno(), end, free - 16 * 1024)

    def unfill(self) -> None:
        if self.filled is not None:
            self.topping.set()
            self.filled.unlink(missing_ok=True)
            self.filled = None

    def wait(self, res: NightResult, fault: Fault, run_id: str, first: str) -> None:
        """Until the night completed (every flow run of it terminal); the operator's part: free a filled
        disk once the attempt ended, start the night again after a failure qerl reported (a deadline, a
        full disk) or a crash the janitor did not take up."""
        deadline = time.monotonic() + NIGHT_TIMEOUT_S
        deadline_handled = fault.kind != "deadline"
        terminal_since: float | None = None
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"night {fault.night} did not complete in {NIGHT_TIMEOUT_S:g} s\n{self.fleet.logs()}"
                )
            runs = night_runs(self.fleet, self.deployment, fault.night)
            states = [r["state_type"] for r in runs]
            first_run = next((r for r in runs if r["id"] == first), None)
            first_ended = first_run is not None and first_run["state_type"] in TERMINAL
            if self.filled is not None and first_ended:
                self.unfill()
                res.notes.append("operator: freed the full disk once the attempt had ended")
            if not deadline_handled and first_ended:
                deadline_handled = True
                self.note_deadline(res, first_run)
                if first_run["state_type"] != "COMPLETED":
                    self.operator_restart(res, fault, "the night passed its deadline")
                    time.sleep(1.0)
                    continue
            if states and all(s in TERMINAL for s in states):
                if "COMPLETED" in states:
                    res.completed = True
                    res.attempts = [attempt_of(r) for r in runs]
                    return
                terminal_since = terminal_since or time.monotonic()
                newest = states[-1]
                if newest == "FAILED" or time.monotonic() - terminal_since > JANITOR_PATIENCE_S:
                    if res.operator_restarts >= OPERATOR_RESTARTS:
                        raise RuntimeError(
                            f"night {fault.night}: the operator gave up after {res.operator_restarts} restarts: {states}"
                        )
                    why = (
                        "its attempt failed"
                        if newest == "FAILED"
                        else f"crashed, no new flow run in {JANITOR_PATIENCE_S:g} s"
                    )
                    self.operator_restart(res, fault, why)
                    terminal_since = None
            else:
                terminal_since = None
            time.sleep(1.0)

    def note_deadline(self, res: NightResult, flow_run: dict) -> None:
        """What stopped the deadline's attempt: its state, and the reason qerl logged on its machine."""
        state = flow_run["state_type"]
        if state == "COMPLETED":
            res.hit = "missed: " + res.hit + ": the night completed within it"
            return
        self.stops.append(time.monotonic())
        found, steps = [], 0
        for name in self.machines:
            log = self.work(name) / "runs" / res.run_id / "run.log"
            if not log.is_file():
                continue
            for line in log.read_text(errors="replace").splitlines():
                if "DeadlineExceeded" in line:
                    found.append(f"{name}: {line.strip()[:200]}")
                    res.machine = name
                    break
                if " step " in line and f"/{STEPS} sigma=" in line:  # "step k/3 sigma=..." of the attempt
                    steps = int(line.split(" step ")[1].split("/")[0])
        res.notes.append(
            f"deadline attempt {flow_run['name']} {state}; "
            + (found[0] if found else "no DeadlineExceeded in any run.log")
        )
        if found:
            res.hit += f"; it stopped the attempt on {res.machine} after {steps} of {STEPS} steps"

    def operator_restart(self, res: NightResult, fault: Fault, why: str) -> None:
        self.unfill()
        self.fleet.start_night(self.deployment, fault.night)
        res.operator_restarts += 1
        res.notes.append(f"operator: started the night again ({why})")

    # -- invariants --
    def check(self, i: int, res: NightResult, ref: RefNight, night_started: float) -> None:
        k = i + 1
        checks = res.checks
        recs = {n: r for n, r in self.records(res.run_id).items() if r.get("status") == "completed"}
        if not recs:
            checks["completed"] = [False, "no machine holds a completed record"]
            return
        name, record = max(recs.items(), key=lambda kv: kv[1].get("updated_at") or "")
        res.machine = res.machine or name
        failed = [a for a in res.attempts if a["state"] != "COMPLETED"]
        unexplained = [a["name"] for a in failed if not a["message"].strip()]
        self.check_history(res)
        checks["completed"] = [
            not unexplained,
            f"completed on {name} in flow run {len(res.attempts)} of {len(res.attempts)}"
            if not failed
            else f"completed on {name}; "
            + "; ".join(f"{a['name']} {a['state']}: {a['message'][:120]}" for a in failed),
        ]
        digest = adapter_digest(self.work(name), record)
        checks["adapter"] = [digest == ref.digest, f"{digest[:12]} vs reference {ref.digest[:12]}"]
        warm = (record["plan"].get("warm_start") or {}).get("version")
        checks["warm start"] = [
            warm == ref.warm_start,
            f"from {f'v{warm}' if warm else 'base'} (reference: {f'v{ref.warm_start}' if ref.warm_start else 'base'})",
        ]
        slot = int(record["plan"]["start_slot"])
        checks["data slice"] = [slot == ref.start_slot, f"start slot {slot} vs reference {ref.start_slot}"]
        versions = registered(self.fleet)
        runs = {v.get("run_id") for v in versions}
        reg = record.get("registration") or {}
        checks["registry"] = [
            len(versions) == k and len(runs) == k and reg.get("run_id") in runs,
            f"{len(versions)} versions after {k} nights (this night: v{reg.get('version')})",
        ]
        now = champion(self.fleet)
        promoted = bool(reg.get("promoted"))
        moved = now != self.champion
        ref_champion = max((r.version for r in self.ref.done[:k] if r.promoted), default=None)
        ok = promoted == ref.promoted and now == ref_champion and (promoted or not moved)
        checks["promotion"] = [
            ok,
            f"{'promoted' if promoted else 'not promoted'} (reference: {'promoted' if ref.promoted else 'not'}); "
            f"champion v{now} (reference v{ref_champion})",
        ]
        res.notes.append(f"promotion: {reg.get('promotion', '')[:160]}")
        self.champion = now
        live = [
            f"{r['name']} {r['state_type']}"
            for r in self.fleet.flow_runs(self.deployment)
            if r["state_type"] in ("RUNNING", "PENDING")
        ]
        checks["no live flow run"] = [not live, ", ".join(live) or "none RUNNING or PENDING"]
        held = gpu_locks_held(self.fleet)
        checks["gpu locks"] = [not held, ", ".join(held) or "all free"]
        slots = gpu_slots(self.fleet)
        recent_kills = sum(1 for t in self.kills if time.monotonic() - t < SLOT_LEASE_S)
        checks["gpu slots"] = [
            slots <= recent_kills,
            f"{slots} of qerl-gpus occupied"
            + (
                f" (the lease of {recent_kills} killed attempt(s), expiring within {SLOT_LEASE_S:g} s of the kill)"
                if slots
                else ""
            ),
        ]
        rows = cursor_rows(self.fleet)
        slot_now = rows[0][1] if len(rows) == 1 else None
        in_runs = rows[0][2].count(res.run_id) if len(rows) == 1 else 0
        checks["cursor"] = [
            slot_now == k * STEPS and in_runs == 1,
            f"next_slot {slot_now} after {k} nights (want {k * STEPS}); this night listed {in_runs}x",
        ]
        leftovers = {n: tmp_leftovers(self.work(n), night_started) for n in self.machines}
        leftovers = {n: v for n, v in leftovers.items() if v}
        checks["tmp"] = [
            not leftovers,
            "; ".join(f"{n}: {', '.join(v)}" for n, v in leftovers.items())
            or "no leftovers older than the night",
        ]
        self.detect_corruptions(res.night)
        if res.fault == "twice":
            self.check_twice(res)

    def completed_before(self, flow_run_id: str) -> bool:
        """Whether the flow run was COMPLETED once and is in another state now (its states' history)."""
        states = http_json("GET", f"{self.fleet.api}/flow_run_states/", params={"flow_run_id": flow_run_id})
        states = sorted(states, key=lambda st: st["timestamp"])
        return any(st["type"] == "COMPLETED" for st in states[:-1]) and states[-1]["type"] != "COMPLETED"

    def check_history(self, res: NightResult) -> None:
        """No flow run of the night was set CRASHED (or else) after it had COMPLETED."""
        overwritten = [a.get("later") or a for a in res.attempts if self.completed_before(a["id"])]
        res.checks["no completed run crashed"] = [
            not overwritten,
            "; ".join(
                f"{a['name']}: COMPLETED, then {a['state']} ({a['message'][:120]})" for a in overwritten
            )
            or "no flow run's COMPLETED state was overwritten",
        ]

    def revisit(self) -> None:
        """Every night again, once the soak is over: flow runs of it that came after its check (a late
        re-run), and completed ones set to another state since."""
        for res in self.results:
            if not res.completed:
                continue
            runs = night_runs(self.fleet, self.deployment, res.night)
            seen = {a["id"] for a in res.attempts}
            late = [r for r in runs if r["id"] not in seen]
            if late:
                res.checks["no late flow run"] = [
                    False,
                    "; ".join(
                        f"{r['name']} {r['state_type']} (created {r['created'][11:19]}, tags {','.join(r.get('tags') or [])})"
                        for r in late
                    ),
                ]
            res.late = [attempt_of(r) for r in late]
            now = {r["id"]: r for r in runs}
            for a in res.attempts:
                if a["id"] in now and now[a["id"]]["state_type"] != a["state"]:
                    a["later"] = attempt_of(now[a["id"]])
            self.check_history(res)

    def check_twice(self, res: NightResult) -> None:
        second = res.attempts[1:]
        refused = [
            a
            for a in second
            if a["state"] == "FAILED" and ("already running" in a["message"] or "held by" in a["message"])
        ]
        noop = [a for a in second if a["state"] == "COMPLETED"]
        detail = (
            "; ".join(f"{a['name']} {a['state']} {a['message'][:100]}" for a in second)
            or "no second flow run"
        )
        first_end = (res.attempts[0].get("end_time") or "") if res.attempts else ""
        rebuilt = [
            f"{n}: {b['stage']}/{b['key'][:8]}"
            for n in self.machines
            for b in builds(self.work(n))
            if b.get("event") == "built" and first_end and stamp(b.get("at")) > stamp(first_end)
        ]
        if noop and rebuilt:
            detail += "; built after the first completed: " + ", ".join(rebuilt)
        res.checks["second flow run"] = [
            bool(refused or noop) and not rebuilt,
            (
                "refused: "
                if refused
                else "queued by the deployment's concurrency limit, then a re-run of the completed night: "
                if noop
                else ""
            )
            + detail,
        ]

    def detect_corruptions(self, night: str) -> None:
        for c in self.corruptions:
            if c.detected:
                continue
            trash = self.work(c.machine) / "store" / "trash"
            if trash.is_dir() and any(p.name.startswith(c.key) for p in trash.iterdir()):
                c.detected = night
                path = self.work(c.machine) / "store" / "objects" / c.stage / c.key / c.file
                manifest = read_json(path.parent / "manifest.json") if path.is_file() else None
                c.healed = bool(manifest) and sha256(path) == manifest["files"][c.file]["sha256"]

    def final_sweep(self) -> None:
        """Look up each corrupted artifact that no night has looked up since (as the next night on that
        machine would: ``ArtifactStore.get``, verify once, the shared store behind it)."""
        uri = self.fleet_cfg["store"]["uri"]
        for c in self.corruptions:
            if c.detected:
                continue
            proc = subprocess.run(
                [sys.executable, "-c", SWEEP, str(self.work(c.machine)), uri, c.stage, c.key],
                env=self.fleet.env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            self.detect_corruptions("the final sweep")
            if not c.detected:
                c.detected = None
                c.healed = False
                print(
                    f"final sweep of {c.stage}/{c.key}: {proc.stdout[-500:]}{proc.stderr[-1500:]}", flush=True
                )

    def wait_slots_free(self, timeout_s: float) -> tuple[int, float]:
        started = time.monotonic()
        while True:
            slots = gpu_slots(self.fleet)
            if slots == 0 or time.monotonic() - started > timeout_s:
                return slots, time.monotonic() - started
            time.sleep(5)


# ---- the whole soak ------------------------------------------------------------------------------
def run_soak(
    nights: int,
    seed: int,
    out: Path | None = OUT,
    kinds: tuple[str, ...] | list[str] | None = None,
    base: Path | None = None,
    learner: Path | None = None,
    overlap: bool = False,
    slot_wait_s: float | None = None,
    reference_from: Path | None = None,
    baseline: dict | None = None,
) -> dict:
    """Run the soak (module docstring); returns the summary (also written to ``out`` and a JSON
    beside it when ``out`` is given). ``kinds``: the fault kinds (default all); ``base``: the
    working folder (default a temporary one, removed after); ``learner``: a built learner model;
    ``overlap``: run the reference beside the fleet instead of before it (faster, noisier times);
    ``slot_wait_s``: how long to wait at the end for the GPU slots of killed attempts to come free
    (default: until their leases expire); ``reference_from``: an earlier soak's ``--keep`` folder whose
    learner and reference nights are used instead of building and running them again (its nights'
    times from the ``soak.json`` there, if any); ``baseline``: a fault-free soak's JSON (``--kinds none``)
    of the same nights, what the page measures recovery's cost against."""
    from fleet_kit import start_fleet
    from postgres import start_postgres
    from seaweed import start_seaweed

    kinds = tuple(kinds or KINDS)
    unknown = set(kinds) - set(KINDS)
    if kinds == (NO_FAULT,):
        unknown = set()
    if unknown:
        raise ValueError(
            f"unknown fault kinds {sorted(unknown)}: use {', '.join(KINDS)}, or {NO_FAULT} alone"
        )
    skipped = {}
    if "disk-full" in kinds:
        why = can_mount_tmpfs()
        if why is not None:
            skipped["disk-full"] = f"mount -t tmpfs was refused here ({why})"
            kinds = tuple(k for k in kinds if k != "disk-full")
    faults = schedule(nights, seed, kinds)
    tmp = None
    if base is None:
        tmp = tempfile.TemporaryDirectory(prefix="qerl-soak-")
        base = Path(tmp.name)
    base.mkdir(parents=True, exist_ok=True)
    mounts: list[Path] = []
    started = time.monotonic()
    fleet = soak = None
    try:
        if reference_from is not None:
            learner = learner or reference_from / "learner"
        learner = learner or build_learner(base)
        cfg = night_config(learner, base)
        ref = Reference(cfg, base, [f.night for f in faults], reference_from and reference_from / "reference")
        earlier: dict = {}
        if reference_from is not None:
            earlier = read_json(reference_from / "soak.json") or {}
            ref.load({r["night"]: r["ref_s"] for r in earlier.get("results", [])})
        elif overlap:
            ref.background()
        else:
            ref.run()
            if ref.error:
                raise RuntimeError(f"the reference failed: {ref.error}")
        if "disk-full" in kinds:
            for name, _ in MACHINES:
                path = base / "fleet" / "machines" / name
                why = mount_tmpfs(path)
                if why is not None:
                    raise RuntimeError(f"tmpfs on {path}: {why}")
                mounts.append(path)
        t0 = time.monotonic()
        fleet = start_fleet(base / "fleet", start_postgres, start_seaweed)
        fleet_up_s = time.monotonic() - t0
        print(f"fleet up in {fleet_up_s:.1f} s", flush=True)
        soak = Soak(fleet, cfg, ref, faults, seed)
        error = None
        for i, fault in enumerate(faults):
            try:
                res = soak.night(i, fault)
            except Exception as err:  # a lost night: every later one depends on it
                error = f"night {fault.night}: {type(err).__name__}: {err}"
                print(error[:4000], flush=True)
                break
            print(
                f"night {res.night} [{res.fault}] {res.hit} -> {res.verdict} ({res.fleet_s:.1f} s vs {res.ref_s:.1f} s)",
                flush=True,
            )
        time.sleep(SETTLE_S)  # a janitor's sweep started before the last night ended has finished by now
        soak.revisit()
        soak.final_sweep()
        if slot_wait_s is None:
            ends = soak.kills + soak.stops
            slot_wait_s = SLOT_LEASE_S + 30 - (time.monotonic() - max(ends)) if ends else 0.0
        slots_left, slot_wait = soak.wait_slots_free(max(0.0, slot_wait_s))
        summary = summarize(
            soak, faults, nights, seed, kinds, skipped, error, slots_left, slot_wait, fleet_up_s
        )
        summary["wall_s"] = round(time.monotonic() - started, 1)
        summary["overlap"] = overlap
        summary["reference_from"] = str(reference_from) if reference_from else None
        if earlier.get("load"):  # the reference's nights ran in that soak: their load is its
            summary["load"]["reference"] = earlier["load"]["reference"]
        if baseline is not None:
            summary["baseline"] = baseline_of(baseline)
        if out is not None:
            write_page(summary, Path(out))
        if tmp is None:  # a kept folder holds its soak's JSON (for --reference-from)
            (base / "soak.json").write_text(summary_json(summary))
        summary["reference_work"] = str(ref.work)
        summary["_reference"] = ref
        return summary
    finally:
        if fleet is not None:
            fleet.stop()
        for path in mounts:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        if tmp is not None:
            tmp.cleanup()


def summarize(
    soak: Soak, faults: list[Fault], nights: int, seed: int, kinds: tuple, skipped: dict, error: str | None,
    slots_left: int, slot_wait: float, fleet_up_s: float,
) -> dict:  # fmt: skip
    results = soak.results
    completed = [r for r in results if r.completed]
    ok = [r for r in completed if not r.failed_checks]
    lost = nights - len(completed)
    data_lost = sum(
        1 for r in completed if not all(r.checks.get(c, [False])[0] for c in ("adapter", "data slice", "cursor", "warm start"))
    )  # fmt: skip
    false_promotions = sum(1 for r in completed if not r.checks.get("promotion", [False])[0])
    survived = [r for r in ok if r.fault != NO_FAULT and not r.hit.startswith("missed")]
    fleet_s = sum(r.fleet_s for r in completed)
    ref_s = sum(r.ref_s for r in completed)
    return {
        "nights": nights,
        "nights_run": len(results),
        "seed": seed,
        "kinds": list(kinds),
        "skipped_kinds": skipped,
        "schedule": [asdict(f) for f in faults],
        "results": [{**asdict(r), "verdict": r.verdict, "failed_checks": r.failed_checks} for r in results],
        "faults_injected": sum(
            1 for r in results if r.hit and r.fault != NO_FAULT and not r.hit.startswith("missed")
        ),
        "faults_missed": sum(1 for r in results if r.hit.startswith("missed")),
        "faults_survived": len(survived),
        "nights_lost": lost,
        "data_lost": data_lost,
        "false_promotions": false_promotions,
        "invariant_failures": {r.night: r.failed_checks for r in completed if r.failed_checks},
        "fleet_s": round(fleet_s, 1),
        "reference_s": round(ref_s, 1),
        "overhead": round(fleet_s / ref_s - 1, 3) if ref_s else None,
        "corruptions": [asdict(c) for c in soak.corruptions],
        "slots_after": {"occupied": slots_left, "waited_s": round(slot_wait, 1)},
        "fleet_up_s": round(fleet_up_s, 1),
        "load": {
            "reference": round(sum(r.load for r in soak.ref.done) / max(1, len(soak.ref.done)), 1),
            "fleet": round(sum(r.load for r in results) / max(1, len(results)), 1),
        },
        "error": error,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
    }


# ---- the results page ----------------------------------------------------------------------------
def write_page(s: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    base = s.get("baseline")
    rows = []
    for r in s["results"]:
        attempts = ", ".join(
            a["state"].lower() + (f" (later {a['later']['state'].lower()})" if a.get("later") else "")
            for a in r["attempts"]
        )
        late = ", ".join(a["state"].lower() for a in r.get("late", []))
        attempts = (attempts or "-") + (f"; after the check: {late}" if late else "")
        lost = r["fleet_s"] - r["ref_s"]
        rows.append(
            f"| {r['night']} | {r['fault']} | {r['hit'] or describe_point(r['at'])} | {attempts}"
            + (f" (+{r['operator_restarts']} by the operator)" if r["operator_restarts"] else "")
            + f" | {r['fleet_s']:.0f} s vs {r['ref_s']:.0f} s ({lost:+.0f} s)"
            + (f" | {baseline_cell(r, base)}" if base else "")
            + f" | {r['verdict']} |"
        )
    corruption_lines = [
        f"- {c['night']}, {c['machine']}: {c['stage']}/{c['key'][:8]}/{c['file']}: "
        + (f"found by the integrity check on {c['detected']}, " + ("fetched again intact" if c["healed"] else "NOT restored")
           if c["detected"] else "NOT found")
        for c in s["corruptions"]
    ]  # fmt: skip
    kinds_count = {k: sum(1 for f in s["schedule"] if f["kind"] == k) for k in s["kinds"]}
    cmd = f"python benchmarks/soak.py --nights {s['nights']} --seed {s['seed']}"
    if set(s["kinds"]) | set(s["skipped_kinds"]) != set(KINDS):
        cmd += f" --kinds {','.join(s['kinds'])}"
    if s.get("overlap"):
        cmd += " --overlap"
    if out.resolve() != OUT.resolve():
        cmd += f" --out {os.path.relpath(out.resolve(), ROOT)}"
    cmd = f"`{cmd}`"
    if base:
        cmd = (
            f"`python benchmarks/soak.py --nights {base['nights_run']} --seed {base['seed']} --kinds {NO_FAULT} "
            f"--out {BASELINE_PAGE.relative_to(ROOT)}` (the same nights without faults), then "
            + cmd[:-1]
            + f" --baseline {BASELINE_PAGE.with_suffix('.json').relative_to(ROOT)}`"
        )
    notes = [
        f"- {r['night']} ({r['fault']}): "
        + "; ".join(n for n in r["notes"] if not n.startswith("promotion:"))
        for r in s["results"]
        if any(not n.startswith("promotion:") for n in r["notes"])
    ]
    extra_checks = [
        f"- {r['night']} {name}: {r['checks'][name][1]}"
        for r in s["results"]
        for name in ("second flow run", "hand-started run")
        if name in r["checks"] and r["checks"][name][0]
    ]
    lines = [
        "# Soak: nights on a fleet "
        + ("without faults (the baseline)" if s["kinds"] == [NO_FAULT] else "with faults"),
        "",
        f"Reproduce: {cmd} ({'the second ' if base else ''}about {s['wall_s'] / 60:.0f} minutes here"
        + (
            f", and {s['reference_s'] / 60:.0f} more for the reference's nights"
            if s.get("reference_from")
            else ""
        )
        + f"; it writes this page and `{out.with_suffix('.json').name}` beside it)."
        + (
            " This run took the learner and the reference's nights from an earlier soak of the same "
            "seed (`--reference-from` its folder) instead of building and running them again."
            if s.get("reference_from")
            else ""
        ),
        "",
        f"Machine: {s['machine']}. Nights ran: **{s['nights_run']} of {s['nights']}**"
        + (f" (stopped: {s['error'][:300]})" if s["error"] else "")
        + f". Seed {s['seed']}; fault kinds {', '.join(f'{k} x{n}' for k, n in kinds_count.items())}.",
        "",
        "Each night is a nightly run of the fleet suite's learner model (3 steps of 6 prompts, GRPO "
        "groups of 4, learning rate 5e-3, evaluation and registration; the promotion margin 0, so nights "
        "win and lose and the next night warm-starts from whichever won last). The reference runs the same nights on one "
        "machine without the fleet and without faults (`qerl run --night`, a local store and registry); "
        "every fleet night is compared with it.",
        "",
        "## Totals",
        "",
        f"- faults injected: {s['faults_injected']}, survived (the night completed and every invariant held): "
        f"{s['faults_survived']}"
        + (
            f"; missed (the night ended before the fault's point): {s['faults_missed']}"
            if s["faults_missed"]
            else ""
        ),
        f"- nights lost: **{s['nights_lost']}** (goal 0)",
        f"- data lost: **{s['data_lost']}** (goal 0): nights whose adapter, warm start, data slice or cursor differ from the reference",
        f"- false promotions: **{s['false_promotions']}** (goal 0): nights whose promotion or champion differ from the reference"
        f" ({promoted(s)} of the {s['nights_run']} nights were promoted)",
        f"- invariant failures: {json.dumps(s['invariant_failures']) if s['invariant_failures'] else 'none'}",
        f"- time: the fleet's nights {s['fleet_s']:.0f} s against the reference's {s['reference_s']:.0f} s"
        + (f" ({s['overhead']:+.0%})" if s["overhead"] is not None else "")
        + "; see below for what that includes"
        + (
            f" (the 1-minute load average when a night ended: {s['load']['reference']} on average for the "
            f"reference's nights, {s['load']['fleet']} for the fleet's)"
            if s.get("load")
            else ""
        ),
        *([recovery_line(s, base)] if base else []),
        f"- the fleet-wide GPU limit after the soak: {s['slots_after']['occupied']} slot(s) occupied"
        + (
            f" (waited {s['slots_after']['waited_s']:.0f} s for killed attempts' leases to expire)"
            if s["slots_after"]["waited_s"]
            else ""
        ),
        "",
        "## Nights",
        "",
        "Attempts: the night's flow runs in order. Time: the fleet night's wall time (from its flow run's "
        "creation to the completed night) against the reference night's (`qerl run --night`, process start "
        "to exit).",
        "",
        "| night | fault | where it hit | attempts | time vs reference |"
        + (" time vs the fault-free fleet |" if base else "")
        + " verdict |",
        "|---|---|---|---|---|" + ("---|" if base else "") + "---|",
        *rows,
        "",
    ]
    if corruption_lines:
        lines += ["## Corrupted cache files", "", *corruption_lines, ""]
    if notes or extra_checks:
        lines += ["## What happened on the nights with more than one attempt", "", *notes, *extra_checks, ""]
    failing = [r for r in s["results"] if r["failed_checks"] or not r["completed"]]
    if failing:
        lines += ["## Failed checks", ""]
        for r in failing:
            for name in r["failed_checks"]:
                lines.append(f"- {r['night']} {name}: {r['checks'][name][1]}")
            if not r["completed"]:
                lines.append(f"- {r['night']}: LOST; " + "; ".join(r["notes"])[:600])
        lines.append("")
    lines += [
        "## The invariants, after every night",
        "",
        "- the night completed (after crashed or failed attempts, each with a reason in its Prefect state);",
        "- its final adapter weights (sha256 of `adapter_model.safetensors`) equal the reference night's, bit for bit, and its data slice starts where the reference's did;",
        f"- the registry (`{MODEL}` on the fleet's MLflow) holds exactly one version per completed night;",
        "- the night's promotion decision and the `champion` alias equal the reference's, and the alias moved only on a promotion;",
        "- no flow run of the deployment is RUNNING or PENDING; no GPU lock file is held (a try-lock of each);",
        "- no slot of the `qerl-gpus` limit is occupied, except the slot of an attempt killed less than "
        f"{SLOT_LEASE_S:.0f} s before (Prefect frees a dead holder's slot when its hold on it times out, after {SLOT_LEASE_S - REPOSSESSOR_S - 10:.0f} s, "
        "expires; the soak waits for that at its end);",
        "- the data cursor (`qerl_cursors` in the fleet's database) is at nights x 3 and lists the night once;",
        "- no machine's `store/tmp/` holds an unfinished build older than the night.",
        "",
        "- no flow run of a night was set to another state after it had COMPLETED (its state history), and "
        "none of a night came after its check (looked at again at the end of the soak).",
        "",
        "For `twice`: the second flow run must fail naming the running attempt, or wait for the "
        "deployment's concurrency slot and then re-run the completed night without building anything "
        "(the registry and cursor checks cover registering and consuming twice); the `qerl run --night` "
        "typed on the other machine must be refused naming the holder.",
        "",
        "## What was simulated",
        "",
        "- the GPUs: the workers have logical ids (0 and 1) naming their GPU locks and slots; no device is used;",
        "- the network: every server and machine on loopback (no partitions, no latency);",
        "- a machine's death: a SIGKILL of its whole process session; the page cache survives it (not a power loss);",
        "- a clock jump: a night started with `loop.deadline_h` cut short (a resource setting, so the same run id);",
        "- a full disk: a tmpfs per machine filled by a file"
        + (f" (not run here: {s['skipped_kinds']['disk-full']})" if "disk-full" in s["skipped_kinds"] else "")
        + ";",
        "- bit rot: one byte flipped in a cached base artifact, its size and mtime kept.",
        "",
        "The time difference includes what a fleet night does beyond a one-machine night (the worker's poll, "
        "publishing to S3, the MLflow server) and the recovery of its fault (the janitor's grace of 10 s and "
        "its check that the night's machine is gone, a second process start); the reference starts its own Prefect server each night.",
        "",
    ]
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(summary_json(s))


def promoted(s: dict) -> int:
    return sum(1 for r in s["results"] if r["checks"].get("promotion", [False, ""])[1].startswith("promoted"))


def baseline_cell(r: dict, base: dict) -> str:
    clean = base["nights"].get(r["night"])
    return "-" if clean is None else f"{r['fleet_s']:.0f} s vs {clean:.0f} s ({r['fleet_s'] - clean:+.0f} s)"


def recovery_line(s: dict, base: dict) -> str:
    """Recovery's cost: the nights with faults against the same nights on the same fleet without."""
    both = [r for r in s["results"] if r["completed"] and r["night"] in base["nights"]]
    faulty = sum(r["fleet_s"] for r in both)
    clean = sum(base["nights"][r["night"]] for r in both)
    line = (
        f"- recovery's cost: the fleet's {len(both)} nights with their faults took {faulty:.0f} s against "
        f"{clean:.0f} s for the same nights on the same fleet without faults ({faulty / clean - 1:+.0%}, "
        f"{(faulty - clean) / max(1, len(both)):+.0f} s a night; the fault-free soak: `python benchmarks/soak.py "
        f"--nights {base['nights_run']} --seed {base['seed']} --kinds {NO_FAULT}`"
        + (f", load average {base['load']}" if base.get("load") is not None else "")
        + ")"
    )
    if base["failed"]:
        line += f"; the fault-free soak's own failed checks: {json.dumps(base['failed'])}"
    return line


def summary_json(s: dict) -> str:
    return json.dumps({k: v for k, v in s.items() if not k.startswith("_")}, indent=1, default=str) + "\n"


def baseline_of(s: dict) -> dict:
    """What the page keeps of a fault-free soak: its nights' fleet times and how it ran."""
    if s.get("kinds") != [NO_FAULT]:
        raise ValueError(f"a baseline is a soak with --kinds {NO_FAULT}; this one had {s.get('kinds')}")
    return {
        "nights": {r["night"]: r["fleet_s"] for r in s["results"] if r["completed"]},
        "failed": {
            r["night"]: r["failed_checks"] for r in s["results"] if r["failed_checks"] or not r["completed"]
        },
        "nights_run": s["nights_run"],
        "seed": s["seed"],
        "load": (s.get("load") or {}).get("fleet"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nights", type=int, default=30)
    parser.add_argument("--seed", type=int, default=58)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    parser.add_argument("--overlap", action="store_true", help="run the reference beside the fleet")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (logs, stores)")
    parser.add_argument("--page-from", type=Path, help="only write the page again from a soak's JSON")
    parser.add_argument(
        "--reference-from", type=Path, help="use the learner and reference nights of an earlier --keep folder"
    )
    parser.add_argument(
        "--baseline", type=Path, help="a fault-free soak's JSON (--kinds none) to set recovery against"
    )
    args = parser.parse_args(argv)
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    if args.page_from:
        summary = json.loads(args.page_from.read_text())
        if baseline is not None:
            summary["baseline"] = baseline_of(baseline)
        write_page(summary, args.out)
        return 0
    summary = run_soak(
        args.nights, args.seed, args.out, args.kinds.split(","), base=args.keep, overlap=args.overlap,
        reference_from=args.reference_from, baseline=baseline,
    )  # fmt: skip
    print(json.dumps({k: summary[k] for k in ("nights_run", "nights_lost", "data_lost", "false_promotions",
                                              "faults_injected", "faults_survived", "invariant_failures")}))  # fmt: skip
    return (
        0 if summary["nights_lost"] == 0 and not summary["invariant_failures"] and not summary["error"] else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
