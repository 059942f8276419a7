"""The promotion gate: the evaluation protocol is part of a benchmark's identity, promotion is decided on
a validation split held out of the training data, by a paired test over items with a margin in
standard errors, and the test set is reported but never selects."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from qerl.pipeline.config import apply_overrides
from qerl.pipeline.data.datasets import DataConfig, load_problems
from qerl.pipeline.data.rewards import RewardConfig
from qerl.pipeline.evaluation import eval_config
from qerl.pipeline.evaluation.eval_config import EvalConfig, ValidationConfig, validation_split
from qerl.pipeline.planning.prompt_stream import slots_per_epoch, step_prompts
from qerl.pipeline.registry import promotion
from qerl.pipeline.registry import tracking as reg
from qerl.pipeline.rollout.protocol import Completion


def _id(cfg: EvalConfig, template: str = "terse", mode: str = "vllm", scorer: dict | None = None) -> str:
    protocol = eval_config.eval_protocol(cfg, template, mode, scorer or {"workers": 1})
    return eval_config.benchmark_id(DataConfig(dataset="gsm8k", split="test"), "ab" * 32, protocol)


def test_benchmark_id_carries_the_evaluation_protocol():
    base = EvalConfig()
    ref = _id(base)
    assert ref.startswith("gsm8k/test@" + "ab" * 6 + "~")
    changed = [
        _id(apply_overrides(base, ["k=8"])),
        _id(apply_overrides(base, ["greedy=true"])),
        _id(apply_overrides(base, ["temperature=1.0"])),
        _id(apply_overrides(base, ["top_p=0.5"])),
        _id(apply_overrides(base, ["max_new_tokens=1024"])),
        _id(base, template="boxed"),
        _id(base, mode="transformers"),
        _id(base, scorer={"workers": 1, "format_reward": 0.5}),
    ]
    assert ref not in changed and len(set(changed)) == len(changed)
    assert _id(apply_overrides(base, ["seed=7"])) == ref  # another draw of the same protocol


def test_validation_split_is_disjoint_from_the_stream_and_the_test_set(tiny_model_dir):
    from qerl.flows.run import fit_data, read_data
    from qerl.pipeline.planning.run_config import RunConfig
    from qerl.pipeline.store.run_record import RunRecord

    cfg = RunConfig.model_validate({"eval": {"validation": {"size": 40}}, "loop": {"prompts_per_step": 8}})
    stages: list[str] = []
    run = types.SimpleNamespace(
        cfg=cfg,
        record=RunRecord(run_id="r"),
        ui=types.SimpleNamespace(stage=lambda *a, **k: stages.append(a[1])),
    )
    base = types.SimpleNamespace(twin=None, quantized=types.SimpleNamespace(dir=tiny_model_dir))
    rows, held_out = read_data(
        run
    )  # chosen before the base is quantized (GPTQ's calibration leaves them out)
    stream, validation = fit_data(run, base, rows, held_out)
    assert [p["id"] for p in held_out] == [p["id"] for p in validation]
    held = {p["id"] for p in validation}
    n = len(held)  # whole groups (pairs of numbers) until there are 40: a few less
    assert 35 <= n <= 40 and run.record.data.validation.n_items == n
    assert f"{n} held out for validation" in stages[0]
    assert not {p["group"] for p in validation} & {p["group"] for p in stream}  # nor their numbers
    # the stream: every slot of two epochs, none holds a validation problem
    n_slots = 2 * slots_per_epoch(len(stream), 8)
    used = {p["id"] for s in range(n_slots) for p in step_prompts(stream, s, 8, cfg.loop.seed)}
    assert used and not used & held and len(stream) + n == run.record.data.kept
    # the reported test set shares no problem with it
    test = load_problems(cfg.eval.benchmark)
    assert not {p["question"] for p in validation} & {p["question"] for p in test}
    # chosen by id, not by position; at most a quarter of the data
    problems = load_problems(cfg.data, "train")
    _, again = validation_split(list(reversed(problems)), ValidationConfig(size=40))
    _, first = validation_split(problems, ValidationConfig(size=40))
    assert {p["id"] for p in again} == {p["id"] for p in first}
    assert 1 <= len(validation_split(problems[:20], ValidationConfig(size=40))[1]) <= 5


class _V:
    def __init__(self, version: str):
        self.version, self.tags = version, {"eval_benchmark": "b", "eval_accuracy": "0.5"}


def _evidence(diff: float, se: float, champion: str = "1") -> promotion.PairedEvidence:
    return promotion.PairedEvidence("v@x~p", champion, diff, se, 100, 0.5 + diff, 0.5)


def test_paired_decision_needs_the_margin_in_standard_errors():
    cfg = reg.RegistryConfig(promote_margin_se=1.0)
    assert reg.RegistryConfig().promote_margin_se == 2.0  # the default: a tie night is promoted 1 in 44
    champ = _V("1")
    assert not promotion.promotion_decision(cfg, champ, "2", "v@x~p", 0.52, True, _evidence(0.02, 0.03))[0]
    ok, reason = promotion.promotion_decision(cfg, champ, "2", "v@x~p", 0.6, True, _evidence(0.1, 0.03))
    assert ok and "paired" in reason and "se 0.0300" in reason
    strict = cfg.model_copy(update={"promote_margin_se": 2.0})
    assert not promotion.promotion_decision(strict, champ, "2", "v@x~p", 0.55, True, _evidence(0.05, 0.03))[0]
    # the champion moved while this run was compared with the old one: no promotion
    assert not promotion.promotion_decision(cfg, _V("3"), "4", "v@x~p", 0.9, True, _evidence(0.4, 0.01))[0]
    # no comparison possible: never promoted over a champion, whatever the accuracy
    no, why = promotion.promotion_decision(cfg, champ, "2", "v@x~p", 0.99, True, "another base")
    assert not no and "another base" in why


def test_a_lineage_holds_out_its_validation_items_only_while_every_run_of_it_did():
    held = "a" * 64
    assert promotion.heldout_lineage(held, None) == held  # from the bare base
    assert promotion.heldout_lineage(held, {promotion.HELDOUT_TAG: held}) == held
    # warm-started from a version whose lineage held out other items, none, or recorded nothing
    for tags in ({promotion.HELDOUT_TAG: "b" * 64}, {promotion.HELDOUT_TAG: promotion.NO_HELDOUT}, {}):
        assert promotion.heldout_lineage(held, tags) == promotion.NO_HELDOUT
    lineage = {"validation_digest": held, promotion.HELDOUT_TAG: held}
    assert promotion.heldout_conflict(None, lineage) is None
    champ = _V("1")
    champ.tags[promotion.HELDOUT_TAG] = held
    assert promotion.heldout_conflict(champ, lineage) is None
    champ.tags.pop(promotion.HELDOUT_TAG)
    assert "records no held-out items" in promotion.heldout_conflict(champ, lineage)
    nothing = {"validation_digest": promotion.NO_HELDOUT, promotion.HELDOUT_TAG: promotion.NO_HELDOUT}
    assert "held out no validation items" in promotion.heldout_conflict(None, nothing)


class _Engine:
    """A RolloutEngine double: item i is right when i % 4 < 1 (max_new_tokens < 512) or < 2 (a longer
    budget: the same model scores higher under another protocol), on every item with ``perfect``."""

    mode = "fake-test-double"

    def __init__(self, answers: dict[str, str], tokenizer, perfect: bool = False):
        self.tokenizer, self.answers, self.perfect = tokenizer, answers, perfect

    def set_adapter(self, path, digest):
        pass

    def set_noise(self, sigma, seed):
        pass

    def generate(self, prompts, n, sampling, seed):
        out = []
        for i, prompt in enumerate(prompts):
            gold = next(a for q, a in self.answers.items() if q in prompt)
            ok = self.perfect or i % 4 < (1 if sampling.max_new_tokens < 512 else 2)
            group = [
                Completion([1], [2], f"<answer>{gold if ok else '-1'}</answer>", [-0.1], "stop")
                for _ in range(n)
            ]
            out.append(group)
        return out

    def close(self):
        pass


def _setup(tmp_path: Path, tiny_model_dir: Path):
    from tests.stages.test_evaluation import tokenizer_base

    store, base, tokenizer = tokenizer_base(tiny_model_dir, tmp_path / "store")
    data = DataConfig(arithmetic_size=64)
    _, val = validation_split(load_problems(data, "train"), ValidationConfig(size=12))
    return store, base, tokenizer, (data, val)


@pytest.mark.slow
def test_a_protocol_change_never_crowns_a_challenger(tiny_model_dir, tmp_path):
    from qerl.stages import evaluate, register

    from tests.stages.test_register import HISTORY, LINEAGE, fake_train

    store, base, tok, validation = _setup(tmp_path, tiny_model_dir)
    cfg_a = apply_overrides(EvalConfig(), ["benchmark.limit=12", "k=2"])
    # a longer budget: this engine scores higher, the model is the same
    cfg_b = apply_overrides(cfg_a, ["max_new_tokens=1024"])
    questions = load_problems(cfg_a.benchmark) + validation[1]
    same = _Engine({p["question"]: p["answer"] for p in questions}, tok)

    def evaluated(cfg, adapter, engine=same):
        return evaluate.run(
            cfg, base, Path("adapter"), adapter, store, engine, RewardConfig(workers=1), validation
        )

    regcfg = reg.RegistryConfig(model_name="protocol-probe")
    work = tmp_path / "work"
    champ_train, chal_train = fake_train(store, "champ"), fake_train(store, "chal")
    ev_a = evaluated(cfg_a, champ_train.digest)
    m1 = register.run(regcfg, champ_train, ev_a, LINEAGE, HISTORY, work, True, store)
    assert m1.metrics["promoted"]

    ev_b = evaluated(cfg_b, chal_train.digest)
    sa, sb = (json.loads(e.file("summary.json").read_text()) for e in (ev_a, ev_b))
    assert sb["validation"]["accuracy"] > sa["validation"]["accuracy"] and sb["accuracy"] > sa["accuracy"]
    # the protocol is in the id: the two numbers are not the same benchmark
    assert (
        sb["benchmark"] != sa["benchmark"] and sb["validation"]["benchmark"] != sa["validation"]["benchmark"]
    )
    # the champion's recorded number (old protocol) is no comparison for the new one
    recorded = promotion.alias_version(regcfg, "champion")
    assert not promotion.promotion_decision(regcfg, recorded, "9", sb["benchmark"], sb["accuracy"], True)[0]
    # the champion re-evaluated under the new protocol scores the same: a tie, not a win
    champ_b = evaluated(cfg_b, champ_train.digest)
    m2 = register.run(
        regcfg, chal_train, ev_b, LINEAGE, HISTORY, work, True, store, champion_eval=("1", champ_b)
    )
    rec = json.loads(m2.file("registration.json").read_text())
    assert (
        not rec["promoted"]
        and "does not beat" in rec["promotion"]
        and "difference +0.0000" in rec["promotion"]
    )
    assert rec["decided_on"] == sb["validation"]["benchmark"] and rec["decided_on"].split("/")[1].startswith(
        "validation"
    )

    # a clearly better adapter, compared item by item on the validation split, is promoted
    better = _Engine(same.answers, tok, perfect=True)
    good_train = fake_train(store, "good")
    ev_good = evaluated(cfg_b, good_train.digest, better)
    m3 = register.run(
        regcfg, good_train, ev_good, LINEAGE, HISTORY, work, True, store, champion_eval=("1", champ_b)
    )
    rec3 = json.loads(m3.file("registration.json").read_text())
    assert rec3["promoted"] and "beats the champion" in rec3["promotion"], rec3["promotion"]
    tags = promotion.version_info(regcfg, str(m3.metrics["version"]))["tags"]
    assert tags["eval_benchmark"] == sb["benchmark"] and float(tags["eval_accuracy"]) == 1.0  # test: reported
    assert tags["promotion_benchmark"] == sb["validation"]["benchmark"]


@pytest.mark.slow
def test_too_few_paired_items_never_promote():
    """One item has a standard error of 0, so any gain would clear the margin: the rule needs
    ``MIN_PAIRED_ITEMS``. With enough items an even gain (no spread, se 0) is evidence."""
    cfg = reg.RegistryConfig()
    one = promotion.PairedEvidence("v@x~p", promotion.BASE, 1.0, 0.0, 1, 1.0, 0.0)
    ok, why = promotion.promotion_decision(cfg, None, "1", "v@x~p", 1.0, True, one)
    assert not ok and why.startswith("too few items to decide against the base model"), why
    assert f"at least {promotion.MIN_PAIRED_ITEMS} are needed" in why
    nine = promotion.PairedEvidence(
        "v@x~p", promotion.BASE, 0.5, 0.1, promotion.MIN_PAIRED_ITEMS - 1, 1.0, 0.5
    )
    assert not promotion.promotion_decision(cfg, None, "1", "v@x~p", 1.0, True, nine)[0]
    even = promotion.PairedEvidence("v@x~p", promotion.BASE, 0.25, 0.0, 12, 0.75, 0.5)
    assert promotion.promotion_decision(cfg, None, "1", "v@x~p", 0.75, True, even)[0]


def test_a_policy_an_older_qerl_set_names_its_recipe_on_a_paired_comparison(tmp_path):
    """A policy whose ``quant_recipe`` is an older qerl's bare hash (one for every NVFP4 method)
    takes the candidate's named recipe once paired evidence exists (the champion was checked to share
    it), as a recorded change; a policy with a named recipe never moves that way."""
    from qerl.pipeline.registry import policy

    regcfg = reg.connect(reg.RegistryConfig(model_name="legacy-probe"), tmp_path)
    old = policy.PromotionPolicy(margin_se=2.0, margin=0.0, benchmark="v@x~p", base_digest="b" * 16,
                                 quant_recipe="f009be9938a93b23", set_by="an older qerl")  # fmt: skip
    assert policy.first_policy(regcfg.model_name, old) == old
    lineage = {"quant_recipe": "nvfp4-gptq-0123456789ab", "run_id": "night-9"}
    named = promotion._named_recipe(regcfg.model_name, old, _evidence(0.1, 0.02), lineage)
    assert named.quant_recipe == "nvfp4-gptq-0123456789ab" and named.margin_se == 2.0
    (change,) = policy.policy_changes(regcfg.model_name)
    assert (
        change["from"] == {"quant_recipe": "f009be9938a93b23"} and "champion v1 evaluated on" in change["by"]
    )
    again = promotion._named_recipe(
        regcfg.model_name, named, _evidence(0.1, 0.02), {"quant_recipe": "nvfp4-rtn-x"}
    )
    assert again == named and len(policy.policy_changes(regcfg.model_name)) == 1


def test_an_operator_restores_a_lineages_held_out_status_with_a_record(tiny_model_dir, tmp_path, capsys):
    """A version registered before the held-out tag existed (every existing registry's first upgraded
    night) has no ``heldout_lineage``: its descendants are refused. ``qerl heldout`` sets it to the
    version's validation items and records who, when, why and what it was."""
    from qerl.flows.cli import main
    from qerl.pipeline.registry import heldout

    from tests.pipeline.test_engines import make_adapter
    from tests.stages.test_registered_adapter import _register

    _register(tmp_path, make_adapter(tiny_model_dir, tmp_path / "adapter"), "base-A")
    client = promotion.MlflowClient()
    client.set_model_version_tag("qerl-adapter", "1", "validation_digest", "v" * 64)
    tags = promotion.MlflowClient().get_model_version("qerl-adapter", "1").tags
    assert heldout.heldout_lineage("v" * 64, tags) == heldout.NO_HELDOUT  # a descendant of v1: none
    with pytest.raises(SystemExit):  # a reason is required
        main(["heldout", "qerl-adapter", "1", "--work-dir", str(tmp_path)])
    capsys.readouterr()
    argv = [
        "heldout",
        "qerl-adapter",
        "1",
        "--reason",
        "pre-tag lineage, one split",
        "--work-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    assert "held-out items vvvvvvvvvvvv (was no tag), attested qerl heldout by" in capsys.readouterr().out
    tags = promotion.MlflowClient().get_model_version("qerl-adapter", "1").tags
    record = json.loads(tags[heldout.ATTESTED_TAG])
    assert record["reason"] == "pre-tag lineage, one split" and record["was"] is None and record["by"]
    assert heldout.heldout_lineage("v" * 64, tags) == "v" * 64  # its descendants hold the items out again
    assert main(["heldout", "qerl-adapter", "7", "--reason", "x", "--work-dir", str(tmp_path)]) == 2


def test_a_policy_change_keeps_an_all_digit_digest_as_text(tmp_path, capsys):
    """``qerl policy --change base_digest=0123...`` sets the text as typed (YAML would read a number)."""
    from qerl.flows.cli import main
    from qerl.pipeline.registry import policy

    regcfg = reg.connect(reg.RegistryConfig(), tmp_path)
    first = policy.PromotionPolicy(margin_se=2.0, margin=0.0, benchmark="v@x~p", base_digest="b" * 16,
                                   quant_recipe="nvfp4-rtn-0", set_by="test")  # fmt: skip
    policy.first_policy(regcfg.model_name, first)
    digits = "0123456789012345"
    argv = [
        "policy",
        "--change",
        f"base_digest={digits}",
        "--change",
        "quant_recipe=1e5",
        "--change",
        "margin_se=3",
    ]
    assert main([*argv, "--work-dir", str(tmp_path)]) == 0
    now = policy.read_policy(regcfg.model_name)
    assert (now.base_digest, now.quant_recipe, now.margin_se) == (digits, "1e5", 3.0)


def test_the_registered_model_owns_its_promotion_policy(tiny_model_dir, tmp_path):
    """The first candidate must beat the base model and sets the policy from its config; a later
    candidate's own margin, its validation items or protocol, and its base change nothing of it; only
    ``change_policy`` does, and the change is recorded."""
    from qerl.pipeline.registry import policy
    from qerl.stages import evaluate, register

    from tests.stages.test_register import HISTORY, LINEAGE, fake_train

    store, base, tok, validation = _setup(tmp_path, tiny_model_dir)
    cfg = apply_overrides(EvalConfig(), ["benchmark.limit=12", "k=2"])
    questions = load_problems(cfg.benchmark) + validation[1]
    answers = {p["question"]: p["answer"] for p in questions}
    plain, perfect = _Engine(answers, tok), _Engine(answers, tok, perfect=True)

    def evaluated(adapter, engine, eval_cfg=cfg):
        return evaluate.run(
            eval_cfg,
            base,
            Path("adapter") if adapter else None,
            adapter,
            store,
            engine,
            RewardConfig(workers=1),
            validation,
        )

    def registered(regcfg, tag, engine, champion, lineage=LINEAGE):
        train = fake_train(store, tag)
        m = register.run(regcfg, train, evaluated(train.digest, engine), lineage, HISTORY, tmp_path / "w",
                         True, store, champion_eval=champion)  # fmt: skip
        return json.loads(m.file("registration.json").read_text())

    name = "policy-probe"
    regcfg = reg.RegistryConfig(model_name=name, promote_margin_se=2.0)
    base_ev = evaluated(None, plain)
    # night 1 is no better than the base model (the same answers): not promoted, no champion
    tie = registered(regcfg, "tie", plain, (promotion.BASE, base_ev))
    assert not tie["promoted"] and tie["promotion"].startswith("does not beat the base model"), tie[
        "promotion"
    ]
    assert promotion.alias_version(regcfg, "champion") is None
    set_by_night_1 = policy.read_policy(name)
    assert set_by_night_1.margin_se == 2.0 and "/validation@" in set_by_night_1.benchmark
    # a clearly better adapter beats the base model and becomes the first champion
    won = registered(regcfg, "good", perfect, (promotion.BASE, base_ev))
    assert won["promoted"] and won["promotion"].startswith("beats the base model"), won["promotion"]

    # a challenger that asks for no margin is judged by the policy's two standard errors all the same
    lax = regcfg.model_copy(update={"promote_margin_se": 0.0})
    champ_ev = evaluated(fake_train(store, "good").digest, perfect)
    better_than_nothing = promotion.PairedEvidence(set_by_night_1.benchmark, str(won["version"]), 0.05, 0.04,
                                                   12, 1.0, 0.95)  # fmt: skip
    assert not promotion.maybe_promote(lax, "1", set_by_night_1.benchmark, 1.0, True, better_than_nothing,
                                       lineage=LINEAGE)  # fmt: skip
    assert "margin max(2.0 se" in promotion.version_info(regcfg, "1")["tags"]["promotion"]
    # another protocol (a longer budget) or another base is not compared at all
    longer = apply_overrides(cfg, ["max_new_tokens=1024"])
    train = fake_train(store, "longer")
    champion_longer = (str(won["version"]), evaluated(fake_train(store, "good").digest, perfect, longer))
    m = register.run(regcfg, train, evaluated(train.digest, perfect, longer), LINEAGE, HISTORY, tmp_path / "w",
                     True, store, champion_eval=champion_longer)  # fmt: skip
    other = json.loads(m.file("registration.json").read_text())
    assert not other["promoted"] and "the registered model's policy decides on" in other["promotion"]
    rtn = registered(
        regcfg, "rtn", perfect, (str(won["version"]), champ_ev), {**LINEAGE, "quant_recipe": "rtn"}
    )
    assert not rtn["promoted"] and "compared only on its own base" in rtn["promotion"], rtn["promotion"]
    assert policy.read_policy(name) == set_by_night_1
    # evidence on items a lineage may have trained on is no evidence: the candidate warm-started from
    # a version that held out other items, or the champion's lineage held out other items
    leaky = registered(regcfg, "leaky", perfect, (str(won["version"]), champ_ev),
                       {**LINEAGE, "heldout_lineage": promotion.NO_HELDOUT})  # fmt: skip
    assert not leaky["promoted"] and "may have trained on its own validation items" in leaky["promotion"]
    client = promotion.MlflowClient()
    client.set_model_version_tag(name, str(won["version"]), promotion.HELDOUT_TAG, "o" * 64)
    unfair = registered(regcfg, "unfair", perfect, (str(won["version"]), champ_ev))
    assert not unfair["promoted"] and "lineage held out oooooooooooo" in unfair["promotion"], unfair[
        "promotion"
    ]
    client.set_model_version_tag(
        name, str(won["version"]), promotion.HELDOUT_TAG, LINEAGE["validation_digest"]
    )

    # only an explicit change moves the policy, and it is recorded
    before, after = policy.change_policy(name, {"margin_se": 3.0}, "qerl policy (test)")
    assert before.margin_se == 2.0 and after.margin_se == 3.0 and after.set_by == "qerl policy (test)"
    (change,) = policy.policy_changes(name)
    assert change["from"] == {"margin_se": 2.0} and change["to"] == {"margin_se": 3.0}
    with pytest.raises(policy.RegistryError, match="valid fields: margin_se"):
        policy.change_policy(name, {"margin_sd": 1.0}, "typo")
