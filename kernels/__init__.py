"""NVFP4 numerics: quantize and dequantize, bit-exact across devices.

``nvfp4_reference`` is the specification in plain PyTorch (compressed-tensors' arithmetic, operation
by operation); ``nvfp4_triton`` (CUDA) and ``nvfp4_numba`` (CPU) must match it bit for bit;
``nvfp4_dispatch`` runs the fastest exact one for a tensor's device. Imports only torch, numpy, numba and
Triton, nothing of ``qerl.pipeline``.
"""
