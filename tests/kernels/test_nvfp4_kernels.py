"""NVFP4 reference kernel: truth tables, ties, saturation, zero blocks, FP8 rounding, and the Triton
and numba implementations bit-exact against it (Triton under TRITON_INTERPRET=1, set by conftest)."""

from __future__ import annotations

import pytest
import torch
from qerl.kernels import nvfp4_dispatch
from qerl.kernels.nvfp4_reference import (
    FP4_VALUES,
    NVFP4Error,
    dequantize_nvfp4,
    fp4_codes,
    global_scale,
    pack_codes,
    quantize_nvfp4,
    round_fp8_e4m3,
    unpack_codes,
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def test_fp4_truth_table_every_code():
    vals = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES[1:]), dtype=torch.float32)
    codes = fp4_codes(vals)
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    # decoding every code (including 8 = "-0") gives the table back, sign of zero included
    packed = pack_codes(torch.arange(16, dtype=torch.uint8).reshape(1, 16))
    deq = dequantize_nvfp4(packed, torch.ones(1, 1).to(torch.float8_e4m3fn), 1.0, dtype=torch.float32)[0]
    assert deq[:8].tolist() == list(FP4_VALUES)
    assert deq[9:].tolist() == [-v for v in FP4_VALUES[1:]]
    assert deq[8].item() == 0.0 and torch.signbit(deq[8])


@pytest.mark.parametrize(
    ("x", "code"),
    [
        (0.25, 0),  # tie 0 | 0.5 -> even code 0
        (0.75, 2),  # tie 0.5 | 1.0 -> 1.0
        (1.25, 2),  # tie 1.0 | 1.5 -> 1.0
        (1.75, 4),  # tie 1.5 | 2.0 -> 2.0
        (2.5, 4),  # tie 2 | 3 -> 2
        (3.5, 6),  # tie 3 | 4 -> 4
        (5.0, 6),  # tie 4 | 6 -> 4
        (0.2500001, 1),
        (0.7499999, 1),
        (5.0000005, 7),
        (6.5, 7),  # saturation
        (1e30, 7),
        (-1e30, 15),
        (-0.1, 8),  # a negative quotient that rounds to zero keeps its sign bit (library behaviour)
        (-0.0, 0),  # but -0.0 itself is code 0
        (-2.5, 12),
    ],
)
def test_fp4_ties_and_saturation(x, code):
    assert fp4_codes(torch.tensor([x], dtype=torch.float32)).item() == code


def test_pack_unpack_roundtrip_low_nibble_first():
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_codes(codes)
    assert packed.shape == (5, 16)
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)
    assert torch.equal(unpack_codes(packed), codes)


def test_fp8_rounding_matches_torch_cast_value_by_value():
    g = torch.Generator().manual_seed(1)
    x = torch.cat(
        [
            torch.rand(20000, generator=g) * 460,
            torch.rand(20000, generator=g) * 0.05,  # subnormals of E4M3 (< 2^-6)
            torch.tensor([7.85, 7.5, 15.5, 0.0, 448.0, 447.9, 1e-9, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 240.0]),
        ]
    )
    ours = round_fp8_e4m3(x)
    torch_cast = x.clamp(max=448).to(torch.float8_e4m3fn).float()
    assert torch.equal(ours, torch_cast)
    assert round_fp8_e4m3(torch.tensor([7.85])).item() == 8.0  # the carry the interpreter gets wrong
    assert round_fp8_e4m3(torch.tensor([1000.0])).item() == 448.0  # saturation


def test_global_scale():
    assert global_scale(torch.tensor(2688.0)).item() == 1.0
    assert global_scale(1.0).dtype == torch.float32 and global_scale(1.0).shape == (1,)
    assert global_scale(0.0).item() == 1.0  # all-zero tensor: the library's fallback


def test_zero_blocks_and_zero_tensor():
    w = torch.randn(4, 64)
    w[1, 16:32] = 0.0
    packed, scale, gs = quantize_nvfp4(w)
    assert scale[1, 1].float().item() == 0.125  # a zero block scale is replaced by 0.125
    assert torch.all(unpack_codes(packed)[1, 16:32] == 0)
    z_packed, z_scale, z_gs = quantize_nvfp4(torch.zeros(2, 32))
    assert z_gs.item() == 1.0 and torch.all(z_packed == 0) and torch.all(z_scale.float() == 0.125)
    assert torch.all(dequantize_nvfp4(z_packed, z_scale, z_gs) == 0)


def test_quantize_dequantize_error_is_bounded():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    packed, scale, gs = quantize_nvfp4(w)
    deq = dequantize_nvfp4(packed, scale, gs, dtype=torch.float32)
    # each element is within half an FP4 step (<= 1 at the top binade) of the block scale
    block_mult = (scale.float() / gs).repeat_interleave(16, dim=1)
    assert torch.all((deq - w).abs() <= block_mult * 1.0 + 1e-6)
    assert (deq - w).abs().mean() < 0.1 * w.abs().mean()


def test_shared_global_scale_is_used():
    w = torch.randn(8, 32)
    _, _, gs = quantize_nvfp4(w, global_scale=torch.tensor([3.0]))
    assert gs.item() == 3.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_names_the_tensor(bad):
    w = torch.randn(4, 32)
    w[2, 5] = bad
    with pytest.raises(NVFP4Error, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*row 2, column 5"):
        quantize_nvfp4(w, name="model.layers.0.mlp.up_proj.weight")


def test_shape_errors_name_the_tensor():
    with pytest.raises(NVFP4Error, match="q_proj.*multiple of 16"):
        quantize_nvfp4(torch.randn(4, 24), name="q_proj")
    with pytest.raises(NVFP4Error, match="2-D"):
        quantize_nvfp4(torch.randn(32), name="bias")


def _adversarial(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    heavy = torch.randn(48, 128, generator=g) ** 7  # huge dynamic range: tiny and saturated blocks
    ties = (torch.randint(-12, 13, (32, 64), generator=g).float() / 4.0) * (
        2.0 ** torch.randint(-4, 4, (32, 1))
    )
    mixed = torch.randn(32, 96, generator=g) * 0.02
    mixed[3] = 0.0
    mixed[5, :16] = -0.0
    mixed[7, 16:32] = 1e-30  # far below the tensor max: the block scale underflows to 0 -> 0.125
    return [heavy, ties, mixed, torch.randn(16, 48, generator=g).bfloat16(), torch.randn(8, 32).half()]


@pytest.mark.parametrize("seed", [0, 1])
def test_numba_backend_bit_exact(seed):
    from qerl.kernels import nvfp4_numba

    if not nvfp4_numba.available():
        pytest.skip("numba not installed")
    for w in _adversarial(seed):
        ref = quantize_nvfp4(w)
        fast = nvfp4_dispatch._quantize_numba(w, None, "w", chunk_elements=1000)  # several row chunks
        assert all(_same(a, b) for a, b in zip(ref, fast, strict=True))


def test_reference_chunking_does_not_change_bits():
    w = torch.randn(37, 64)
    assert all(
        _same(a, b) for a, b in zip(quantize_nvfp4(w), quantize_nvfp4(w, chunk_elements=100), strict=True)
    )


def test_dispatcher_uses_numba_on_cpu():
    assert nvfp4_dispatch.quantize_backend("cpu") in {"numba", "torch"}
    w = torch.randn(16, 64)
    assert all(_same(a, b) for a, b in zip(nvfp4_dispatch.quantize(w), quantize_nvfp4(w), strict=True))


# --- Triton (interpreter on CPU) ---------------------------------------------------------------------


def test_triton_fp8_rounding_matches_torch_cast():
    from qerl.kernels.nvfp4_triton import round_fp8_e4m3_triton

    g = torch.Generator().manual_seed(3)
    x = torch.cat(
        [torch.rand(1000, generator=g) * 460, torch.rand(1000, generator=g) * 0.03, torch.tensor([7.85])]
    )
    assert torch.equal(round_fp8_e4m3_triton(x), x.clamp(max=448).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_quantize_bit_exact(seed):
    from qerl.kernels.nvfp4_triton import quantize_nvfp4_triton

    for w in _adversarial(seed):
        ref = quantize_nvfp4(w)
        tri = quantize_nvfp4_triton(w)
        assert all(_same(a, b) for a, b in zip(ref, tri, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_triton_dequantize_bit_exact(dtype):
    from qerl.kernels.nvfp4_triton import dequantize_nvfp4_triton

    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (24, 40), dtype=torch.uint8, generator=g)
    scale = (torch.rand(24, 5, generator=g) * 448).to(torch.float8_e4m3fn)
    gs = torch.tensor([37.5])
    assert _same(
        dequantize_nvfp4(packed, scale, gs, dtype), dequantize_nvfp4_triton(packed, scale, gs, dtype)
    )
    # every code, negative/zero/subnormal/saturated scales, huge and tiny global scales: a negative
    # scale flips the sign of every code, -0.0 included (missed here until an H200 showed it)
    for packed, scale, gs in _adversarial_packed(0)[-6:]:
        assert _same(
            dequantize_nvfp4(packed, scale, gs, dtype), dequantize_nvfp4_triton(packed, scale, gs, dtype)
        )


def test_non_finite_weight_with_shared_global_scale_still_fails():
    w = torch.randn(8, 64)
    w[6, 40] = float("nan")
    with pytest.raises(NVFP4Error, match=r"'gate_proj'.*row 6, column 40"):
        nvfp4_dispatch.quantize(w, torch.tensor([100.0]), name="gate_proj")


# --- numba dequantizer (the CPU training hot path) ----------------------------------------------------


def _adversarial_packed(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Packed weights that stress decoding: every code (incl. 8 = "-0"), zero/0.125/saturated/denormal
    FP8 scales, tiny and huge global scales (bf16 overflow to inf and underflow to zero)."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for w in _adversarial(seed):
        cases.append(quantize_nvfp4(w))  # real quantizer output: zero blocks (0.125), ties, saturation
    packed = torch.randint(0, 256, (40, 48), dtype=torch.uint8, generator=g)
    packed[0] = 0x88  # negative zeros only
    packed[1] = 0x77  # +6 everywhere
    packed[2] = 0xFF  # -6 everywhere
    scale_bytes = torch.randint(0, 256, (40, 6), dtype=torch.uint8, generator=g)
    scale_bytes[scale_bytes & 0x7F == 0x7F] = 0x7E  # no NaN encodings here (tested separately)
    scale_bytes[3] = 0x00  # zero scale: every value +-0
    scale_bytes[4] = 0x7E  # 448, the largest E4M3
    scale_bytes[5] = 0x01  # the smallest subnormal, 2^-9
    scale = scale_bytes.view(torch.float8_e4m3fn)
    for gs in (37.5, 1.0, 2688.0 / 3.0, 1e-30, 1e30, 3.0e-3):
        cases.append((packed, scale, torch.tensor([gs], dtype=torch.float32)))
    return cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_numba_dequantize_bit_exact(seed, dtype):
    from qerl.kernels import nvfp4_numba

    if not nvfp4_numba.available():
        pytest.skip("numba not installed")
    assert nvfp4_dispatch.dequantize_backend("cpu") == "numba"
    for packed, scale, gs in _adversarial_packed(seed):
        ref = dequantize_nvfp4(packed, scale, gs, dtype)
        assert _same(nvfp4_dispatch.dequantize(packed, scale, gs, dtype), ref)
        # into a caller's buffer, and from a column slice (the chunked backward of NVFP4Linear)
        buf = torch.empty_like(ref)
        assert _same(nvfp4_dispatch.dequantize(packed, scale, gs, dtype, out=buf), ref) and _same(buf, ref)
        cols = slice(16, 48) if ref.shape[1] >= 48 else slice(0, 16)
        part = nvfp4_dispatch.dequantize(
            packed[:, cols.start // 2 : cols.stop // 2],
            scale[:, cols.start // 16 : cols.stop // 16],
            gs,
            dtype,
        )
        assert _same(part, ref[:, cols].contiguous())


def test_numba_dequantize_signed_zero_and_saturation():
    from qerl.kernels import nvfp4_numba

    if not nvfp4_numba.available():
        pytest.skip("numba not installed")
    packed = torch.tensor([[0x08] * 8, [0x77] * 8], dtype=torch.uint8)
    scale = torch.tensor([[1.0], [448.0]]).to(torch.float8_e4m3fn)
    out = nvfp4_dispatch.dequantize(packed, scale, torch.tensor([1e-36]), torch.bfloat16)
    assert torch.signbit(out[0, 0]) and out[0, 0].item() == 0.0 and out[0, 1].item() == 0.0
    assert not torch.signbit(out[0, 1])
    assert torch.isinf(out[1]).all()  # 6 * 448 / 1e-36 overflows bf16 exactly as the reference does
    assert _same(out, dequantize_nvfp4(packed, scale, torch.tensor([1e-36]), torch.bfloat16))


def test_numba_dequantize_nan_scale_gives_nan():
    """E4M3 0x7F is NaN: the decoded block is NaN in both implementations (bits may differ between
    torch's scalar and vectorised casts, so only NaN-ness and the finite elements are compared)."""
    from qerl.kernels import nvfp4_numba

    if not nvfp4_numba.available():
        pytest.skip("numba not installed")
    packed = torch.arange(32, dtype=torch.uint8).reshape(2, 16)
    scale = torch.tensor([[0x7F, 0x38], [0xFF, 0x40]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    for dtype in (torch.bfloat16, torch.float32):
        ours, ref = (
            nvfp4_dispatch.dequantize(packed, scale, 2.0, dtype),
            dequantize_nvfp4(packed, scale, 2.0, dtype),
        )
        assert torch.equal(ours.isnan(), ref.isnan()) and ours[:, :16].isnan().all()
        assert _same(ours[:, 16:].contiguous(), ref[:, 16:].contiguous())


def test_dequantize_backend_is_logged(caplog):
    import logging

    nvfp4_dispatch._logged_backends.clear()
    packed, scale, gs = quantize_nvfp4(torch.randn(4, 32))
    with caplog.at_level(logging.INFO, logger="qerl.kernels.nvfp4"):
        nvfp4_dispatch.dequantize(packed, scale, gs)
    assert f"dequantize: {nvfp4_dispatch.dequantize_backend('cpu')} backend" in caplog.text


def test_dequantize_rejects_bad_out_buffer():
    packed, scale, gs = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(NVFP4Error, match="out must be"):
        nvfp4_dispatch.dequantize(packed, scale, gs, torch.bfloat16, out=torch.empty(4, 32))


_THREADS_CHILD = """
import logging, sys, threading
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
import numba, torch
from qerl.kernels import nvfp4_numba, nvfp4_reference
w = torch.randn(256, 512) * 3
packed, scale, gs = nvfp4_reference.quantize_nvfp4(w)
want = nvfp4_reference.dequantize_nvfp4(packed, scale, gs, dtype=torch.bfloat16)
bad = []
def decode():
    out = torch.empty(256, 512, dtype=torch.bfloat16)
    for _ in range(40):
        nvfp4_numba.dequantize_into(packed, scale, float(gs), out)
        if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
            bad.append(1)
threads = [threading.Thread(target=decode) for _ in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
print("layer", numba.threading_layer(), "bad", len(bad))
"""


@pytest.mark.parametrize("user_layer", [None, "omp"])
def test_numba_decodes_park_their_threads_unless_the_user_chose_a_layer(user_layer):
    """Numba's OpenMP layer spins beside torch's (qerl.kernels.nvfp4_numba docstring: a several times slower
    NVFP4 train step); the module picks ``workqueue``, which aborts the process when two threads launch at
    once, so launches are serialised: three threads decoding together get the reference's bits. A
    user's NUMBA_THREADING_LAYER is kept, with a warning. A fresh process: the layer is fixed at a
    process's first parallel launch."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from qerl.kernels import nvfp4_numba

    if not nvfp4_numba.available():
        pytest.skip("numba not installed")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    if user_layer:
        env["NUMBA_THREADING_LAYER"] = user_layer
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _THREADS_CHILD], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    layer = user_layer or "workqueue"
    assert f"layer {layer} bad 0" in proc.stdout, proc.stdout[-2000:]
    assert f"numba threading layer: {layer}" in proc.stdout
    assert ("WARNING" in proc.stdout) == (layer != "workqueue"), proc.stdout[-2000:]
