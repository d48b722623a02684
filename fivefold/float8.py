"""FP8 training numerics: dynamically scaled FP8 GEMMs for a linear layer, the way torchao's float8
training does them (torchao 0.18's `Float8Linear` under `Float8LinearConfig.from_recipe_name`), on
`torch._scaled_mm` directly, so that fivefold's own tensor-parallel layers, flat ZeRO buffers and
zero-bubble pipeline can use them without a module swap or a tensor subclass.

What this module owns:

* **The recipes, as data.** A `Float8Recipe` says, for each operand of each of a linear's three
  GEMMs (output = x Wᵀ, grad_input = dy W, grad_weight = dyᵀ x), how it is cast (`Cast`: the FP8
  dtype or none, one scale for the tensor or one per slice), whether scales are rounded down to
  powers of 2, and which GEMMs use fast accumulation. `RECIPES` holds torchao's "tensorwise",
  "rowwise" and "rowwise_with_gw_hp", numerically equal to torchao's.
* **The cast.** `to_float8`: amax -> scale (fp64 division, clamped, optionally a power of 2) ->
  saturated cast; ``data ≈ hp * scale`` (torchao's convention).
* **The three GEMMs.** `float8_linear` (an autograd function: y = x Wᵀ + b forward, grad_input and
  grad_weight backward) and `float8_weight_grad` (the grad_weight GEMM alone).
* **The deferred W.** Under `fivefold.ops.recording_weight_grads` (a zero-bubble pipeline's I pass)
  backward computes grad_input only and queues the FP8 grad_weight GEMM in the store, as
  `fivefold.ops.linear` queues its plain one.
* **The scope hook.** `AmaxReduce`: every amax passes through it before it becomes a scale, in a
  fixed order, so that a layer split over tensor-parallel ranks can take the max over the ranks
  where a cast's amax runs along the split dimension (`split_scope` builds that hook), and every
  rank's FP8 operands are then slices of what one process would cast.

Everything stays on the device: no host sync (no `.item()`, no data-dependent shape) anywhere, so a
step using it can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from fivefold import ops

__all__ = [
    "E4M3",
    "E5M2",
    "GATHERED",
    "RECIPES",
    "AmaxReduce",
    "Cast",
    "Float8",
    "Float8Matmul",
    "Float8Recipe",
    "compose_scopes",
    "float8_linear",
    "float8_weight_grad",
    "gathered_float8",
    "quantize",
    "scale_from_amax",
    "split_scope",
    "to_float8",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# An all-zero tensor (amax 0) gets scale fmax / EPS instead of inf, so it casts to zeros, not NaN
# (torchao's value: equal scales need equal clamps).
EPS = 1e-12


@dataclass(frozen=True)
class Cast:
    """How one operand is cast for one GEMM. dtype None: it stays in high precision (no cast).
    axis None: one scale for the whole tensor (tensorwise); else the dimension of the operand's 2-D
    view the amax is taken along (rowwise / axiswise: one scale per slice, kept with keepdim)."""

    dtype: torch.dtype | None
    axis: int | None


# The dimension each cast contracts in its GEMM, in the operand's 2-D view (input [T, in], weight
# [out, in], grad_output [T, out]): a per-slice scale must run along it, or it could not be taken
# out of the GEMM's sums (one scale per row of A, one per column of B is all _scaled_mm applies).
_CONTRACTED = {
    "input": 1,  # output = x Wᵀ sums over in
    "weight": 1,
    "grad_output": 1,  # grad_input = dy W sums over out
    "weight_for_grad_input": 0,
    "input_for_grad_weight": 0,  # grad_weight = dyᵀ x sums over the tokens T
    "grad_output_for_grad_weight": 0,
}

# the GEMMs and their two operands' casts (A, B); both in FP8 or both in high precision
_GEMMS = {
    "output": ("input", "weight"),
    "grad_input": ("grad_output", "weight_for_grad_input"),
    "grad_weight": ("grad_output_for_grad_weight", "input_for_grad_weight"),
}


@dataclass(frozen=True)
class Float8Recipe:
    """The casts of a linear's three GEMMs. ``input``, ``weight``, ``grad_output``: the output GEMM
    (input, weight) and the grad_input GEMM (grad_output); the ``*_for_*`` casts: the same operand
    in its other GEMM. ``power_of_2_scales``: every scale rounded down to a power of 2 (then the
    scaling itself is exact). ``fast_accum_*``: _scaled_mm's ``use_fast_accum`` per GEMM (on CUDA
    a lower-precision accumulation; on the CPU it changes nothing), and torchao's rule that goes
    with it: a per-slice GEMM without fast accumulation runs unscaled and applies its scales to the
    output afterwards (CUTLASS's rowwise kernel is slow without it)."""

    name: str
    input: Cast
    weight: Cast
    grad_output: Cast
    input_for_grad_weight: Cast
    weight_for_grad_input: Cast
    grad_output_for_grad_weight: Cast
    power_of_2_scales: bool
    fast_accum_output: bool = True
    fast_accum_grad_input: bool = False
    fast_accum_grad_weight: bool = False

    def __post_init__(self) -> None:
        for field, axis in _CONTRACTED.items():
            cast: Cast = getattr(self, field)
            if cast.dtype not in (None, E4M3, E5M2):
                raise ValueError(f"{self.name}: {field} casts to {cast.dtype}, not an FP8 dtype")
            if cast.axis not in (None, axis) or (cast.dtype is None and cast.axis is not None):
                raise ValueError(
                    f"{self.name}: {field}'s scales must run along dim {axis} of its 2-D view "
                    f"(the dim its GEMM contracts) or be tensorwise (None), not {cast.axis}"
                )
        for gemm, (a, b) in _GEMMS.items():
            if (getattr(self, a).dtype is None) != (getattr(self, b).dtype is None):
                raise ValueError(f"{self.name}: the {gemm} GEMM mixes FP8 and high precision")


_TENSORWISE_E4M3 = Cast(E4M3, None)
_TENSORWISE_E5M2 = Cast(E5M2, None)
_HIGH_PRECISION = Cast(None, None)

RECIPES: dict[str, Float8Recipe] = {
    # one scale per tensor; gradients in e5m2 (range over precision)
    "tensorwise": Float8Recipe(
        name="tensorwise",
        input=_TENSORWISE_E4M3,
        weight=_TENSORWISE_E4M3,
        grad_output=_TENSORWISE_E5M2,
        input_for_grad_weight=_TENSORWISE_E4M3,
        weight_for_grad_input=_TENSORWISE_E4M3,
        grad_output_for_grad_weight=_TENSORWISE_E5M2,
        power_of_2_scales=False,
    ),
    # one scale per row of A and per column of B, all e4m3, scales powers of 2: each operand is cast
    # twice, along the dim each of its GEMMs contracts
    "rowwise": Float8Recipe(
        name="rowwise",
        input=Cast(E4M3, 1),
        weight=Cast(E4M3, 1),
        grad_output=Cast(E4M3, 1),
        input_for_grad_weight=Cast(E4M3, 0),
        weight_for_grad_input=Cast(E4M3, 0),
        grad_output_for_grad_weight=Cast(E4M3, 0),
        power_of_2_scales=True,
    ),
    # rowwise forward, grad_input against a tensorwise weight, grad_weight in high precision
    "rowwise_with_gw_hp": Float8Recipe(
        name="rowwise_with_gw_hp",
        input=Cast(E4M3, 1),
        weight=Cast(E4M3, 1),
        grad_output=Cast(E4M3, 1),
        input_for_grad_weight=_HIGH_PRECISION,
        weight_for_grad_input=_TENSORWISE_E4M3,
        grad_output_for_grad_weight=_HIGH_PRECISION,
        power_of_2_scales=True,
    ),
}


class Float8(NamedTuple):
    """A tensor cast to FP8: ``data ≈ hp * scale`` (torchao's convention). ``scale``: fp32, 0-dim
    (tensorwise) or with the data's dims, 1 along the reduced one (axiswise)."""

    data: torch.Tensor
    scale: torch.Tensor

    def t(self) -> Float8:
        """The transpose of a 2-D cast (its scales transposed with it)."""
        return Float8(self.data.t(), self.scale.t() if self.scale.dim() == 2 else self.scale)


# The layer's distributed scope: ``reduce(operand, amax, axis)`` is called for every amax before it
# becomes a scale (operand "input" | "weight" | "grad_output"; axis: the dim of the operand's 2-D
# view the amax was reduced along, None = all) and returns the amax to use, e.g. the max over the
# tensor-parallel ranks that each hold a slice. It may run a collective: it is called in the same
# order on every rank.
AmaxReduce = Callable[[str, torch.Tensor, int | None], torch.Tensor]


def split_scope(
    split_dims: Mapping[str, int], max_over_ranks: Callable[[torch.Tensor], torch.Tensor]
) -> AmaxReduce:
    """The `AmaxReduce` of a layer whose operands are split over ranks: ``split_dims[operand]`` is
    the dim of the operand's 2-D view that is split (column-parallel: ``{"weight": 0,
    "grad_output": 1}``; row-parallel: ``{"input": 1, "weight": 1}``; an operand not named is whole
    on every rank). An amax taken over the split dim (tensorwise, or per slice along it) is the
    max over the ranks (``max_over_ranks``: e.g. an all-reduce MAX over the tensor-parallel group);
    one taken along the other dim covers whole slices already and stays local."""

    def reduce(operand: str, amax: torch.Tensor, axis: int | None) -> torch.Tensor:
        split = split_dims.get(operand)
        if split is None or (axis is not None and axis != split):
            return amax
        return max_over_ranks(amax)

    return reduce


def _amax(t: torch.Tensor, axis: int | None) -> torch.Tensor:
    return t.abs().amax() if axis is None else t.abs().amax(dim=axis, keepdim=True)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """The scale an amax gives (``data ≈ hp * scale``): the format's max over it, in fp64 then
    fp32; optionally rounded down to a power of 2."""
    # The division in fp64, then fp32: eager and compiled code round 1/fp32 differently, fp64 not.
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    if power_of_2:
        # rounded down, so amax * scale still fits; a power of 2 scales without rounding
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` in `dtype`, saturated (see below)."""
    # in fp32 (compiled code upcasts a bf16 * fp32 product anyway); saturated, so a value pushed
    # past the format's max (a scale rounded up in fp32, a pre-cast weight's stale scale) becomes
    # ±max, not NaN (e4m3fn has no inf), whatever the torch version's cast does
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def to_float8(
    t: torch.Tensor,
    cast: Cast,
    *,
    power_of_2: bool = False,
    reduce: AmaxReduce | None = None,
    operand: str = "",
) -> Float8:
    """``t`` cast as ``cast`` says, its scale from its amax (through ``reduce(operand, amax,
    cast.axis)`` when given). For an axiswise cast, ``t`` is the operand's 2-D view."""
    if cast.dtype is None:
        raise ValueError("to_float8 of a high-precision Cast (dtype None): nothing to cast to")
    if cast.axis is not None and t.dim() != 2:
        raise ValueError(
            f"an axiswise cast takes the operand's 2-D view, not shape {tuple(t.shape)}"
        )
    with torch.no_grad():
        amax = _amax(t, cast.axis)
        if reduce is not None:
            amax = reduce(operand, amax, cast.axis)
        scale = scale_from_amax(amax, cast.dtype, power_of_2)
        return Float8(quantize(t, scale, cast.dtype), scale)


Operand = Float8 | torch.Tensor  # a GEMM operand: cast, or left in high precision


def _cast(
    t: torch.Tensor,
    cast: Cast,
    recipe: Float8Recipe,
    reduce: AmaxReduce | None,
    operand: str,
    scale: torch.Tensor | None = None,
) -> Operand:
    """``t`` as the recipe's GEMM takes it; ``scale``: one this layer already computed for the same
    operand cast the same way (no amax again, no second call to ``reduce``)."""
    if cast.dtype is None:
        return t
    if scale is not None:
        with torch.no_grad():
            return Float8(quantize(t, scale, cast.dtype), scale)
    return to_float8(t, cast, power_of_2=recipe.power_of_2_scales, reduce=reduce, operand=operand)


def _mm(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a @ b for a [M, K], b [K, N]: both in high precision (a plain matmul), or both cast, each
    scale 0-dim or per slice along K (a: [M, 1], b: [1, N]); the result in ``out_dtype``."""
    if not isinstance(a, Float8):
        return torch.mm(a, b)
    assert isinstance(b, Float8)
    # _scaled_mm (CUDA) takes A row-major and B column-major
    a_data = a.data if a.data.is_contiguous() else a.data.contiguous()
    b_data = b.data if b.data.t().is_contiguous() else b.data.t().contiguous().t()
    m, n = a_data.shape[0], b_data.shape[1]
    scale_a, scale_b = a.scale, b.scale
    # _scaled_mm scales both operands the same way: a tensorwise scale facing a per-slice one is
    # repeated into a vector
    if scale_a.dim() == 0 and scale_b.dim() != 0:
        scale_a = scale_a.repeat(m)
    elif scale_b.dim() == 0 and scale_a.dim() != 0:
        scale_b = scale_b.repeat(n)
    rowwise = scale_a.dim() != 0
    # _scaled_mm multiplies by its scales to dequantize: the reciprocals of ours. Per slice they
    # go in as [M, 1] and [1, N] with unit inner strides (what _scaled_mm checks).
    inv_a, inv_b = scale_a.reciprocal(), scale_b.reciprocal()
    if rowwise:
        inv_a, inv_b = inv_a.flatten().unsqueeze(1), inv_b.flatten().unsqueeze(0)
    after = None
    if rowwise and not fast_accum:
        # torchao's choice (CUTLASS's rowwise kernel is slow without fast accumulation): an
        # unscaled GEMM rounded to its out dtype, then scaled in fp32 and rounded again (exact
        # with power-of-2 scales, as the rowwise recipes have)
        after = inv_a * inv_b
        inv_a = inv_b = inv_a.new_ones(())
    # the rowwise kernels (CUDA) write bf16 only: fp32/fp16 results are bf16 widened (torchao's
    # workaround, kept everywhere for the same numbers on every device)
    gemm_dtype = torch.bfloat16 if rowwise and out_dtype != torch.bfloat16 else out_dtype
    out = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=inv_a,
        scale_b=inv_b,
        out_dtype=gemm_dtype,
        use_fast_accum=fast_accum,
    )
    if after is not None:
        out = out.mul_(after)
    return out.to(out_dtype)


def _weight_grad(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    recipe: Float8Recipe,
    reduce: AmaxReduce | None,
    x_scale: torch.Tensor | None = None,
    g_scale: torch.Tensor | None = None,
    g_cast: Operand | None = None,
) -> torch.Tensor:
    """grad_weight = dyᵀ x [out, in] in grad_out's dtype; ``x_scale``, ``g_scale``, ``g_cast``:
    the scales (or the cast dy) the layer has already, where its recipe casts the same way."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if g_cast is None:
        g_cast = _cast(
            g2, recipe.grad_output_for_grad_weight, recipe, reduce, "grad_output", g_scale
        )
    x_cast = _cast(x2, recipe.input_for_grad_weight, recipe, reduce, "input", x_scale)
    return _mm(g_cast.t(), x_cast, g2.dtype, recipe.fast_accum_grad_weight)


def float8_weight_grad(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    recipe: Float8Recipe,
    reduce: AmaxReduce | None = None,
) -> torch.Tensor:
    """The grad_weight GEMM alone: dyᵀ x [out, in] from x [..., in] and grad_out [..., out], both
    cast as ``recipe`` says for it (grad_output, then input, through ``reduce``)."""
    return _weight_grad(x, grad_out, recipe, reduce)


@dataclass(frozen=True, eq=False)
class _Layer:
    """What the autograd function needs besides tensors (a plain object: not an autograd input).
    ``store``, ``weight``, ``bias``: where a recorded (deferred) weight gradient goes."""

    recipe: Float8Recipe
    reduce: AmaxReduce | None
    store: ops.WeightGradStore | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def _same_cast(a: Cast, b: Cast) -> bool:
    return a == b and a.dtype is not None


class _Float8Linear(torch.autograd.Function):
    """y = x Wᵀ + b with the recipe's casts; backward: grad_input, and grad_weight unless deferred.

    A scale is computed once per operand and cast: where the recipe casts an operand the same way
    in both its GEMMs (tensorwise), backward reuses the forward's scale (the same value: the same
    tensor's amax) instead of reducing it again: fewer amax passes and fewer collectives."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        w_data: torch.Tensor | None,
        w_scale: torch.Tensor | None,
        layer: _Layer,
    ) -> torch.Tensor:
        r, reduce = layer.recipe, layer.reduce
        x2 = x.reshape(-1, x.shape[-1])
        x_cast = _cast(x2, r.input, r, reduce, "input")
        if w_data is not None:
            w_cast: Operand = Float8(w_data, w_scale)
        else:
            w_cast = _cast(weight, r.weight, r, reduce, "weight")
        y = _mm(x_cast, w_cast.t(), x.dtype, r.fast_accum_output)
        if bias is not None:
            y = y + bias.to(y.dtype)
        x_scale = x_cast.scale if _same_cast(r.input_for_grad_weight, r.input) else None
        wt_scale = None
        if w_data is None and _same_cast(r.weight_for_grad_input, r.weight):
            wt_scale = w_cast.scale
        ctx.save_for_backward(
            x, weight if w_data is None else None, w_data, w_scale, x_scale, wt_scale
        )
        ctx.layer = layer
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight, w_data, w_scale, x_scale, wt_scale = ctx.saved_tensors
        layer: _Layer = ctx.layer
        r, reduce = layer.recipe, layer.reduce
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_cast = _cast(g2, r.grad_output, r, reduce, "grad_output")
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if w_data is not None:
                w_cast: Operand = Float8(w_data, w_scale)
            else:
                w_cast = _cast(weight, r.weight_for_grad_input, r, reduce, "weight", wt_scale)
            grad_x = _mm(g_cast, w_cast, g2.dtype, r.fast_accum_grad_input).reshape(x.shape)
        same_g = _same_cast(r.grad_output_for_grad_weight, r.grad_output)
        if layer.store is not None:
            # I pass: W later, from the high-precision x and dy the store keeps; the scales known
            # now go with it (W casts again, but takes no amax and calls no hook for them)
            weight_grad = partial(
                _weight_grad,
                recipe=r,
                reduce=reduce,
                x_scale=x_scale,
                g_scale=g_cast.scale if same_g else None,
            )
            layer.store.queue(
                layer.weight, layer.bias, x.detach(), grad_out.detach(), weight_grad=weight_grad
            )
        elif ctx.needs_input_grad[1]:
            grad_w = _weight_grad(
                x, grad_out, r, reduce, x_scale=x_scale, g_cast=g_cast if same_g else None
            )
        if ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: Float8Recipe,
    reduce: AmaxReduce | None = None,
    weight_float8: Float8 | None = None,
) -> torch.Tensor:
    """y = x Wᵀ + b with ``recipe``'s three FP8 GEMMs (output; backward: grad_input, grad_weight).
    x [..., in] in high precision (bf16, fp32); y in x's dtype. ``reduce``: the layer's scope
    (`AmaxReduce`). ``weight_float8``: the weight cast already, tensorwise as the recipe's weight
    casts are (gathered in FP8 by ZeRO-3, say): the output and grad_input GEMMs use it, and
    ``weight``'s value is not read (it still receives the gradient). Under
    `fivefold.ops.recording_weight_grads` the weight gradient is queued in the store (its FP8 GEMM
    runs at `WeightGradStore.run`), as `fivefold.ops.linear` queues its plain one.

    ``reduce`` is called once per amax, in this order: forward: input, weight (not with
    ``weight_float8``); backward: grad_output, then the weight's grad_input cast (only where x
    needs a gradient); then, in backward or at W, grad_output and input for grad_weight. A cast the
    layer already made the same way reuses its scale and calls nothing (tensorwise: 3 calls in
    all). A `fivefold.ops.recompute` region calls it again for its recomputed forward."""
    w_data = w_scale = None
    if weight_float8 is not None:
        for field in ("weight", "weight_for_grad_input"):
            if getattr(recipe, field) != Cast(weight_float8.data.dtype, None):
                raise ValueError(
                    f"weight_float8 is a tensorwise {weight_float8.data.dtype} cast; recipe "
                    f"{recipe.name!r} casts the {field} as {getattr(recipe, field)}"
                )
        if weight_float8.scale.numel() != 1:
            raise ValueError("weight_float8 must be tensorwise: one scale")
        w_data, w_scale = weight_float8.data, weight_float8.scale.reshape(())
    layer = _Layer(recipe, reduce)
    # As ops.linear: a compiled block never records (dynamo cannot read the store's ContextVar),
    # and without a gradient path through x there is no I pass to split off.
    store = ops.weight_grad_store()
    if store is not None and torch.is_grad_enabled() and x.requires_grad:
        # the parameters travel outside autograd's inputs: no AccumulateGrad (no hook) until W
        layer = _Layer(recipe, reduce, store, weight, bias)
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
    return _Float8Linear.apply(x, weight, bias, w_data, w_scale, layer)


def compose_scopes(*scopes: AmaxReduce | None) -> AmaxReduce | None:
    """One `AmaxReduce` applying each of `scopes` in turn (a layer split over tensor-parallel ranks
    whose tokens are also split over context-parallel ranks: the max over the one, then the other);
    None when there is none."""
    present = [s for s in scopes if s is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def reduce(operand: str, amax: torch.Tensor, axis: int | None) -> torch.Tensor:
        for scope in present:
            amax = scope(operand, amax, axis)
        return amax

    return reduce


# Where ZeRO-3's FP8 gather leaves a weight it gathered cast (`Float8`): an attribute of the
# parameter, set after the gather and removed when the unit is freed (data_parallel/flat_param.py)
GATHERED = "fivefold_float8"


def gathered_float8(weight: torch.Tensor) -> Float8 | None:
    """The FP8 cast of `weight` its ZeRO-3 gather brought (None: it is gathered, or held, in its
    own dtype)."""
    return getattr(weight, GATHERED, None)


@dataclass(frozen=True, eq=False)
class Float8Matmul:
    """A linear layer's matmul in FP8 (the layers call ``self.matmul(x, weight, bias)``;
    `fivefold.ops.linear` by default): ``recipe`` and the layer's scope ``reduce`` (`AmaxReduce`:
    the max over the ranks its operands are split over). A weight ZeRO-3 gathered in FP8
    (`gathered_float8`) is used as it came."""

    recipe: Float8Recipe
    reduce: AmaxReduce | None = None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return float8_linear(
            x,
            weight,
            bias,
            recipe=self.recipe,
            reduce=self.reduce,
            weight_float8=gathered_float8(weight),
        )
