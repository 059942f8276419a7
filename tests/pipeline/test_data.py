"""Data: the procedural arithmetic set (exact answers, disjoint splits) and hub-layout local files."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from qerl.pipeline.config import ConfigError, load_config
from qerl.pipeline.data.arithmetic import arithmetic_problems, split_of
from qerl.pipeline.data.datasets import DataConfig, dataset_name, load_problems, problems_digest
from shared_data import SHARED_DATA, needs_shared


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


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5, 6])
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
    assert all(split_of(p["group"]) == "test" for p in test_a)
    assert not {p["group"] for p in train} & {p["group"] for p in test_a + test_b}  # nor their numbers
    assert arithmetic_problems(400, seed=1, split="train", levels=levels) == train
    assert problems_digest(test_a) != problems_digest(test_b)
    assert problems_digest(test_a) == problems_digest(list(test_a))


def test_the_demos_held_out_problems_share_no_numbers_with_what_it_learns_from():
    """The demo preset's test and validation problems share no pair of numbers with its training
    problems or the demo base's warm-up, in any order or phrasing (the warm-up leaves the validation
    pairs out). The split before went by the question's text: 99 of the 100 test items had their pair
    in training."""
    from qerl.pipeline.evaluation.eval_config import validation_split
    from qerl.pipeline.planning.run_config import load_run_config

    def pairs(problems: list) -> set[frozenset[int]]:
        return {frozenset(int(x) for x in re.findall(r"\d+", p["question"])) for p in problems}

    cfg = load_run_config(None)  # the embedded demo
    train, held = validation_split(load_problems(cfg.data, "train"), cfg.eval.validation)
    test = load_problems(cfg.eval.benchmark)
    warm = cfg.model.demo
    warmup = arithmetic_problems(
        warm.n_train, warm.seed, "train", warm.levels, exclude=frozenset(p["group"] for p in held)
    )
    assert 90 <= len(held) <= 100 and len(test) == 100 and len(warmup) == warm.n_train
    for seen in (train, warmup):
        assert not pairs(seen) & pairs(test) and not pairs(seen) & pairs(held)
    assert len(pairs(test)) >= 50 and len(pairs(held)) >= 50
    # level 1, whose 55 unordered pairs split the same way: 11 of them make the test split
    ones = arithmetic_problems(100, seed=0, split="test", levels=[1])
    assert len(pairs(ones)) == 11 and not pairs(ones) & pairs(arithmetic_problems(400, 0, "train", [1]))


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
    assert [p["answer"] for p in problems] == ["7", "1,234"]  # as published; the scorer reads 1,234
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
    assert [p["answer"] for p in load_problems(DataConfig(dataset=str(amc)))] == ["142.0", "2.5"]
    odd = _jsonl(tmp_path / "odd.jsonl", [{"text": "q", "label": "1"}])
    with pytest.raises(ValueError, match="cannot tell the dataset layout"):
        load_problems(DataConfig(dataset=str(odd)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not valid JSON"):
        load_problems(DataConfig(dataset=str(broken)))


def test_hub_offline_error_says_what_to_do(monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    with pytest.raises(
        RuntimeError, match=r"openai/gsm8k.*QERL_DATA_DIR.*benchmark.root in qerl eval.*a local file"
    ):
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


# ---- the published benchmark files (../shared/data beside the checkout; absent on a user's machine) --


def _raw(name: str, split: str) -> list[dict]:
    with open(SHARED_DATA / name / f"{split}.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@needs_shared
@pytest.mark.parametrize(
    ("name", "split", "count"),
    [("gsm8k", "train", 7473), ("gsm8k", "test", 1319), ("math500", "test", 500), ("aime24", "test", 30),
     ("amc23", "test", 40)],
)  # fmt: skip
def test_every_published_benchmark_loads_with_its_gold_answers(name, split, count, monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    problems = load_problems(DataConfig(dataset=name, split=split, root=str(SHARED_DATA)))
    raw = _raw(name, split)
    assert len(problems) == len(raw) == count
    for p, row in zip(problems, raw, strict=True):  # an independent reading of each published row
        if name == "gsm8k":
            gold = row["answer"].split("####")[-1].strip()
        elif isinstance(row["answer"], float):
            gold = repr(row["answer"])  # AMC 23: 27.0 stays "27.0"
        else:
            gold = str(row["answer"]).strip()
        assert p["answer"] == gold and p["source"] == f"{name}/{split}"
        assert p["question"] == (row.get("problem") or row["question"]).strip()
    assert len({p["id"] for p in problems}) == count  # ids are unique
    if name == "math500":
        assert {p["level"] for p in problems} == {1, 2, 3, 4, 5}
    if name == "amc23":
        assert problems[0]["answer"] == "27.0" and problems[0]["id"] == "amc23-0"
    if name == "aime24":
        assert problems[0]["answer"] == "204"


@needs_shared
def test_data_dir_from_the_environment_and_files_named_by_folder(monkeypatch):
    monkeypatch.setenv("QERL_DATA_DIR", str(SHARED_DATA))
    assert len(load_problems(DataConfig(dataset="aime24", split="test"))) == 30
    # the file itself, by path: Qwen's layout is detected (question + a numeric answer, no '####')
    path = SHARED_DATA / "amc23" / "test.jsonl"
    cfg = DataConfig(dataset=str(path), split="test")
    problems = load_problems(cfg)
    assert len(problems) == 40 and problems[0]["id"] == "qwen-eval-0" and problems[0]["answer"] == "27.0"
    assert dataset_name(cfg) == ("amc23", "test")


def test_data_root_without_the_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    (tmp_path / "gsm8k").mkdir()
    _jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(FileNotFoundError, match=r"has no gsm8k/test.jsonl.*holds \['train.jsonl'\].*hub"):
        load_problems(DataConfig(dataset="gsm8k", split="test", root=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="no math500/ folder"):
        load_problems(DataConfig(dataset="math500", split="test", root=str(tmp_path)))
    (p,) = load_problems(DataConfig(dataset="gsm8k", split="train", root=str(tmp_path)))
    assert p["id"] == "gsm8k-0" and p["answer"] == "1" and p["source"] == "gsm8k/train"


def test_qwen_eval_layout_and_gsm8k_detection(tmp_path):
    rows = [
        {"id": 3, "question": "q", "answer": 27.0},
        {"id": 4, "problem": "p", "question": "p", "answer": "5"},
    ]
    problems = load_problems(DataConfig(dataset=str(_jsonl(tmp_path / "amc.jsonl", rows))))
    assert [(p["id"], p["question"], p["answer"]) for p in problems] == [
        ("qwen-eval-3", "q", "27.0"),
        ("qwen-eval-4", "p", "5"),
    ]
    # a question/answer file with worked '####' answers is GSM8K's: a row without one is an error
    bad = _jsonl(
        tmp_path / "g.jsonl", [{"question": "a", "answer": "x\n#### 2"}, {"question": "b", "answer": "3"}]
    )
    with pytest.raises(ValueError, match=r"row 1: no gold answer in 'answer' \(no '####'\)"):
        load_problems(DataConfig(dataset=str(bad)))
    null = _jsonl(tmp_path / "n.jsonl", [{"id": 1, "problem": "p", "answer": None}])
    with pytest.raises(ValueError, match=r"row 0: no gold answer in 'answer'"):
        load_problems(DataConfig(dataset=str(null), local_format="qwen-eval"))


def test_dataset_names_in_reports():
    assert dataset_name(DataConfig(dataset="gsm8k", split="test")) == ("gsm8k", "test")
    assert dataset_name(DataConfig(dataset="/d/gsm8k/test.jsonl", split="train")) == ("gsm8k", "test")
    assert dataset_name(DataConfig(dataset="/d/my_set.parquet", split="test")) == ("my_set", "test")


def test_templates_render_through_the_chat_template_explicitly():
    from qerl.pipeline.data.prompts import TEMPLATES, answer_format, render_prompt

    class Chat:
        chat_template = "{{ chatml }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return (
                "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
                + "<|im_start|>assistant\n"
            )

    class Plain:
        chat_template = None
        name_or_path = "plain-base"

    assert all(spec["render"] == "chat" for spec in TEMPLATES.values())
    text = render_prompt(Chat(), "What is 2 + 3?", "number")
    assert text == (
        "<|im_start|>user\nWhat is 2 + 3?\nGive the final answer as a number at the end.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert answer_format("number") == "last_number"
    # no silent plain-text fallback for a tokenizer without a chat template
    with pytest.raises(ValueError, match=r"template 'boxed' renders through .* \(plain-base\) has none"):
        render_prompt(Plain(), "q", "boxed")
