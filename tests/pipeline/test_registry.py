"""MLflow registry: versions, lineage tags, aliases, the promotion rule, races, sqlite and PostgreSQL."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from qerl.pipeline.registry import adapters, promotion
from qerl.pipeline.registry import tracking as reg
from qerl.pipeline.registry.lock import LOCK_SUFFIX

REPO = Path(__file__).resolve().parents[2]


def make_adapter(root: Path, tag: str) -> Path:
    d = root / f"adapter-{tag}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(f'{{"r": 8, "tag": "{tag}"}}')
    (d / "adapter_model.safetensors").write_bytes(tag.encode() * 8)
    return d


def lineage(digest: str) -> dict:
    return {
        "base_digest": "base123",
        "quant_recipe": "nvfp4a16",
        "dataset_digest": "data456",
        "code_version": "code789",
        "flow_run_id": None,
        "adapter_digest": digest,
    }


def register(
    cfg: reg.RegistryConfig, root: Path, tag: str, acc: float | None, bench: str = "arith/test@x"
) -> str:
    run_id = reg.start_run(cfg, run_name=tag)
    version, created = promotion.register_adapter(
        cfg,
        run_id,
        make_adapter(root, tag),
        None,
        {"benchmark": bench, "accuracy": acc, "k": 4},
        lineage(tag),
    )
    assert created
    return version


def n_versions(cfg: reg.RegistryConfig) -> int:
    return len(reg.MlflowClient().search_model_versions(f"name = '{cfg.model_name}'"))


def champion(cfg: reg.RegistryConfig) -> str | None:
    mv = promotion.alias_version(cfg, cfg.champion_alias)
    return None if mv is None else str(mv.version)


@pytest.fixture(scope="module")
def sqlite_work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("registry-work")
    reg.open_tracking(reg.RegistryConfig(), work)  # creates the schema once for the module
    return work


@pytest.fixture
def cfg(sqlite_work) -> reg.RegistryConfig:
    c = reg.RegistryConfig(model_name=f"m-{uuid.uuid4().hex[:8]}")
    reg.open_tracking(c, sqlite_work)
    return c


def test_default_backend_is_sqlite_under_work_dir(sqlite_work):
    uri, artifacts = reg.resolve_uris(reg.RegistryConfig(), sqlite_work)
    assert uri == f"sqlite:///{sqlite_work.resolve() / 'mlflow.db'}"
    assert (sqlite_work / "mlflow.db").is_file()
    assert artifacts == (sqlite_work.resolve() / "mlartifacts").as_uri()
    with pytest.raises(reg.RegistryError, match="not a sqlite or postgresql database nor an MLflow tracking"):
        reg.backend_kind("file:///tmp/mlruns")
    assert reg.backend_kind("http://mlflow.example:5000") == "server"
    assert reg.resolve_uris(reg.RegistryConfig(tracking_uri="https://m.example"), sqlite_work) == (
        "https://m.example",
        None,  # the server chooses where artifacts go (and they are uploaded through it)
    )
    with pytest.raises(Exception, match="promote_margin"):
        reg.RegistryConfig(promote_margin=-0.1)


def test_register_tags_aliases_and_margin(cfg, tmp_path):
    cfg = cfg.model_copy(update={"promote_margin": 0.05})
    v1 = register(cfg, tmp_path, "a1", 0.50)
    info = promotion.version_info(cfg, v1)
    for key, value in {**lineage("a1"), "flow_run_id": "none", "eval_benchmark": "arith/test@x"}.items():
        assert info["tags"][key] == str(value), key
    assert info["source"].endswith("/adapter") and info["run_id"]
    # the registered source holds the adapter files
    local = reg.MlflowClient().download_artifacts(info["run_id"], "adapter", str(tmp_path / "dl"))
    assert sorted(os.listdir(local)) == ["adapter_config.json", "adapter_model.safetensors"]

    assert promotion.set_challenger(cfg, v1)
    assert promotion.maybe_promote(cfg, v1, "arith/test@x", 0.50, complete=True)
    assert champion(cfg) == v1
    v2 = register(cfg, tmp_path, "a2", 0.54)  # better, but not by the margin
    assert not promotion.maybe_promote(cfg, v2, "arith/test@x", 0.54, complete=True)
    assert champion(cfg) == v1
    assert "does not beat" in promotion.version_info(cfg, v2)["tags"]["promotion"]
    v3 = register(cfg, tmp_path, "a3", 0.56)
    assert promotion.maybe_promote(cfg, v3, "arith/test@x", 0.56, complete=True)
    assert champion(cfg) == v3
    assert promotion.maybe_promote(cfg, v3, "arith/test@x", 0.56, complete=True)  # already champion: no-op
    # a champion measured on another benchmark is not comparable
    v4 = register(cfg, tmp_path, "a4", 0.99, bench="gsm8k/test@y")
    assert not promotion.maybe_promote(cfg, v4, "gsm8k/test@y", 0.99, complete=True)
    assert champion(cfg) == v3
    # challenger follows the newest version and never moves back
    assert promotion.set_challenger(cfg, v4)
    assert not promotion.set_challenger(cfg, v2)
    assert str(promotion.alias_version(cfg, cfg.challenger_alias).version) == v4


def test_failed_or_partial_run_never_promotes(cfg, tmp_path):
    v1 = register(cfg, tmp_path, "p1", 0.9)
    assert not promotion.maybe_promote(cfg, v1, "arith/test@x", 0.9, complete=False)
    assert champion(cfg) is None
    assert "incomplete" in promotion.version_info(cfg, v1)["tags"]["promotion"]
    assert not promotion.maybe_promote(cfg, v1, "arith/test@x", None, complete=True)
    assert not promotion.maybe_promote(cfg, v1, "arith/test@x", float("nan"), complete=True)
    assert champion(cfg) is None
    assert promotion.maybe_promote(cfg, v1, "arith/test@x", 0.9, complete=True)
    v2 = register(cfg, tmp_path, "p2", 1.0)
    assert not promotion.maybe_promote(cfg, v2, "arith/test@x", 1.0, complete=False)
    assert champion(cfg) == v1


def test_idempotent_register_and_manual_promote(cfg, tmp_path):
    v1 = register(cfg, tmp_path, "i1", 0.7)
    run_id = reg.start_run(cfg, run_name="again")
    again, created = promotion.register_adapter(
        cfg, run_id, make_adapter(tmp_path, "i1"), None, {"benchmark": "b", "accuracy": 0.7}, lineage("i1")
    )
    assert (again, created) == (v1, False)
    assert n_versions(cfg) == 1
    assert promotion.find_version(cfg, "i1").version == int(v1)
    with pytest.raises(reg.RegistryError, match="lacks"):
        promotion.register_adapter(
            cfg, run_id, make_adapter(tmp_path, "x"), None, {}, {"adapter_digest": "x"}
        )
    with pytest.raises(reg.RegistryError, match="adapter_config.json"):
        promotion.register_adapter(cfg, run_id, tmp_path / "nowhere", None, {}, lineage("y"))

    v2 = register(cfg, tmp_path, "i2", 0.1)
    assert promotion.maybe_promote(cfg, v1, "arith/test@x", 0.7, complete=True)
    promotion.promote(cfg, cfg.model_name, v2)  # manual: a worse version can be made champion
    assert champion(cfg) == v2
    assert promotion.version_info(cfg, v2)["tags"]["promotion"] == "manual promotion"
    with pytest.raises(reg.RegistryError, match="does not exist"):
        promotion.promote(cfg, cfg.model_name, "99")


def test_history_metrics_and_plots(cfg):
    history = [
        {"step": s, "reward_mean": 0.1 * s, "accuracy": 0.05 * s, "entropy": 1.0 - 0.1 * s, "sigma": 0.01 / (s + 1),
         "kl": 0.0, "mode": "vllm-nvfp4-emulated"}
        for s in range(5)
    ]  # fmt: skip
    run_id = reg.start_run(cfg, run_name="plots")
    assert reg.log_history(run_id, history) == 5 * 6  # the string 'mode' is not a metric
    client = reg.MlflowClient()
    points = client.get_metric_history(run_id, "reward_mean")
    assert sorted((m.step, round(m.value, 6)) for m in points) == [(s, round(0.1 * s, 6)) for s in range(5)]
    assert sorted(reg.log_plots(run_id, history)) == ["accuracy", "entropy", "reward", "sigma"]
    pngs = [a.path for a in client.list_artifacts(run_id, "plots")]
    assert sorted(pngs) == ["plots/accuracy.png", "plots/entropy.png", "plots/reward.png", "plots/sigma.png"]
    local = client.download_artifacts(run_id, "plots/reward.png")
    assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert reg.log_plots(run_id, [{"step": 0, "kl": 0.1}]) == []


_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from qerl.pipeline.registry import tracking as reg
    from qerl.pipeline.registry import promotion
    work, name, tag, acc, go, ready = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5], sys.argv[6]
    cfg = reg.RegistryConfig(model_name=name, tracking_uri=os.environ.get("QERL_TEST_URI") or None)
    reg.open_tracking(cfg, work)
    adapter = Path(work) / ("adapter-" + tag)
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text("{{}}")
    (adapter / "adapter_model.safetensors").write_bytes(tag.encode())
    lin = dict(base_digest="b", quant_recipe="q", dataset_digest="d", code_version="c", flow_run_id=tag,
               adapter_digest=tag)
    run_id = reg.start_run(cfg, run_name=tag)
    Path(ready).touch()
    while not os.path.exists(go):
        time.sleep(0.01)
    version, _ = promotion.register_adapter(cfg, run_id, adapter, None, {{"benchmark": "arith", "accuracy": acc}}, lin)
    promotion.set_challenger(cfg, version)
    print("PROMOTED" if promotion.maybe_promote(cfg, version, "arith", acc, True) else "KEPT", version)
    """
).format(repo=str(REPO))


def race(
    cfg: reg.RegistryConfig, work: Path, accs: dict[str, float], env: dict | None = None
) -> dict[str, str]:
    """One process per adapter, released together while we hold the registry lock; tag -> output.

    Holding the lock at the release proves that registration and promotion wait for it; dropping
    it lets both go at once, the race the lock must make harmless.
    """
    name = cfg.model_name
    uri, _ = reg.resolve_uris(cfg, work)
    go = work / f"go-{name}"
    procs = {}
    for tag, acc in accs.items():
        ready = work / f"ready-{name}-{tag}"
        procs[tag] = (
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(work), name, tag, str(acc), str(go), str(ready)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **(env or {})},
            ),
            ready,
        )
    deadline = time.monotonic() + 120
    while not all(r.exists() for _, r in procs.values()):
        assert time.monotonic() < deadline, "workers did not start"
        assert all(p.poll() is None for p, _ in procs.values()), [p.communicate() for p, _ in procs.values()]
        time.sleep(0.05)
    before = n_versions(cfg)
    with reg.registry_lock(uri, name):
        go.touch()
        time.sleep(1.5)
        assert all(p.poll() is None for p, _ in procs.values()), "a worker went ahead while the lock was held"
        assert n_versions(cfg) == before
    out = {}
    for tag, (p, _) in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        out[tag] = stdout.strip().splitlines()[-1]
    return out


def check_race(cfg: reg.RegistryConfig, work: Path, env: dict | None = None) -> None:
    # an existing champion at 0.5: the 0.4 run must not win even if it writes last
    v0 = register(cfg, work, f"{cfg.model_name}-seed", 0.5, bench="arith")
    assert promotion.maybe_promote(cfg, v0, "arith", 0.5, True)
    out = race(cfg, work, {"good": 0.7, "bad": 0.4}, env)
    versions = {mv.tags["adapter_digest"]: str(mv.version) for mv in reg.MlflowClient().search_model_versions(
        f"name = '{cfg.model_name}'")}  # fmt: skip
    assert set(versions) == {f"{cfg.model_name}-seed", "good", "bad"}, out
    assert champion(cfg) == versions["good"], out
    assert out["good"].startswith("PROMOTED") and out["bad"].startswith("KEPT"), out
    assert str(promotion.alias_version(cfg, cfg.challenger_alias).version) == str(
        max(int(v) for v in versions.values())
    )


@pytest.mark.slow
def test_two_processes_finishing_together_sqlite(cfg, sqlite_work):
    check_race(cfg, sqlite_work)
    uri, _ = reg.resolve_uris(cfg, sqlite_work)
    with pytest.raises(reg.RegistryError, match="timed out"), reg.registry_lock(uri, cfg.model_name):
        with reg.registry_lock(uri, cfg.model_name, timeout_s=0.3):
            pass


def test_promotion_decision_rule():
    cfg = reg.RegistryConfig(promote_margin=0.02)

    class V:
        def __init__(self, version, bench, acc):
            self.version, self.tags = version, {"eval_benchmark": bench, "eval_accuracy": str(acc)}

    assert promotion.promotion_decision(cfg, None, "1", "b", 0.1, True)[0]
    assert not promotion.promotion_decision(cfg, None, "1", "b", 0.1, False)[0]
    assert not promotion.promotion_decision(cfg, V("1", "b", 0.5), "2", "b", 0.52, True)[0]
    assert promotion.promotion_decision(cfg, V("1", "b", 0.5), "2", "b", 0.5201, True)[0]
    assert not promotion.promotion_decision(cfg, V("1", "c", 0.1), "2", "b", 0.9, True)[0]


def check_versions_and_aliases(cfg: reg.RegistryConfig, root: Path, tag: str) -> tuple[str, str]:
    """The same sequence on every backend: promote, keep a worse one, re-register idempotently,
    promote manually; returns the two versions."""
    v1 = register(cfg, root, f"{tag}1", 0.5)
    assert promotion.set_challenger(cfg, v1)
    assert promotion.maybe_promote(cfg, v1, "arith/test@x", 0.5, True)
    v2 = register(cfg, root, f"{tag}2", 0.4)
    assert not promotion.maybe_promote(cfg, v2, "arith/test@x", 0.4, True)
    assert champion(cfg) == v1
    again, created = promotion.register_adapter(
        cfg, reg.start_run(cfg), make_adapter(root, f"{tag}1"), None, {"benchmark": "b"}, lineage(f"{tag}1")
    )
    assert (again, created) == (v1, False)
    promotion.promote(cfg, cfg.model_name, v2)
    assert champion(cfg) == v2
    return v1, v2


# ---- PostgreSQL: a real server started for the test --------------------------------------------
def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pg_uri():
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed on this machine")
    root = Path(tempfile.mkdtemp(prefix="qerl-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres (or nobody) user
        import pwd

        user = "postgres" if "postgres" in {p.pw_name for p in pwd.getpwall()} else "nobody"
        shutil.chown(root, user=user)
        prefix = ["runuser", "-u", user, "--"]
    data, port = root / "data", _free_port()

    def run(*cmd):
        return subprocess.run([*prefix, *cmd], check=True, capture_output=True, text=True, timeout=120)

    run(str(bindir / "initdb"), "-D", str(data), "-U", "qerl", "-A", "trust", "--no-sync")
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    run(str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start")
    try:
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "qerl", "mlflow")
        yield f"postgresql+psycopg://qerl@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_postgresql_backend(pg_uri, tmp_path):
    cfg = reg.RegistryConfig(tracking_uri=pg_uri, model_name="pg-adapter")
    reg.open_tracking(cfg, tmp_path)
    assert reg.backend_kind(pg_uri) == "postgresql"
    check_versions_and_aliases(cfg, tmp_path, "pg")
    # the advisory lock excludes a second holder
    with pytest.raises(reg.RegistryError, match="timed out"), reg.registry_lock(pg_uri, cfg.model_name):
        with reg.registry_lock(pg_uri, cfg.model_name, timeout_s=0.3):
            pass
    # two processes against the server: both versions kept, the better one champion
    race_cfg = reg.RegistryConfig(tracking_uri=pg_uri, model_name="pg-race")
    reg.open_tracking(race_cfg, tmp_path)
    check_race(race_cfg, tmp_path, env={"QERL_TEST_URI": pg_uri})


def test_cli_promote(cfg, sqlite_work, tmp_path, capsys):
    from qerl.flows.cli import main

    v1 = register(cfg, tmp_path, "c1", 0.9)
    v2 = register(cfg, tmp_path, "c2", 0.1)
    assert promotion.maybe_promote(cfg, v1, "arith/test@x", 0.9, True)
    assert main(["promote", cfg.model_name, v2, "--work-dir", str(sqlite_work)]) == 0
    assert champion(cfg) == v2
    assert f"{cfg.model_name} v{v2} is now @champion" in capsys.readouterr().out
    assert main(["promote", cfg.model_name, "7", "--work-dir", str(sqlite_work)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_promote_and_versions_create_nothing_on_a_typo(cfg, sqlite_work, tmp_path, capsys):
    """A mistyped work directory or model name is an error naming what is there; it leaves neither a
    new database nor an empty registered model behind (a later ``versions`` would read "no versions")."""
    from qerl.flows.cli import main

    register(cfg, tmp_path, "t1", 0.9)
    elsewhere = tmp_path / "not-a-work-dir"
    for command in (["promote", cfg.model_name, "1"], ["versions", cfg.model_name]):
        assert main([*command, "--work-dir", str(elsewhere)]) == 2
        assert "no registry at sqlite:///" in capsys.readouterr().err
    assert not elsewhere.exists()
    typo = f"{cfg.model_name}-typo"
    for command in (["promote", typo, "1"], ["versions", typo]):
        assert main([*command, "--work-dir", str(sqlite_work)]) == 2
        err = capsys.readouterr().err
        assert f"no registered model '{typo}'" in err and cfg.model_name in err
    names = {m.name for m in reg.MlflowClient().search_registered_models()}
    assert cfg.model_name in names and typo not in names
    assert main(["versions", cfg.model_name, "--work-dir", str(sqlite_work)]) == 0
    assert "1 version " in capsys.readouterr().out
    # a run config's spelling of the registry's settings, as `qerl run` and `qerl eval` take it
    uri = f"registry.tracking_uri=sqlite:///{sqlite_work}/mlflow.db"
    assert main(["versions", cfg.model_name, "--set", uri, "--work-dir", str(elsewhere)]) == 0
    assert "1 version " in capsys.readouterr().out
    assert main(["policy", cfg.model_name, "--set", uri, "--work-dir", str(elsewhere)]) == 0
    assert "no promotion policy yet" in capsys.readouterr().out


# ---- MLflow tracking server: a real `mlflow server` on loopback, started for the test ------------
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """(URI, root): a real tracking server with a sqlite backend and proxied artifacts in ``root``."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
           str(root / "artifacts"), "--workers", "2"]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job runner
    with open(root / "server.log", "w") as log_fh:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log_fh, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240  # its start-up takes 10-40 s on a busy 2-core machine
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer /health"
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield uri, root
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.slow
def test_tracking_server_backend(mlflow_server, tmp_path):
    uri, root = mlflow_server
    cfg = reg.RegistryConfig(tracking_uri=uri, model_name="srv-adapter")
    reg.open_tracking(cfg, tmp_path)
    assert reg.backend_kind(uri) == "server"
    client = reg.MlflowClient()
    assert client.get_experiment_by_name(cfg.experiment).artifact_location.startswith("mlflow-artifacts:")
    v1, _ = check_versions_and_aliases(cfg, tmp_path, "srv")
    info = promotion.version_info(cfg, v1)
    assert info["source"].startswith("mlflow-artifacts:/") and info["source"].endswith("/adapter")
    # uploaded through the server: the bytes sit in its artifacts destination, nothing local
    uploaded = sorted((root / "artifacts").rglob("adapter/adapter_model.safetensors"))
    assert sorted(p.read_bytes() for p in uploaded) == [b"srv1" * 8, b"srv2" * 8]
    assert not (tmp_path / "mlartifacts").exists()
    local = client.download_artifacts(info["run_id"], "adapter", str(tmp_path / "dl"))
    assert sorted(os.listdir(local)) == ["adapter_config.json", "adapter_model.safetensors"]

    # the ticket lock excludes a second holder, and every ticket is gone afterwards
    with pytest.raises(reg.RegistryError, match="timed out.*held by ticket"), reg.registry_lock(uri, "srv-x"):
        with reg.registry_lock(uri, "srv-x", timeout_s=0.5):
            pass
    assert client.search_model_versions(f"name = 'srv-x{LOCK_SUFFIX}'") == []
    # a name the server does not hold is an error listing its models, the locks' ticket models left out
    with pytest.raises(reg.RegistryError, match=r"no registered model 'srv-typo'.*srv-adapter") as err:
        adapters.require_registered_model("srv-typo", uri)
    assert client.get_registered_model(f"srv-x{LOCK_SUFFIX}") and LOCK_SUFFIX not in str(err.value)
    # two processes finishing together through the server: both versions kept, the better one champion
    race_cfg = reg.RegistryConfig(tracking_uri=uri, model_name="srv-race")
    reg.open_tracking(race_cfg, tmp_path)
    check_race(race_cfg, tmp_path, env={"QERL_TEST_URI": uri})

    # the register stage, as the flow runs it, through the server
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import register as register_stage

    from tests.stages.test_register import HISTORY, LINEAGE, fake_eval, fake_train

    store = ArtifactStore(tmp_path / "store")
    stage_cfg = reg.RegistryConfig(tracking_uri=uri, model_name="srv-stage")
    m = register_stage.run(stage_cfg, fake_train(store, "srv"), fake_eval(store, 0.5), LINEAGE, HISTORY, tmp_path,
                           True, store)  # fmt: skip
    record = json.loads(m.file("registration.json").read_text())
    assert m.mode == "mlflow-server" and record["tracking_backend"] == "server"
    assert record["source"].startswith("mlflow-artifacts:/") and record["aliases"] == [
        "challenger",
        "champion",
    ]


@pytest.mark.slow
def test_live_metrics_through_the_server(mlflow_server, tmp_path):
    """Steps logged live over the server's REST API, a resumed attempt adding only the new ones, and
    the registration completing that same run."""
    from qerl.pipeline.registry import live
    from qerl.pipeline.store.artifact_store import ArtifactStore
    from qerl.stages import register as register_stage

    from tests.stages.test_register import HISTORY, LINEAGE, fake_eval, fake_train

    uri, _ = mlflow_server
    cfg = reg.RegistryConfig(tracking_uri=uri, model_name="srv-live")
    from qerl.pipeline.store.run_record import RunRecord

    fields = {
        "run_id": "srv-live-run",
        "flow_run_id": "f",
        "config": {"loop": {"steps": 3}},
        "evaluations": [],
    }
    record = RunRecord.model_validate({**fields, "steps": HISTORY[:1]})
    first = live.open_run(cfg, tmp_path, record, None, {})
    assert live.log_record(first, record) > 0 and not first.failing
    resumed = RunRecord.model_validate({**fields, "steps": HISTORY[:2]})
    second = live.open_run(cfg, tmp_path, resumed, record, {})
    assert second.run_id == first.run_id and live.log_record(second, resumed) > 0
    store = ArtifactStore(tmp_path / "store-live")
    m = register_stage.run(
        cfg, fake_train(store, "srv-live"), fake_eval(store, 0.5), {**LINEAGE, "run_id": "srv-live-run"},
        HISTORY, tmp_path, True, store, mlflow_run_id=first.run_id,
    )  # fmt: skip
    assert m.extra["run_id"] == first.run_id
    client = reg.MlflowClient()
    assert sorted(p.step for p in client.get_metric_history(first.run_id, "reward_mean")) == [0, 1, 2]
    assert client.get_run(first.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_a_release_through_the_server_deletes_the_uploaded_adapter(mlflow_server, tmp_path):
    """store.keep_versions through a tracking server: the adapter the server holds is deleted over its
    REST API, the version stays, tagged."""
    from qerl.pipeline.registry import release

    from tests.pipeline.test_release import NAME, _night

    uri, root = mlflow_server
    [_night(tmp_path, f"s{i}", 1, champion=i == 0, uri=uri) for i in range(3)]
    planned = release.plan_releases(tmp_path)
    assert [(r.label, r.registry) for r in planned] == [(f"{NAME} v2", uri)] and planned[0].nbytes > 0
    source = reg.MlflowClient().get_model_version(NAME, "2").source
    assert source.startswith("mlflow-artifacts:/")
    held = root / "artifacts" / source.removeprefix("mlflow-artifacts:/")
    assert (held / "adapter_model.safetensors").is_file()
    assert release.release_old_versions(tmp_path)[0] > 0
    assert not held.exists() and "released" in reg.MlflowClient().get_model_version(NAME, "2").tags
    kept = reg.MlflowClient().get_model_version(NAME, "3").source.removeprefix("mlflow-artifacts:/")
    assert (root / "artifacts" / kept / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_server_lock_lease(mlflow_server, tmp_path):
    """A dead holder's ticket (never renewed) is broken after the lease; a live one is not."""
    uri, _ = mlflow_server
    reg.open_tracking(reg.RegistryConfig(tracking_uri=uri, model_name="srv-lease"), tmp_path)
    client = reg.MlflowClient()
    model = f"srv-lease{LOCK_SUFFIX}"
    with contextlib.suppress(reg.MlflowException):
        client.create_registered_model(model)
    dead = client.create_model_version(model, source="qerl-lock:/x", tags={"holder": "dead"})
    start = time.monotonic()
    with reg.registry_lock(uri, "srv-lease", timeout_s=30, lease_s=1.0):
        waited = time.monotonic() - start
        live = [str(v.version) for v in client.search_model_versions(f"name = '{model}'")]
    assert 1.0 < waited < 15 and str(dead.version) not in live and len(live) == 1

    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with reg.registry_lock(uri, "srv-lease", lease_s=1.0):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(30)
        with pytest.raises(reg.RegistryError, match="timed out"):  # 3 leases long: renewed, not broken
            with reg.registry_lock(uri, "srv-lease", timeout_s=3.0, lease_s=1.0):
                pass
    finally:
        release.set()
        thread.join(30)
    assert client.search_model_versions(f"name = '{model}'") == []


def test_a_dead_registry_fails_a_run_in_seconds_before_any_stage(tiny_model_dir, tmp_path):
    """registry.tracking_uri on a port nothing listens on: one line naming the URI, nothing built (the
    run used to train and evaluate, then hang 7.5+ minutes in registration)."""
    import yaml

    from tests.flows.test_flow import _qerl, tiny_run_config

    uri = f"http://127.0.0.1:{_free_port()}"
    cfg = tiny_run_config(tiny_model_dir)
    cfg["registry"] = {"tracking_uri": uri}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    t0 = time.monotonic()
    proc = _qerl(["run", "--config", str(tmp_path / "run.yaml")], work)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 2, proc.stderr[-2000:]
    *starting, line = proc.stderr.strip().splitlines()  # the console's "starting" line, then the error
    assert len(starting) <= 1 and "Traceback" not in proc.stderr
    assert line.startswith("qerl run: error: the MLflow registry at " + uri) and "does not answer" in line
    objects = work / "store" / "objects"
    assert not objects.is_dir() or not any(objects.iterdir())


def test_registry_health_check_and_bounded_http_retries(tmp_path, monkeypatch, caplog):
    from qerl.pipeline.registry import health

    dead = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(reg.RegistryError, match=f"registry at {dead} does not answer"):
        reg.check_reachable(reg.RegistryConfig(tracking_uri=dead), tmp_path)
    pg = f"postgresql+psycopg://qerl:secret@127.0.0.1:{_free_port()}/mlflow"
    with pytest.raises(reg.RegistryError, match=r"qerl:\*\*\*@127\.0\.0\.1") as err:
        health.check_reachable(pg)
    assert "secret" not in str(err.value) and time.monotonic() - t0 < 10
    reg.check_reachable(reg.RegistryConfig(), tmp_path / "new")  # a sqlite file: its folder is made

    # MLflow's own retries against a dead server: bounded (seconds, not minutes) and shown as warnings
    for name in health.HTTP_RETRY_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a user's setting wins
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="qerl.registry"), pytest.raises(Exception) as failed:  # noqa: B017
        reg.open_tracking(reg.RegistryConfig(tracking_uri=dead, lock_timeout_s=5), tmp_path)
    assert time.monotonic() - t0 < 30 and "Max retries exceeded" in str(failed.value), failed.value
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    assert any("does not answer, retrying" in r.getMessage() for r in caplog.records)
    reg.open_tracking(reg.RegistryConfig(), tmp_path)  # back to the sqlite default for later tests


def test_a_dead_prefect_api_fails_a_run_in_seconds_naming_it(tiny_model_dir, tmp_path, monkeypatch):
    import yaml

    from tests.flows.test_flow import _qerl, tiny_run_config

    api = f"http://127.0.0.1:{_free_port()}/api"
    monkeypatch.setenv("PREFECT_API_URL", api)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir)))
    t0 = time.monotonic()
    proc = _qerl(["run", "--config", str(tmp_path / "run.yaml")], tmp_path / "work")
    assert time.monotonic() - t0 < 60 and proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("qerl run: error: qerl run reports to the Prefect server") and api in line
