"""The demo base does not depend on how many intra-op threads the caller runs torch with."""

from __future__ import annotations

import hashlib

import torch
from qerl.pipeline.demo.base_model import DemoBaseConfig, build_demo_base


def test_demo_base_is_the_same_for_any_thread_count(tmp_path):
    cfg = DemoBaseConfig(n_train=200, sft_steps=12, sft_batch=32, hidden_size=64, intermediate_size=192)
    digests = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = tmp_path / f"threads-{threads}"
            metrics = build_demo_base(out, cfg)
            assert torch.get_num_threads() == threads, "the caller's thread count must be restored"
            assert metrics["sft_threads"] == 1
            digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    finally:
        torch.set_num_threads(before)
    assert digests[0] == digests[1]
