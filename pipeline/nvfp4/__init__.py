"""The NVFP4A16 base model: the checkpoint the quantize stage writes, and the layer LoRA trains on.

``recipe`` (what is quantized, supported models, the config.json ``quantization_config``),
``grouping`` (which linears are quantized together and share a global scale), ``safetensors_io``
(streaming header/tensor reads and the sharded writer), ``linear`` (``NVFP4Linear``, the packed
autograd layer), ``loading`` (a checkpoint as a trainable HF model of such layers), how the codes are
chosen beyond round-to-nearest (``scale_search``: per-block scale search; ``gptq`` and
``calibration``: GPTQ, calibrated one decoder layer at a time), ``quality`` (what quantization
costs: weight errors, KL, top-1 agreement, perplexities) and ``marlin`` (the blocks vLLM's FP4 Marlin
kernel reads as zero). The numerics
live in ``qerl.kernels`` (``nvfp4_reference`` is the specification). May import ``config``,
``runtime``, ``store`` and ``qerl.kernels``.
"""
