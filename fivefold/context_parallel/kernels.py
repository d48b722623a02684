"""Ring attention's block kernels (docs/design.md#context-parallelism, "Block kernels"): one block
of queries against one chunk of keys and values, with its log-sum-exp, forward and backward — what
`ring_attention` merges by the online-softmax rule. This module owns the kernels, which one a call
gets (`choose_kernel`: by device type, dtype and head dimension, or by the config's
``parallel.cp_kernel``) and the table of fused kernels per device type (`FUSED`).

The contract, every kernel alike: q [B, H, Lq, d] against k, v [B, H_kv, Lk, d] (a diagonal block
is square and causal); ``forward`` -> (out [B, H, Lq, d], lse [B, H, Lq]), both fp32 for the merge;
``backward(dO, q, k, v, O, lse)`` with the ring's *final* O and lse (FlashAttention's blockwise
rule: P = exp(S - lse), D = rowsum(dO ∘ O), dS = P ∘ (dO Vᵀ - D)) -> this block's dq [B, H, Lq, d],
dk, dv [B, H_kv, Lk, d], fp32.

- `MathBlocks`: plain fp32 matmuls, the query heads of one kv head grouped so k and v broadcast
  (GQA without copies). The reference, and the fallback on any device: an fp32 score matrix per
  block (memory quadratic in the chunk) and about 30 passes over it.
- `FusedBlocks`: torch's fused SDPA ops, which return the log-sum-exp and take it back in their
  backward; inputs stay in their dtype (bf16 / fp16 in), the results are widened to fp32 for the
  merge. The op pair is a strategy (`SdpaOps`): `CpuFlashOps` (CPU flash attention),
  `CudaFlashOps` (FlashAttention-2: fp16 / bf16, head dim a multiple of 8 up to 256) and
  `CudaEfficientOps` (memory-efficient attention where flash cannot run: fp32, other head dims).
  An op without GQA of its own (CPU flash, efficient) gets each block's kv heads expanded for the
  call, and dk / dv summed back per kv head; CUDA flash takes the kv heads as they are and sums
  their gradients itself.
- `MaskedMathBlocks` (`MASKED`): `MathBlocks` with a boolean mask [B, Lq, Lk] (True: the query may
  read the key) instead of the causal flag, for the blocks packed documents cut
  (`fivefold.models.documents`). A query that may read no key of the block gets lse = -inf and
  out = 0: it contributes nothing to the merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = [
    "CHOICES",
    "FUSED",
    "KERNELS",
    "MASKED",
    "BlockKernel",
    "CpuFlashOps",
    "CudaEfficientOps",
    "CudaFlashOps",
    "FusedBlocks",
    "MaskedMathBlocks",
    "MathBlocks",
    "SdpaOps",
    "choose_kernel",
]

Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BlockKernel(Protocol):
    def supports(self, dtype: torch.dtype, head_dim: int) -> bool: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, diag: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        diag: bool,
        scale: float,
    ) -> Tensors3: ...


class MathBlocks:
    """Portable: plain matmuls in fp32, the query heads of one kv head grouped so k and v
    broadcast."""

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return True

    @staticmethod
    def _scores(
        q: torch.Tensor,
        k: torch.Tensor,
        diag: bool,
        scale: float,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, hq, lq, d = q.shape
        hkv = k.shape[1]
        s = torch.matmul(
            q.float().reshape(b, hkv, hq // hkv, lq, d), k.float().unsqueeze(2).transpose(-1, -2)
        )
        s.mul_(scale)
        if diag:
            hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        if hidden is not None:  # [Lq, Lk] or [B, 1, 1, Lq, Lk]: True where a key is not read
            s.masked_fill_(hidden, float("-inf"))
        return s  # [B, H_kv, G, Lq, Lk]

    def forward(self, q, k, v, diag: bool, scale: float):
        s = self._scores(q, k, diag, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v.float().unsqueeze(2))
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])

    def backward(self, dout, q, k, v, out, lse, diag: bool, scale: float):
        return _math_backward(dout, q, k, v, out, lse, self._scores(q, k, diag, scale), scale)


def _math_backward(dout, q, k, v, out, lse, s: torch.Tensor, scale: float) -> Tensors3:
    """Blockwise backward from the block's scores ``s`` [B, H_kv, G, Lq, Lk] (consumed)."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    grouped = (b, hkv, hq // hkv, lq)
    do = dout.float().reshape(*grouped, d)
    # rowsum(dO ∘ O): softmax's Jacobian term
    delta = (do * out.float().reshape(*grouped, d)).sum(dim=-1)
    p = s.sub_(lse.reshape(grouped).unsqueeze(-1)).exp_()
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    ds = p.mul_(
        torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2)).sub_(delta.unsqueeze(-1))
    )
    dq = torch.matmul(ds, k.float().unsqueeze(2)).mul_(scale)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.float().reshape(*grouped, d)).mul_(scale)
    return dq.reshape(q.shape), dk, dv


class MaskedMathBlocks:
    """`MathBlocks` with a boolean mask [B, Lq, Lk] (True: query i may read key j) for the call's
    ``mask`` argument, in place of the causal flag (the same for every head: under TP a rank's heads
    read it alike). A query row with no key to read gets lse = -inf and out = 0."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = MathBlocks._scores(q, k, False, scale, _hidden(mask))
        lse = torch.logsumexp(s, dim=-1)
        finite = torch.where(lse.isinf(), 0.0, lse)  # a row of -inf: exp(-inf - 0) = 0, not nan
        out = torch.matmul(s.sub_(finite.unsqueeze(-1)).exp_(), v.float().unsqueeze(2))
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> Tensors3:
        # The final lse is finite (every query reads itself); the masked scores give P = 0.
        s = MathBlocks._scores(q, k, False, scale, _hidden(mask))
        return _math_backward(dout, q, k, v, out, lse, s, scale)


def _hidden(mask: torch.Tensor) -> torch.Tensor:
    """[B, Lq, Lk] "may read" -> [B, 1, 1, Lq, Lk] "hidden", broadcast over kv heads and groups."""
    return (~mask)[:, None, None]


# -- fused SDPA ops --------------------------------------------------------------------------------
# Each takes contiguous q, k, v (k, v with H_kv heads only where `native_gqa`), no dropout, and the
# block's own causal flag (a diagonal block is square, so top-left and bottom-right alignment are
# the same mask).


class SdpaOps(BlockKernel, Protocol):
    """A fused SDPA op pair: `BlockKernel`'s calls, with ``diag`` passed as the op's causal flag."""

    native_gqa: bool  # the op takes k, v with fewer heads than q and sums their gradients


_HALF = (torch.float16, torch.bfloat16)


class CpuFlashOps:
    """aten._scaled_dot_product_flash_attention_for_cpu and its backward."""

    native_gqa = False

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in (torch.float32, *_HALF)

    def forward(self, q, k, v, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale
        )


class CudaFlashOps:
    """aten._scaled_dot_product_flash_attention and its backward (FlashAttention-2): fp16 / bf16,
    head dim a multiple of 8 up to 256; GQA inside the kernel."""

    native_gqa = True

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256

    def forward(self, q, k, v, causal: bool, scale: float):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        # Dense (no cumulative sequence lengths), no dropout: the RNG state is not read.
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
            no_rng, no_rng, scale=scale,
        )  # fmt: skip


class CudaEfficientOps:
    """aten._scaled_dot_product_efficient_attention and its backward (memory-efficient attention):
    fp32 too, and head dims flash refuses (within this kernel's own limits); equal head counts. Its
    log-sum-exp has a row per query padded to a multiple of 32; the merge reads the first Lq, the
    backward gets the final one padded alike."""

    native_gqa = False

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in (torch.float32, *_HALF)

    def forward(self, q, k, v, causal: bool, scale: float):
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[:, :, : q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        lq = q.shape[2]
        lse = F.pad(lse, (0, -lq % 32))
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv


@dataclass(frozen=True)
class FusedBlocks:
    """A block kernel on one fused SDPA op pair (`ops`): inputs in their own dtype, results widened
    to fp32 for the merge; kv heads expanded for the call only where the op has no GQA of its own,
    their gradients summed back per kv head."""

    ops: SdpaOps

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return self.ops.supports(dtype, head_dim)

    def _kv(self, kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // kv.shape[1]
        if group == 1 or self.ops.native_gqa:
            return kv.contiguous()
        b, hkv, lk, d = kv.shape
        return kv.unsqueeze(2).expand(b, hkv, group, lk, d).reshape(b, hkv * group, lk, d)

    def forward(self, q, k, v, diag: bool, scale: float):
        out, lse = self.ops.forward(q.contiguous(), self._kv(k, q), self._kv(v, q), diag, scale)
        return out.float(), lse.float()

    def backward(self, dout, q, k, v, out, lse, diag: bool, scale: float):
        dq, dk, dv = self.ops.backward(
            dout.contiguous(),
            q.contiguous(),
            self._kv(k, q),
            self._kv(v, q),
            out.contiguous(),
            lse.contiguous(),
            diag,
            scale,
        )
        hkv = k.shape[1]
        if dk.shape[1] != hkv:  # expanded for the op: each kv head's copies summed back
            b, hq, lk, d = dk.shape
            dk, dv = (t.float().reshape(b, hkv, hq // hkv, lk, d).sum(dim=2) for t in (dk, dv))
        return dq.float(), dk.float(), dv.float()


KERNELS: dict[str, BlockKernel] = {
    "math": MathBlocks(),
    "cpu_flash": FusedBlocks(CpuFlashOps()),
    "cuda_flash": FusedBlocks(CudaFlashOps()),
    "cuda_efficient": FusedBlocks(CudaEfficientOps()),
}

# the kernel of the blocks a document mask cuts (ring attention with `Documents`)
MASKED = MaskedMathBlocks()

# device type -> its fused kernels, the first that supports a call's dtype and head dim wins. A
# test lets another device type (meta) stand in for one by adding it here.
FUSED: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu_flash",),
    "cuda": ("cuda_flash", "cuda_efficient"),
}

CHOICES = ("auto", "math", "flash")  # parallel.cp_kernel (config.CpKernel)


def choose_kernel(choice: str, device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """The `KERNELS` entry a block of this device type, dtype and head dim runs: ``choice`` is a
    ``parallel.cp_kernel`` value — "auto" (the device's fused kernel, else "math"), "math", "flash"
    (the device's fused kernel, an error where it has none) — or a `KERNELS` name, taken as is."""
    if choice in KERNELS:
        return choice
    if choice not in CHOICES:
        raise ValueError(
            f"ring attention kernel {choice!r}: choose {', '.join(CHOICES)} or one of "
            f"{', '.join(KERNELS)}"
        )
    for name in FUSED.get(device_type, ()) if choice != "math" else ():
        if KERNELS[name].supports(dtype, head_dim):
            return name
    if choice == "flash":
        raise ValueError(
            f"ring attention kernel 'flash': no fused block kernel on {device_type} for {dtype} "
            f"with head dim {head_dim} (fused kernels: "
            + "; ".join(f"{dev}: {', '.join(names)}" for dev, names in FUSED.items())
            + "); use auto or math"
        )
    return "math"
