"""Executes any lowered pipeline schedule (`schedules.py`) on this rank's stages.

Seed 003 §9 / §14. The runtime walks this rank's action list (`iter_steps`): each run of
communication actions becomes one `batch_isend_irecv` (receives waited for before the next
compute, sends waited for at the end of the step — sends are buffered), each compute action
runs one stage on one micro-batch:

- ``F``: forward; the last stage also computes the loss (divided by M, so the gradients
  accumulated over micro-batches are those of the mean loss);
- ``B``: full backward from the stored output and the received output-gradient;
- ``I`` / ``W`` (zero-bubble): ``I`` computes the input-gradient only — every linear layer's
  weight-gradient matmul is queued in a `WeightGradStore` — and ``W`` runs the queued ones for
  that micro-batch, accumulating into ``.grad`` through autograd (so gradient hooks still fire).

Each compute action's wall-clock start/end is recorded: `timeline()` turns them into a
`simulator.Timeline` (bubble fraction, PNG, Chrome trace) measured instead of simulated.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.comm import Comm
from fivefold.pipeline.schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action, Schedule, iter_steps, lower
from fivefold.pipeline.simulator import Timeline


class _LinearDeferredWGrad(torch.autograd.Function):
    """y = x Wᵀ whose backward returns only the input gradient and queues the weight gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.store = store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_in = grad_out @ weight
        if ctx.store.deferring:
            ctx.store.queue(weight, x.detach(), grad_out.detach())
            return grad_in, None, None
        return grad_in, grad_out.flatten(0, -2).t() @ x.flatten(0, -2), None


class _ApplyWGrad(torch.autograd.Function):
    """Routes a precomputed weight gradient through autograd, so AccumulateGrad and its hooks run."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, grad_out)
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):  # type: ignore[override]
        x, grad_out = ctx.saved_tensors
        return grad_out.flatten(0, -2).t() @ x.flatten(0, -2), None, None


class WeightGradStore:
    """Per-micro-batch queue of deferred weight-gradient matmuls (zero-bubble's W)."""

    def __init__(self) -> None:
        self.deferring = False
        self.current: Any = None
        self._pending: dict[Any, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = defaultdict(list)

    def queue(self, weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        self._pending[self.current].append((weight, x, grad_out))

    def run(self, key: Any) -> None:
        items = self._pending.pop(key, [])
        if items:
            torch.autograd.backward([_ApplyWGrad.apply(w, x, g) for w, x, g in items])

    def install(self, module: nn.Module) -> None:
        """Route every bias-free linear layer of `module` through the deferrable matmul."""
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.bias is None:
                m.forward = lambda x, m=m: _LinearDeferredWGrad.apply(x, m.weight, self)
            elif hasattr(m, "linear_fn") and getattr(m, "bias", None) is None:
                m.linear_fn = lambda x, w, b=None: _LinearDeferredWGrad.apply(x, w, self)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineRuntime:
    """Runs `schedule` for this pp rank over `stages` (virtual stage id -> module)."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module], comm: Comm, loss_fn: LossFn,
                 activation_shape: Callable[[int], Sequence[int]], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if not schedule.is_lowered and self.device.type == "cpu":
            # gloo sends never block (buffered), so the F+B pairing that keeps interleaved 1F1B
            # deadlock-free under NCCL's blocking sends is not needed; without it each SEND_F leaves
            # right after its F instead of after the paired backward.
            schedule = dataclasses.replace(schedule, fuse_forward_backward=False)
        self.schedule = schedule if schedule.is_lowered else lower(schedule)
        self.rank = comm.rank
        expected = set(self.schedule.stages_of(self.rank))
        if set(stages) != expected:
            raise ValueError(f"pp rank {self.rank} holds stages {sorted(stages)} but schedule "
                             f"'{schedule.name}' places {sorted(expected)} on it")
        if comm.size != schedule.n_ranks:
            raise ValueError(f"schedule '{schedule.name}' is for {schedule.n_ranks} pipeline ranks; pp={comm.size}")
        self.stages = stages
        self.comm = comm
        self.loss_fn = loss_fn
        self.activation_shape = activation_shape  # micro-batch size -> shape of the tensor between stages
        self.dtype = dtype
        self.n_stages = self.schedule.n_stages
        self.wgrad = WeightGradStore()
        if self.schedule.split_backward:
            for stage in stages.values():
                self.wgrad.install(stage)
        self.records: list[tuple[str, int, int, float, float]] = []
        # Post the next batch's receives one batch early. Safe with gloo, where every p2p op
        # progresses on its own; NCCL serialises a peer pair's ops on one stream, so a receive
        # posted ahead of a send the peer is waiting for could block it: off on accelerators.
        self.lookahead_recv = self.device.type == "cpu"

    # -- one step -------------------------------------------------------------------------------
    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Run every micro-batch forward and backward; returns the summed loss/M on the last stage
        (a forward-only schedule, e.g. `schedules.forward_only`, runs under no_grad: evaluation)."""
        if not any(a.kind != "F" for acts in self.schedule.actions for a in acts if a.is_compute):
            with torch.no_grad():
                return self._run(inputs, targets)
        return self._run(inputs, targets)

    def _run(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor | None:
        M = self.schedule.n_microbatches
        if len(inputs) != M or len(targets) != M:
            raise ValueError(f"schedule expects {M} micro-batches, got {len(inputs)} inputs / {len(targets)} targets")
        self.records = []
        t0 = time.perf_counter()
        stage_in: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> input (requires grad)
        stage_out: dict[tuple[int, int], torch.Tensor] = {}  # forward output (or loss on the last stage)
        grad_out: dict[tuple[int, int], torch.Tensor] = {}  # received gradient of a stage's output
        grad_in: dict[tuple[int, int], torch.Tensor] = {}  # gradient of a stage's input, to send back
        send_works: list = []
        loss_total: torch.Tensor | None = None
        mb_size = inputs[0].shape[0]
        steps = list(iter_steps(self.schedule.actions[self.rank]))
        batches = [i for i, item in enumerate(steps) if isinstance(item, list)]
        posted: dict[Action, tuple[torch.Tensor, Any]] = {}  # receives already in flight
        for i, item in enumerate(steps):
            if isinstance(item, list):
                later = [j for j in batches if j > i]
                upcoming = steps[later[0]] if later else []
                self._communicate(item, upcoming, mb_size, stage_in, stage_out, grad_out, grad_in, send_works,
                                  posted)
                continue
            a: Action = item
            key = (a.stage, a.microbatch)
            start = time.perf_counter() - t0
            if a.kind == "F":
                loss = self._forward(a, key, inputs, targets, stage_in, stage_out)
                if loss is not None:
                    loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
            elif a.kind in ("B", "I"):
                self._backward(a, key, stage_in, stage_out, grad_out, grad_in)
            elif a.kind == "W":
                self.wgrad.run(key)
            self.records.append((a.kind, a.microbatch, a.stage, start, time.perf_counter() - t0))
        for w in send_works:
            w.wait()
        return loss_total

    def _forward(self, a: Action, key: tuple[int, int], inputs, targets, stage_in, stage_out) -> torch.Tensor | None:
        stage = self.stages[a.stage]
        if a.stage == 0:
            x = inputs[a.microbatch].to(self.device)
        else:
            x = stage_in[key]
            x.requires_grad_(torch.is_grad_enabled())
        out = stage(x, seq_len=inputs[a.microbatch].shape[1]) if a.stage else stage(x)
        if a.stage == self.n_stages - 1:
            loss = self.loss_fn(out, targets[a.microbatch].to(self.device)) / self.schedule.n_microbatches
            stage_out[key] = loss
            return loss
        stage_out[key] = out
        nxt = (a.stage + 1, a.microbatch)
        if self.schedule.rank_of(a.stage + 1) == self.rank:  # next stage is local: no communication
            stage_in[nxt] = out.detach()
        return None

    def _backward(self, a: Action, key, stage_in, stage_out, grad_out, grad_in) -> None:
        out = stage_out.pop(key)
        self.wgrad.deferring = a.kind == "I"
        self.wgrad.current = key
        try:
            if a.stage == self.n_stages - 1:
                torch.autograd.backward(out)
            else:
                torch.autograd.backward(out, grad_out.pop(key))
        finally:
            self.wgrad.deferring = False
        if a.stage > 0:
            x = stage_in.pop(key)
            prev = (a.stage - 1, a.microbatch)
            if self.schedule.rank_of(a.stage - 1) == self.rank:
                grad_out[prev] = x.grad
            else:
                grad_in[key] = x.grad

    def _communicate(self, batch: list[Action], upcoming: list[Action], mb_size: int, stage_in, stage_out,
                     grad_out, grad_in, send_works: list, posted: dict) -> None:
        """One batch_isend_irecv: this batch's sends and the receives it still needs, plus (look-ahead)
        the receives of the next batch, so a transfer can progress while this rank computes. Waits
        only for this batch's receives; sends finish by the end of the step."""
        ops: list[tuple[str, torch.Tensor, int]] = []
        new_recvs: list[tuple[Action, torch.Tensor]] = []
        shape = tuple(self.activation_shape(mb_size))
        for a in batch:
            key = (a.stage, a.microbatch)
            if a.kind == SEND_F:
                ops.append(("send", stage_out[key].detach().contiguous(), a.peer))
            elif a.kind == SEND_B:
                ops.append(("send", grad_in.pop(key).contiguous(), a.peer))
        for a in [*batch, *(upcoming if self.lookahead_recv else [])]:
            if a.kind in (RECV_F, RECV_B) and a not in posted:
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                ops.append(("recv", buf, a.peer))
                new_recvs.append((a, buf))
        works = self.comm.batch_p2p(ops, tag="pp")
        send_works.extend(w for (kind, _, _), w in zip(ops, works) if kind == "send")
        recv_works = [w for (kind, _, _), w in zip(ops, works) if kind == "recv"]
        for (a, buf), w in zip(new_recvs, recv_works):
            posted[a] = (buf, w)
        for a in batch:
            if a.kind in (RECV_F, RECV_B):
                buf, w = posted.pop(a)
                w.wait()
                (stage_in if a.kind == RECV_F else grad_out)[(a.stage, a.microbatch)] = buf

    def timeline(self) -> Timeline:
        """The last step's measured compute times as a `Timeline` (this rank's row only)."""
        rows: list[list] = [[] for _ in range(self.schedule.n_ranks)]
        rows[self.rank] = list(self.records)
        return Timeline(rows, name=f"{self.schedule.name} (measured)", n_virtual=self.schedule.n_virtual)
