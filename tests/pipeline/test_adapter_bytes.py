"""A saved adapter's bytes depend on its weights and config only, not on the process that wrote it:
peft keeps ``target_modules`` as a set, whose order follows Python's per-process string hashing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

SAVE = """
import sys
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
import torch
from qerl.pipeline.rl.checkpoint import save_adapter
from qerl.pipeline.rl.train_config import ALL_PROJECTIONS
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_PROJECTIONS)))
peft.save_pretrained(sys.argv[2] + "/plain")
save_adapter(peft, sys.argv[2] + "/ours")
"""


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_adapter_config_bytes_do_not_depend_on_the_hash_seed(tiny_model_dir, tmp_path):
    seeds = (1, 2)  # two hash seeds that order peft's target_modules set differently
    for seed in seeds:
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        subprocess.run(
            [sys.executable, "-c", SAVE, str(tiny_model_dir), str(tmp_path / str(seed))], check=True, env=env
        )
    plain = {_digest(tmp_path / str(s) / "plain" / "adapter_config.json") for s in seeds}
    ours = {_digest(tmp_path / str(s) / "ours" / "adapter_config.json") for s in seeds}
    assert len(plain) > 1, "peft's own output no longer varies: this test shows nothing, drop save_adapter?"
    assert len(ours) == 1
    weights = {_digest(tmp_path / str(s) / "ours" / "adapter_model.safetensors") for s in seeds}
    assert len(weights) == 1
