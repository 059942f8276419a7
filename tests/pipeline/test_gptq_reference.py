"""GPTQ (``qerl.pipeline.nvfp4.gptq``) against a plain, independently written reference: act-order,
dead inputs and the ``hessian`` (and ``mse``) block-scale rules, where the older tests
(``test_quantize_methods``) cover only absmax scales without act-order.

The reference below is textbook GPTQ written out column by column in float32, with its own FP4 and
FP8 rounding and its own brute-force block-scale choice; it shares with the implementation only the
design its docstring states:

* the inverse-Hessian factor ``U = chol((H + damp * mean(diag H) I)^-1)^T`` (upper), float64 steps
  cast to float32 (the standard GPTQ steps; ``test_quantize_methods`` checks ``U^T U`` separately),
  with ``diag(H) == 0`` set to 1 before damping;
* a block's FP8 scales are fixed when the block's first column is reached, from the current,
  error-updated weights of its 16 columns; under act-order the columns run by decreasing
  ``diag(H)`` (stable), and every block's scales are fixed up front from the original weights on the
  original 16-column groups (static groups), each column then quantized with its own group's scales;
* dead inputs (``diag(H) == 0``) keep their weights and are quantized to nearest with their block's
  scale (the reference GPTQ would zero them);
* the ``hessian`` rule picks, per block, the candidate scale (absmax, 4-over-6, and ``sweep``
  E4M3 neighbours of each) with the least ``sum_j (x_j - q_j)^2 / U_jj^2`` (``mse``: unweighted),
  the first one on a tie; ``U_jj`` is the factor of the (permuted, under act-order) Hessian.

Why the comparisons are exact: with ``block >= in`` the implementation's lazy batch is the whole
matrix, so its updates are the same float32 elementwise operations as the column-by-column ones
(no float32 matmul, whose summation order could differ); FP4/FP8 rounding and ``q = code * (s / gs)``
use the same float32 operands. The one place float64 (reference) and float32 (implementation) could
disagree is a near-tie between two candidate scales; the reference records the smallest relative gap
between the chosen scale's error and any other scale's, and each test asserts that gap is large
against float32 rounding (1e-4), so an exact match is the right expectation for these seeds.
With lazy batches smaller than the matrix (``block=16``), the matmul's float32 order may flip a
value at a rounding boundary, and then the rest of that row's trajectory; that test allows it.
"""

from __future__ import annotations

import pytest
import torch
from qerl.kernels.nvfp4_reference import global_scale, quantize_nvfp4, unpack_codes
from qerl.pipeline.nvfp4.gptq import gptq_nvfp4
from qerl.pipeline.nvfp4.scale_search import decode

G = 16  # NVFP4 block (group) size
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
# every finite positive FP8 E4M3 value, ascending (bit patterns 0x01..0x7E)
E4M3 = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
SWEEP = 2
DAMP = 0.01


# --- the reference ---------------------------------------------------------------------------


def _fp8(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value (torch's cast, ties to even), saturating at 448; float32."""
    return v.float().clamp(max=448.0).to(torch.float8_e4m3fn).float()


def _fp4(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of float32 ``y`` (clamped to +-6), ties to the even code; float32, signed."""
    a = y.double().abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - FP4).abs()  # exact: a has 24 significant bits, the grid 3
    lo = d.argmin(dim=-1)  # the first (lower) of two equally near values
    nxt = (lo + 1).clamp(max=7)
    tie = (d.gather(-1, nxt.unsqueeze(-1)) == d.gather(-1, lo.unsqueeze(-1))).squeeze(-1) & (nxt != lo)
    idx = torch.where(tie & (lo % 2 == 1), nxt, lo)
    return torch.copysign(FP4[idx].float(), y)


def _quant(x: torch.Tensor, s: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """``round_fp4(x / (s / gs)) * (s / gs)``, float32, elementwise (``s`` broadcast over ``x``)."""
    m = s / gs
    return _fp4(x / m) * m


def _candidates(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Candidate scales ``[rows, C]`` of blocks ``x [rows, 16]``: absmax first, then 4-over-6, then
    for k = 1..SWEEP the E4M3 values k steps below and above each (clamped to the E4M3 range)."""
    amax = x.abs().amax(dim=1)
    absmax = _fp8(gs * (amax / 6.0))
    absmax = torch.where(absmax == 0, torch.full_like(absmax, 0.125), absmax)
    four = _fp8(gs * (amax / 4.0)).clamp(min=float(E4M3[0]))
    out = [absmax, four]
    for k in range(1, SWEEP + 1):
        for base in (absmax, four):
            i = torch.searchsorted(E4M3, base)
            assert torch.equal(E4M3[i], base)
            out += [E4M3[(i - k).clamp(min=0)], E4M3[(i + k).clamp(max=len(E4M3) - 1)]]
    return torch.stack(out, dim=1)


class _Rule:
    """A block-scale rule; ``margin`` is the smallest relative error gap seen between the chosen scale
    and any other candidate scale (inf for absmax, which does not search)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.margin = float("inf")

    def __call__(self, x: torch.Tensor, gs: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
        """Scales ``[rows]`` for the blocks ``x [rows, 16]`` whose columns cost ``cost [16]``."""
        cands = _candidates(x, gs)
        if self.name == "absmax":
            return cands[:, 0]
        weight = cost.double() if self.name == "hessian" else torch.ones(G, dtype=torch.float64)
        chosen = torch.empty(x.shape[0])
        for r in range(x.shape[0]):  # brute force, one row and one candidate at a time
            errs = [
                float((weight * (x[r].double() - _quant(x[r], c, gs).double()) ** 2).sum()) for c in cands[r]
            ]
            best = min(range(len(errs)), key=lambda k: (errs[k], k))  # the first of equal errors
            chosen[r] = cands[r, best]
            # other scales' errors; an exact tie at zero error (an all-zero block) is exact in float32 too
            others = [
                e
                for e, c in zip(errs, cands[r], strict=True)
                if c != cands[r, best] and not e == errs[best] == 0
            ]
            if others:
                self.margin = min(self.margin, (min(others) - errs[best]) / max(errs[best], 1e-30))
        return chosen


def _factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of the damped inverse Hessian (dead inputs' diagonal set to 1 first)."""
    h = h.double().clone()
    dead = torch.nonzero(torch.diagonal(h) == 0).flatten()
    h[dead, dead] = 1.0
    h = h + damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def _reference(
    w: torch.Tensor,
    h: torch.Tensor,
    gs: torch.Tensor,
    rule: _Rule,
    col_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook GPTQ without act-order, one column at a time: (quantized weight, scales ``[out, in/16]``).

    Block scales by ``rule`` at each block start from the updated weights, or, when ``col_scales
    [out, in]`` is given, column j's scales are ``col_scales[:, j]`` (static groups)."""
    w = w.float().clone()
    u = _factor(h, DAMP)
    cost = 1.0 / torch.diagonal(u).double() ** 2
    q = torch.zeros_like(w)
    scales = torch.zeros(w.shape[0], w.shape[1] // G)
    for j in range(w.shape[1]):
        if col_scales is None and j % G == 0:
            scales[:, j // G] = rule(w[:, j : j + G], gs, cost[j : j + G])
        s = scales[:, j // G] if col_scales is None else col_scales[:, j]
        q[:, j] = _quant(w[:, j], s, gs)
        e = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j:] -= e.unsqueeze(1) * u[j, j:].unsqueeze(0)
    return q, scales


def _reference_act_order(
    w: torch.Tensor, h: torch.Tensor, gs: torch.Tensor, rule: _Rule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Act-order as the no-act-order reference on the permuted problem ``(W[:, p], H[p][:, p])``, ``p``
    the columns by decreasing ``diag(H)`` (stable), un-permuted afterwards. The scales are fixed up
    front on the original 16-column groups of the original weights, a column's cost being its
    ``1 / U_jj^2`` at its permuted position; each column is quantized with its own group's scales."""
    diag = torch.diagonal(h).tolist()
    p = sorted(range(len(diag)), key=lambda i: -diag[i])  # Python's sort is stable
    hp = h[p][:, p]
    cost_p = 1.0 / torch.diagonal(_factor(hp, DAMP)).double() ** 2
    cost = torch.empty_like(cost_p)
    cost[p] = cost_p  # back to the original column order
    n_blocks = w.shape[1] // G
    scales = torch.stack(
        [rule(w[:, g * G : (g + 1) * G], gs, cost[g * G : (g + 1) * G]) for g in range(n_blocks)], 1
    )
    col_scales = scales[:, [i // G for i in p]]  # permuted column j belongs to original group p[j] // G
    qp, _ = _reference(w[:, p], hp, gs, rule, col_scales)
    q = torch.empty_like(qp)
    q[:, p] = qp
    return q, scales


# --- problems -------------------------------------------------------------------------------


def _problem(
    seed: int, out_f: int = 32, in_f: int = 64, n: int = 256, dead: tuple[int, ...] = (), x_scale: float = 1.0
):
    """Weights with per-row spread and one all-zero block (row 0, columns 0..15: every candidate scale
    ties at zero error there, and absmax's 0.125 must win), correlated inputs whose columns have very
    different scales (so act-order permutes and the Hessian weighting differs from the unweighted
    one), ``dead`` inputs always zero; returns (w, x, H = 2 X^T X / n, gs)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.exp(torch.randn(out_f, 1, generator=g))
    w[0, :G] = 0.0
    mix = torch.randn(in_f, in_f, generator=g) * 0.3 + torch.eye(in_f)
    x = torch.randn(n, in_f, generator=g) @ mix * torch.exp(1.5 * torch.randn(in_f, generator=g)) * x_scale
    x[:, list(dead)] = 0.0
    h = 2 * x.T @ x / n
    return w, x, h, global_scale(w.abs().max())


def _gptq(w, h, gs, rule: str, act_order: bool, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = gptq_nvfp4(w, h, gs, damp=DAMP, act_order=act_order, scale_rule=rule, block=block)
    return decode(codes.reshape(w.shape[0], -1, G), scales, gs).reshape(w.shape), scales


def _assert_exact(got, ref, rule: _Rule) -> None:
    assert rule.margin > 1e-4, f"near-tie between candidate scales ({rule.margin:.2e}): pick another seed"
    (q, s), (q_ref, s_ref) = got, ref
    assert torch.equal(s, s_ref), (s != s_ref).nonzero()[:5]
    assert torch.equal(q, q_ref), (q != q_ref).nonzero()[:5]


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["absmax", "mse", "hessian"])
def test_act_order_equals_the_reference_on_the_permuted_problem(rule):
    """Act-order on (W, H) == the column-by-column reference on (W[:, p], H[p][:, p]), un-permuted,
    with static groups (scales from the original weights on the original groups), bit for bit. Three
    pairs of inputs get equal ``diag(H)`` (raised to the larger: H stays positive definite), so the
    order of ties counts: the stable one, each pair in its original order."""
    w, _, h, gs = _problem(seed=11)
    for a, b in ((2, 37), (9, 60), (20, 21)):
        h[a, a] = h[b, b] = torch.maximum(h[a, a], h[b, b])
    p = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    assert (p.reshape(-1, G).sort(dim=1).values // G != torch.arange(4).unsqueeze(1)).any()  # mixes groups
    ref_rule = _Rule(rule)
    ref = _reference_act_order(w, h, gs, ref_rule)
    got = _gptq(w, h, gs, rule, act_order=True)
    _assert_exact(got, ref, ref_rule)
    # act-order is not a no-op here: processing in the original order gives other values
    assert not torch.equal(got[0], _gptq(w, h, gs, rule, act_order=False)[0])
    if rule == "absmax":  # and static groups matter: scales chosen on the permuted groups differ
        pl = p.tolist()
        q_dyn, _ = _reference(w[:, pl], h[pl][:, pl], gs, _Rule("absmax"))
        assert not torch.equal(got[0][:, pl], q_dyn)


@pytest.mark.parametrize("rule", ["mse", "hessian"])
def test_no_act_order_scale_search_equals_the_brute_force_reference(rule):
    """Without act-order, ``hessian`` (and ``mse``) block scales, chosen at each block start from the
    updated weights by brute force over the candidates, and the whole GPTQ result: bit for bit."""
    w, _, h, gs = _problem(seed=5)
    ref_rule = _Rule(rule)
    ref = _reference(w, h, gs, ref_rule)
    got = _gptq(w, h, gs, rule, act_order=False)
    _assert_exact(got, ref, ref_rule)
    if rule == "hessian":  # the weighting matters on this problem: unweighted search picks other scales
        assert not torch.equal(got[1], _reference(w, h, gs, _Rule("mse"))[1])
        # and the chosen scales are not merely absmax
        assert not torch.equal(got[1], _reference(w, h, gs, _Rule("absmax"))[1])


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rule", ["absmax", "hessian"])
def test_dead_inputs_keep_their_weights_and_are_rounded_to_nearest(rule, act_order):
    """Inputs that are always zero (a whole block, 16..31, and columns 3, 40, 41): the result equals
    the reference with ``H_dd = 1`` and W unchanged, bit for bit; a dead column's values are its
    original weights rounded to nearest with its block's scale (no error from other columns reaches
    it), a wholly dead block is exactly RTN under absmax, and dead columns are not zeroed."""
    dead = (3, 40, 41, *range(16, 32))
    # small activations (mean diag(H) about 0.9): the dead inputs' unit diagonal then weighs in the
    # damping and in the hessian rule's column costs, so handling them differently shows
    w, _, h, gs = _problem(seed=7, dead=dead, x_scale=0.1)
    assert torch.equal(h[list(dead)], torch.zeros(len(dead), h.shape[1]))  # rows and columns exactly 0
    ref_rule = _Rule(rule)
    ref = (_reference_act_order if act_order else _reference)(w, h, gs, ref_rule)
    q, s = _gptq(w, h, gs, rule, act_order=act_order)
    _assert_exact((q, s), ref, ref_rule)
    for d in dead:
        assert torch.equal(q[:, d], _quant(w[:, d], s[:, d // G], gs)), d
    assert (q[:, list(dead)] != 0).float().mean() > 0.5  # kept, not zeroed
    if rule == "absmax":
        p_rtn, s_rtn, g_rtn = quantize_nvfp4(w)
        assert torch.equal(g_rtn, gs)
        assert torch.equal(s[:, 1], s_rtn[:, 1].float())
        rtn = decode(unpack_codes(p_rtn).reshape(w.shape[0], -1, G), s_rtn.float(), gs).reshape(w.shape)
        assert torch.equal(q[:, 16:32], rtn[:, 16:32])
    # the live columns are GPTQ's: not plain RTN of the original weights
    live = [j for j in range(w.shape[1]) if j not in dead]
    assert not torch.equal(q[:, live], torch.stack([_quant(w[:, j], s[:, j // G], gs) for j in live], 1))


@pytest.mark.parametrize("act_order", [False, True])
def test_lazy_batches_stay_close_to_the_column_by_column_reference(act_order):
    """``block=16`` (four lazy batches): the cross-batch update is a float32 matmul whose summation
    order differs from the column-by-column reference, so a value at a rounding boundary may flip and
    change the rest of its row; nearly all values and the output error must still agree. (On this
    seed with the CPU's BLAS they agree exactly; the slack is for other summation orders.)"""
    w, x, h, gs = _problem(seed=3)
    ref_rule = _Rule("hessian")
    q_ref, s_ref = (_reference_act_order if act_order else _reference)(w, h, gs, ref_rule)
    q, s = _gptq(w, h, gs, "hessian", act_order=act_order, block=16)
    assert (q == q_ref).float().mean() > 0.97
    assert (s == s_ref).float().mean() > 0.95

    def err(qq):
        return float(((x @ (w - qq).T) ** 2).mean())

    assert abs(err(q) - err(q_ref)) < 0.03 * err(q_ref)
