"""NF4 (QLoRA's 4-bit NormalFloat, bitsandbytes) bases: the checkpoint, its dequantization and its
training load (``qerl.pipeline.nf4.checkpoint``)."""
