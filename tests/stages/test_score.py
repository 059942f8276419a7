"""The score stage over a small rollouts table, and ``qerl score`` on a JSONL file."""

from __future__ import annotations

import json
import statistics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.store.artifact_store import ArtifactStore
from qerl.pipeline.store.manifest import BuildResult
from qerl.stages import score

ROWS = [
    # group, completion, gold
    (0, "3 + 4 = 7 <answer>7</answer>", "7"),
    (0, "<answer>8</answer>", "7"),
    (0, "no idea", "7"),
    (1, "\\boxed{\\dfrac{1}{2}}", "0.5"),
    (1, "\\boxed{0.5}", "\\frac{1}{2}"),
    (2, "#### 1,234", "1234"),
]


def _rollouts(store: ArtifactStore, rows=ROWS, extra_columns=None):
    def build(tmp):
        data = {
            "prompt_id": [f"p{g}" for g, _, _ in rows],
            "group_id": [g for g, _, _ in rows],
            "sample_idx": list(range(len(rows))),
            "completion_text": [c for _, c, _ in rows],
            "answer": [a for _, _, a in rows],
            "finish_reason": ["stop"] * len(rows),
            **(extra_columns or {}),
        }
        pq.write_table(pa.table(data), tmp / "rollouts.parquet")
        return BuildResult(mode="test")

    manifest, _ = store.produce(
        "rollout", {"rows": repr(rows), "extra": repr(extra_columns)}, {}, "test", build
    )
    return manifest


def test_stage_scores_and_groups(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    rollouts = _rollouts(store)
    cfg = RewardConfig(timeout_s=5, workers=1)
    manifest = score.run(cfg, rollouts, store)
    table = pq.read_table(manifest.file("scored.parquet")).to_pylist()
    assert [r["completion_text"] for r in table] == [c for _, c, _ in ROWS]  # input order, input columns kept
    assert [r["correct"] for r in table] == [True, False, False, True, True, True]
    assert [r["status"] for r in table] == ["ok", "ok", "no_answer", "ok", "ok", "ok"]
    assert [r["extracted"] for r in table] == ["7", "8", None, "\\frac{1}{2}", "0.5", "1234"]
    for r in table:  # group statistics against the statistics module
        rewards = [x["reward"] for x in table if x["group_id"] == r["group_id"]]
        assert r["group_size"] == len(rewards)
        assert r["group_reward_mean"] == pytest.approx(statistics.mean(rewards))
        assert r["group_reward_std"] == pytest.approx(statistics.stdev(rewards) if len(rewards) > 1 else 0.0)
    m = manifest.metrics
    assert m["n"] == 6 and m["accuracy"] == pytest.approx(4 / 6) and m["no_answer_count"] == 1
    assert m["timeout_count"] == 0 and m["groups"] == 3 and m["answers_per_s"] > 0
    assert manifest.mode == "process-pool/1-workers" and manifest.inputs == {"rollouts": rollouts.digest}
    again = score.run(cfg, rollouts, store)  # cached: same key, nothing recomputed
    assert again.key == manifest.key and again.created_at == manifest.created_at


def test_stage_rejects_tables_without_needed_columns(tmp_path):
    store = ArtifactStore(tmp_path / "store")

    def build(tmp):
        pq.write_table(pa.table({"group_id": [0], "completion_text": ["x"]}), tmp / "rollouts.parquet")

    bad, _ = store.produce("rollout", {"bad": 1}, {}, "test", build)
    with pytest.raises(ValueError, match=r"rollouts.parquet: missing column\(s\) \['answer'\]"):
        score.run(RewardConfig(), bad, store)


def test_cli_score_jsonl(tmp_path, capsys):
    from qerl.flows.cli import main

    src = tmp_path / "in.jsonl"
    rows = [
        {"id": 1, "completion": "\\boxed{42}", "answer": "42"},
        {"id": 2, "completion": "nothing", "answer": "1"},
        {"id": 3, "completion": "<answer>1/2</answer>", "answer": "0.5", "meta": {"k": [1]}},
        {"id": 4, "completion": "\\boxed{9^{9^{9^{9^{9}}}}}", "answer": "1"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    rc = main(
        ["score", "--input", str(src), "--output", str(out), "--set", "timeout_s=1", "--set", "workers=1"]
    )
    assert rc == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [1, 2, 3, 4] and got[2]["meta"] == {"k": [1]}
    assert [(g["correct"], g["reward"], g["extracted"], g["status"]) for g in got] == [
        (True, 1.0, "42", "ok"),
        (False, 0.0, None, "no_answer"),
        (True, 1.0, "1/2", "ok"),
        (False, 0.0, "9^{9^{9^{9^{9}}}}", "timeout"),
    ]
    assert "4 answers: accuracy 0.500" in capsys.readouterr().out
    assert main(["score", "--input", str(tmp_path / "missing.jsonl"), "--output", str(out)]) == 2
    err = capsys.readouterr().err  # the error alone: no progress bar drawn for a file that is not there
    assert err.startswith("qerl score: error: input file not found:") and "answer/s" not in err
    a_dir = tmp_path / "a-dir"
    a_dir.mkdir()  # an OSError that is not a missing file: one line naming the path, not a traceback
    assert main(["score", "--input", str(src), "--output", str(a_dir), "--set", "workers=1"]) == 2
    err = capsys.readouterr().err
    assert "qerl score: error: [Errno 21] Is a directory" in err and "a-dir" in err and "Traceback" not in err


def test_score_jsonl_names_the_bad_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"completion": "1", "answer": "1"}\n{"completion": "2"}\n')
    with pytest.raises(ValueError, match=r"in.jsonl:2: missing 'answer'"):
        score.score_jsonl(src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
    src.write_text('{"completion": "1", "answer": "1"}\n\n{"completion": "2", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"in.jsonl:2: not valid JSON"):
        score.score_jsonl(src, tmp_path / "out.jsonl")
