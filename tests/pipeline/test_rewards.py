"""Rewards: extraction tables, math-verify equivalences, the fast path's claim, deadlines and crashes."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
from qerl.pipeline.data.answers import extract_answer, fast_verdict, normalize_answer
from qerl.pipeline.data.rewards import RewardConfig, VerifierPool, score_batch, verify_pair

TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"
NESTED = "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}"
FACTORIAL = "\\boxed{(10^{10^{7}})!}"


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(RewardConfig(timeout_s=1.5, workers=2)) as p:
        yield p


@pytest.mark.parametrize(
    ("text", "fmt", "expected"),
    [
        ("so the answer is \\boxed{42}.", "boxed", "42"),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "boxed", "\\frac{3}{4}"),
        ("\\boxed{\\dfrac{1}{2}}", "boxed", "\\frac{1}{2}"),
        ("nested \\boxed{\\frac{1}{\\sqrt{2}}} end", "boxed", "\\frac{1}{\\sqrt{2}}"),
        ("unclosed \\boxed{12", "boxed", None),
        ("\\boxed 7", "boxed", "7"),
        ("no box 12", "boxed", None),
        ("<answer> 7 </answer>", "answer_tags", "7"),
        ("<answer>1</answer> <answer>$-3$</answer>", "answer_tags", "-3"),
        ("<answer>\\boxed{5}</answer>", "answer_tags", "5"),
        ("<answer></answer>", "answer_tags", None),
        ("work\n#### 1,234", "gsm8k", "1234"),
        ("#### $18.", "gsm8k", "18"),
        ("#### 3\nmore\n#### 4", "gsm8k", "4"),
        ("no marker 5", "gsm8k", None),
        ("3 apples and 1,250 coins", "last_number", "1250"),
        ("-7.5 then 2/3", "last_number", "2/3"),
        ("nothing here", "last_number", None),
        ("<answer>6</answer> \\boxed{7}", "auto", "6"),
        ("\\boxed{7} and 9", "auto", "7"),
        ("#### 8 then 9", "auto", "8"),
        ("it is 11", "auto", "11"),
    ],
)
def test_extraction_table(text, fmt, expected):
    assert extract_answer(text, fmt) == expected


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown answer format 'xml'"):
        extract_answer("1", "xml")


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        (" $1,234$ ", "1234"),
        ("\\boxed{12}.", "12"),
        ("+5", "5"),
        ("1\\,000", "1000"),
        ("\\tfrac12", "\\frac12"),
    ],
)
def test_normalisation(raw, norm):
    assert normalize_answer(raw) == norm


@pytest.mark.parametrize(
    ("completion", "gold", "correct"),
    [
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{1/2}", "\\frac{1}{2}", True),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", True),
        ("<answer>\\frac{2}{4}</answer>", "1/2", True),
        ("#### 1,234", "1234", True),
        ("#### 1,234", "1,234", True),
        ("\\boxed{x = 3}", "3", True),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
        ("\\boxed{0.33}", "\\frac{1}{3}", False),
        ("\\boxed{2}", "3", False),
        ("\\boxed{11/12}", "\\frac{11}{12}", True),
        ("\\boxed{-7}", "-7", True),
    ],
)
def test_equivalences(pool, completion, gold, correct):
    (rec,) = score_batch([completion], [gold], pool.cfg, pool=pool)
    assert rec.status == "ok", rec
    assert rec.correct is correct
    assert rec.reward == (1.0 if correct else 0.0)


def test_fast_path_agrees_with_math_verify(pool):
    """The fast path's claim: for canonical integers it returns exactly math-verify's verdict."""
    rng = random.Random(0)
    ints = ["0", "1", "-1", "7", "10", "-10", "100", "999999999999999999", "1000000000000000000"]
    ints += [str(rng.randint(-(10**20), 10**20)) for _ in range(20)]
    pairs = (
        [(a, b) for a in ints[:12] for b in ints[:12]]
        + [(a, a) for a in ints]
        + [(a, str(int(a) + 1)) for a in ints]
    )
    verdicts = pool.verify_many(pairs)
    for (pred, gold), (status, correct, detail, _) in zip(pairs, verdicts, strict=True):
        assert status == "ok", (pred, gold, detail)
        assert fast_verdict(pred, gold) is correct, (pred, gold)
    assert (
        fast_verdict("007", "7") is None and fast_verdict("1.0", "1") is None
    )  # not canonical: pool decides


def test_format_reward_and_order(pool):
    cfg = RewardConfig(format_reward=0.25, timeout_s=1.5)
    texts = ["\\boxed{3}", "it is 3", "nothing", "\\boxed{4}", TOWER, "<answer>1/2</answer>"]
    golds = ["3", "3", "3", "3", "3", "0.5"]
    recs = score_batch(texts, golds, cfg, pool=pool)
    assert [r.extracted for r in recs] == ["3", "3", None, "4", "9^{9^{9^{9^{9}}}}", "1/2"]
    assert [r.status for r in recs] == ["ok", "ok", "no_answer", "ok", "timeout", "ok"]
    assert [r.reward for r in recs] == [1.25, 1.0, 0.0, 0.25, 0.25, 1.25]


def test_adversarial_answers_end_at_their_deadline(pool):
    """Power towers, deep nesting, giant factorials: each costs at most the deadline, never hangs."""
    texts = [TOWER, NESTED, FACTORIAL, "\\boxed{10^{10^{10}}}", "\\boxed{2}"]
    start = time.monotonic()
    recs = score_batch(texts, ["4", "1", "3", "5", "2"], pool.cfg, pool=pool)
    elapsed = time.monotonic() - start
    for rec in recs[:4]:
        assert rec.status in ("timeout", "error") or (rec.status == "ok" and not rec.correct), rec.status
        assert rec.latency_s <= pool.cfg.timeout_s + 0.5
        assert rec.reward == 0.0
    assert recs[4].correct and recs[4].status == "ok"
    assert elapsed < 4 * pool.cfg.timeout_s + 5  # two workers; replacements are forks, not interpreters
    assert pool.pids() and all(pid > 0 for pid in pool.pids())


def test_repeated_pathological_answer_costs_one_deadline(pool):
    start = time.monotonic()
    recs = score_batch([TOWER] * 6, ["1"] * 6, pool.cfg, pool=pool)
    assert {r.status for r in recs} == {"timeout"}
    assert time.monotonic() - start < 2 * pool.cfg.timeout_s + 2


def test_worker_killed_mid_batch_is_replaced():
    cfg = RewardConfig(timeout_s=30, workers=1)
    with VerifierPool(cfg) as p:
        killed = []

        def killer():
            time.sleep(1.5)  # the worker is inside the power tower by now
            pid = p.pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

        thread = threading.Thread(target=killer)
        thread.start()
        start = time.monotonic()
        recs = score_batch([TOWER, "\\boxed{0.5}", "\\boxed{2/3}"], ["1", "1/2", "0.5"], cfg, pool=p)
        thread.join()
        assert time.monotonic() - start < 15
        assert recs[0].status == "error" and "died" in recs[0].detail
        assert [(r.status, r.correct) for r in recs[1:]] == [("ok", True), ("ok", False)]
        assert p.restarts == 1 and p.pids()[0] != killed[0]


def test_scoring_from_a_thread_works():
    """Prefect runs tasks in threads: math-verify's signal timeouts would fail there; ours must not."""
    out: list = []
    errors: list = []

    def work():
        try:
            out.extend(
                score_batch(["\\boxed{\\frac{3}{4}}", "\\boxed{5}"], ["0.75", "6"], RewardConfig(timeout_s=5))
            )
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert not errors, errors
    assert [(r.status, r.correct) for r in out] == [("ok", True), ("ok", False)]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        score_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="gold answer 1 is empty"):
        score_batch(["a", "b"], ["1", " "])


def test_unparseable_gold_is_an_error_not_a_zero():
    status, correct, detail = verify_pair("3", "\\frac{")
    assert status == "error" and not correct and "gold answer" in detail


def test_config_rejects_unknown_keys():
    from qerl.pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="timeout_sec"):
        load_config(RewardConfig, overrides=["timeout_sec=3"])
    assert load_config(RewardConfig, overrides=["answer_format=boxed"]).answer_format == "boxed"
