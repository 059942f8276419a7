"""NF4 (QLoRA's 4-bit NormalFloat, bitsandbytes) bases: the checkpoint (``checkpoint``), its
dequantization (``dequantize``) and its training load (``training``)."""

import logging as _logging

# bitsandbytes' CPU backend tries, at import, an optional kernel from the Hugging Face hub (through the
# `kernels` package, which is not installed) and warns that it could not; its plain-torch path runs
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
