"""Data: the procedural arithmetic set (exact answers, disjoint splits) and hub-layout local files."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data import DataConfig, arithmetic_problems, load_problems, problems_digest, split_of


def _solve(question: str) -> Fraction:
    """An independent solver for the generated questions (regexes over the text, no shared code)."""
    nums = [int(x) for x in re.findall(r"\d+", question)]
    if "buys" in question:  # "X has a items, buys b more and gives away c"
        return Fraction(nums[0] + nums[1] - nums[2])
    if len(nums) == 4:  # a/b op c/d
        x, y = Fraction(nums[0], nums[1]), Fraction(nums[2], nums[3])
        op = re.search(r"\d ([-+*]) \d", question).group(1)
        return {"+": x + y, "-": x - y, "*": x * y}[op]
    a, b = nums
    if "-" in question:
        return Fraction(a - b)
    if "*" in question:
        return Fraction(a * b)
    return Fraction(a + b)  # "+", "plus", "Add", "Sum", "make"


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_arithmetic_answers_are_exact(level):
    problems = arithmetic_problems(60, seed=3, split="train", levels=[level])
    assert len(problems) == 60 and len({p["question"] for p in problems}) == 60
    for p in problems:
        assert p["level"] == level and p["source"] == "arithmetic"
        assert Fraction(p["answer"]) == _solve(p["question"]), p
        assert "/" not in p["answer"] or Fraction(p["answer"]).denominator > 1  # lowest terms, no "4/1"


def test_level_one_is_single_digit_addition_and_short():
    for p in arithmetic_problems(200, seed=0, levels=[1]):
        a, b = (int(x) for x in re.findall(r"\d+", p["question"]))
        assert a < 10 and b < 10 and int(p["answer"]) == a + b
        assert len(p["question"]) <= 20


def test_splits_are_disjoint_and_reproducible():
    levels = [1, 2, 3, 4, 5]
    train = arithmetic_problems(400, seed=1, split="train", levels=levels)
    test_a = arithmetic_problems(100, seed=1, split="test", levels=levels)
    test_b = arithmetic_problems(100, seed=2, split="test", levels=levels)  # another seed: still disjoint
    train_q = {p["question"] for p in train}
    assert not train_q & {p["question"] for p in test_a + test_b}
    assert all(split_of(p["question"]) == "test" for p in test_a)
    assert arithmetic_problems(400, seed=1, split="train", levels=levels) == train
    assert problems_digest(test_a) != problems_digest(test_b)
    assert problems_digest(test_a) == problems_digest(list(test_a))


def test_exhausted_space_is_a_clear_error():
    with pytest.raises(ValueError, match=r"only \d+ distinct test problems found at levels \[1\]"):
        arithmetic_problems(400, split="test", levels=[1])
    with pytest.raises(ValueError, match="unknown arithmetic level 9"):
        arithmetic_problems(5, levels=[9])


def test_load_problems_arithmetic_default():
    problems = load_problems(DataConfig(limit=10))
    assert len(problems) == 10 and all(p["level"] == 1 for p in problems)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_local_gsm8k_jsonl(tmp_path):
    path = _jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "Tom has 3 apples...", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "Big", "answer": "work\n#### 1,234"},
        ],
    )
    problems = load_problems(DataConfig(dataset=str(path)))
    assert [p["answer"] for p in problems] == ["7", "1234"]
    assert problems[0]["source"] == str(path) and problems[0]["id"] == "gsm8k-0"


def test_bad_rows_error_or_are_counted(tmp_path):
    path = _jsonl(
        tmp_path / "bad.jsonl",
        [
            {"question": "ok", "answer": "#### 1"},
            {"question": "no marker", "answer": "just 2"},
            {"question": "", "answer": "#### 3"},
            {"question": "ok2", "answer": "#### 4"},
        ],
    )
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: no gold answer in 'answer' \(no '####'\)"):
        load_problems(DataConfig(dataset=str(path)))
    report: dict = {}
    problems = load_problems(DataConfig(dataset=str(path), on_bad_row="skip"), report=report)
    assert [p["question"] for p in problems] == ["ok", "ok2"]
    assert report["rows"] == 4 and report["skipped"] == 2 and report["skipped_rows"][1].startswith("row 2")


def test_local_parquet_math500_with_levels(tmp_path):
    path = tmp_path / "math500.parquet"
    table = pa.table(
        {
            "problem": ["p1", "p2", "p3"],
            "answer": ["\\frac{1}{2}", "3", "x^2"],
            "level": [1, 3, 5],
            "unique_id": ["a", "b", "c"],
        }
    )
    pq.write_table(table, path)
    problems = load_problems(DataConfig(dataset=str(path), levels=[3, 5]))
    assert [(p["id"], p["answer"], p["level"]) for p in problems] == [
        ("math500-b", "3", 3),
        ("math500-c", "x^2", 5),
    ]


def test_local_bigmath_and_aime_layouts(tmp_path):
    big = _jsonl(tmp_path / "big.jsonl", [{"prompt": "q", "solution": "5", "llama8b_solve_rate": 0.2}])
    assert load_problems(DataConfig(dataset=str(big)))[0]["answer"] == "5"
    with pytest.raises(ValueError, match="no 'level' column"):
        load_problems(DataConfig(dataset=str(big), levels=[3]))
    aime = _jsonl(tmp_path / "aime.jsonl", [{"problem": "q", "answer": 204, "id": 7}])
    (p,) = load_problems(DataConfig(dataset=str(aime), local_format="aime"))
    assert p["answer"] == "204" and p["id"] == "math500-7"
    amc = _jsonl(tmp_path / "amc.jsonl", [{"problem": "q", "answer": 142.0}, {"problem": "r", "answer": 2.5}])
    assert [p["answer"] for p in load_problems(DataConfig(dataset=str(amc)))] == ["142", "2.5"]
    odd = _jsonl(tmp_path / "odd.jsonl", [{"text": "q", "label": "1"}])
    with pytest.raises(ValueError, match="cannot tell the dataset layout"):
        load_problems(DataConfig(dataset=str(odd)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not valid JSON"):
        load_problems(DataConfig(dataset=str(broken)))


def test_hub_offline_error_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"openai/gsm8k.*pass a local file"):
        load_problems(DataConfig(dataset="gsm8k", split="test"))


def test_config_validation():
    with pytest.raises(ConfigError, match="template"):
        load_config(DataConfig, overrides=["template=nope"])
    with pytest.raises(ConfigError, match="unknown dataset 'mnist'"):
        load_config(DataConfig, overrides=["dataset=mnist"])
    with pytest.raises(ConfigError, match="unknown config key 'levelz'"):
        load_config(DataConfig, overrides=["levelz=[1]"])
    cfg = load_config(DataConfig, overrides=["levels=[1, 2]", "template=boxed"])
    assert cfg.levels == [1, 2] and cfg.template == "boxed"
