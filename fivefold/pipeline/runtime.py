"""Executes any lowered pipeline schedule on this rank's stages (docs/design.md#pipeline-schedules).

Each comm batch is one `batch_isend_irecv`; each compute runs one stage on one micro-batch, the last
stage dividing the loss by M (gradients of the mean loss). With ``overlap``, a schedule's overlapped
units (DualPipeV's (F, B) pairs) run side by side: the forward in a second thread, so one
micro-batch's expert all-to-all waits while another micro-batch computes. Zero-bubble: forwards run
under `ops.recording_weight_grads`, so ``I``
only queues every `ops.linear`'s weight-gradient matmul, which ``W`` runs through autograd (hooks
still fire).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fivefold.clock import DeviceClock
from fivefold.distributed.comm import P2P_SEMANTICS, Comm
from fivefold.ops import WeightGradStore, recording_weight_grads
from fivefold.pipeline.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, Schedule, steps
from fivefold.pipeline.checks import check_deadlock_free, validate
from fivefold.pipeline.lowering import lower

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# the thread an overlapped unit's forward runs in (a tracer's second compute lane)
SIDE_THREAD = "fivefold-overlap"


class ActionClock:
    """When each compute action ran, on the rank's `DeviceClock` (device events on an accelerator,
    where host time says nothing: the times are read once, when asked, not one wait per action)."""

    def __init__(self, device: torch.device) -> None:
        self._clock = DeviceClock(device)
        self.device_events = self._clock.device_events
        self._lock = threading.Lock()  # an overlapped unit's forward marks from its own thread
        self.reset()

    def reset(self) -> None:
        self._marks: list[Any] = []
        self._actions: list[
            tuple[str, int, int, int, int, str]
        ] = []  # kind, mb, stage, start, end mark, thread
        self.mark()  # the origin

    def mark(self) -> int:
        with self._lock:
            self._marks.append(self._clock.mark())
            return len(self._marks) - 1

    def record(self, a: Action, start: int) -> None:
        end = self.mark()
        with self._lock:
            self._actions.append(
                (a.kind, a.microbatch, a.stage, start, end, threading.current_thread().name)
            )

    def times(self) -> list[tuple[str, int, int, float, float]]:
        at = [ns / 1e9 for ns in self._clock.elapsed_ns(self._marks[0], self._marks)]
        return [(kind, mb, stage, at[i], at[j]) for kind, mb, stage, i, j, _ in self._actions]

    def marks(self) -> list[tuple[str, int, int, Any, Any, str]]:
        """(kind, micro-batch, stage, start mark, end mark, thread name) of each action of the last
        step, as raw `DeviceClock` marks: a tracer on the same device places them on its own
        timeline."""
        return [
            (kind, mb, stage, self._marks[i], self._marks[j], thread)
            for kind, mb, stage, i, j, thread in self._actions
        ]


class _Done:
    """The outcome of one `_SideThread` job: its value or its error, once finished."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def result(self) -> Any:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


class _SideThread:
    """One persistent daemon thread running overlapped forwards, one at a time (a thread per unit
    would also give every unit a fresh intra-op thread pool)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started = threading.Event()
        self.jobs_run = 0
        threading.Thread(target=self._loop, name=SIDE_THREAD, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, done = self._jobs.get()
            self.jobs_run += 1
            self._started.set()
            try:
                done._value = fn()
            except BaseException as e:  # handed to the caller by `_Done.result`
                done._error = e
            finally:
                done._event.set()

    def submit(self, fn: Callable[[], Any]) -> _Done:
        """Run ``fn`` on the side thread; returns once it has started."""
        done = _Done()
        self._started.clear()
        self._jobs.put((fn, done))
        self._started.wait()
        return done


Key = tuple[int, int]  # (stage, micro-batch)


@dataclasses.dataclass
class _StepState:
    """What one step's actions hand each other: the micro-batches, the tensors between a stage's
    forward, backward and messages (keyed by (stage, micro-batch)), and the messages in flight."""

    inputs: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    documents: Sequence[Any]  # each micro-batch's Documents (None: across documents)
    loss_weight: float
    stage_in: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)  # requires grad
    stage_out: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)  # or the loss
    grad_out: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)  # received
    grad_in: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)  # to send back
    send_works: list[Any] = dataclasses.field(default_factory=list)  # waited at the step's end
    posted: dict[Action, tuple[torch.Tensor, Any]] = dataclasses.field(
        default_factory=dict
    )  # receives already in flight


class PipelineRuntime:
    """Runs `schedule` for this pp rank over `stages` (virtual stage id -> module)."""

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, nn.Module],
        comm: Comm,
        loss_fn: LossFn,
        activation_shape: Callable[[int], Sequence[int]],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        p2p: str | None = None,
        overlap: bool = False,
    ) -> None:
        self.device = torch.device(device)
        # Run the schedule's overlapped units (`Schedule.side_by_side`) side by side: the forward in
        # a second thread. Only safe when the two passes never call one process group at once: the
        # caller decides (`parallelize.pipeline_overlap`), which relies on the engines' backward
        # hooks issuing no collective during the pipeline step (`no_sync`) and on the backward's
        # all-to-alls having a group of their own.
        self.overlap = overlap
        self._side: _SideThread | None = None
        # How messages complete decides how the lists may be ordered (`Comm.p2p_semantics`; settable
        # for tests).
        self.p2p = p2p or comm.p2p_semantics()
        assert self.p2p in P2P_SEMANTICS, f"p2p={self.p2p!r} (pipeline.p2p is refused when read)"
        if self.p2p == "buffered" and comm.p2p_semantics() == "rendezvous":
            raise ValueError(
                f"p2p='buffered' relies on gloo's per-message completion; this '{comm.dim}' group "
                f"on {comm.device} completes a batch as a whole: use p2p='rendezvous' (or the "
                "default)"
            )
        rendezvous = self.p2p == "rendezvous"
        if not schedule.is_lowered and not rendezvous:
            # buffered sends never block, so the F+B pairing that keeps interleaved 1F1B
            # deadlock-free under a rendezvous is not needed; without it each SEND_F leaves right
            # after its F instead of after the backward.
            schedule = dataclasses.replace(schedule, fuse_forward_backward=False)
        self.schedule = schedule if schedule.is_lowered else lower(schedule)
        # Any list the runtime is given must be complete, executable and pair its messages in order
        # (p2p between two ranks matches by order): a wrong list would otherwise train on the wrong
        # tensors or hang.
        validate(self.schedule)
        check_deadlock_free(self.schedule, rendezvous=rendezvous)
        self.rank = comm.rank
        expected = set(self.schedule.stages_of(self.rank))
        if set(stages) != expected:
            raise ValueError(
                f"pp rank {self.rank} holds stages {sorted(stages)} but schedule "
                f"'{schedule.name}' places {sorted(expected)} on it"
            )
        if comm.size != schedule.n_ranks:
            raise ValueError(
                f"schedule '{schedule.name}' is for {schedule.n_ranks} pipeline ranks; "
                f"pp={comm.size}"
            )
        self.stages = stages
        self.comm = comm
        self.loss_fn = loss_fn
        # micro-batch size -> shape of the tensor between stages
        self.activation_shape = activation_shape
        self.dtype = dtype
        self.n_stages = self.schedule.n_stages
        self.wgrad = WeightGradStore()
        self.clock = ActionClock(self.device)
        # Buffered: post the next batch's receives one batch early, so a transfer progresses while
        # this rank computes. Under a rendezvous a batch completes as a whole: an early receive
        # would hold back the sends posted with it until the peer's next send, which may wait for
        # them.
        self.lookahead_recv = not rendezvous

    def step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        documents: Sequence[Any] | None = None,
        loss_weight: float = 1.0,
    ) -> torch.Tensor | None:
        """Run every micro-batch forward and backward; the summed loss/M on the last stage (no_grad
        if forward-only), each micro-batch's loss × `loss_weight`. ``documents``: each
        micro-batch's `models.documents.Documents` (every stage's forward takes its own), or
        None."""
        if not any(a.kind != "F" for acts in self.schedule.actions for a in acts if a.is_compute):
            with torch.no_grad():
                return self._run(inputs, targets, documents, loss_weight)
        return self._run(inputs, targets, documents, loss_weight)

    def _run(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        documents: Sequence[Any] | None,
        loss_weight: float,
    ) -> torch.Tensor | None:
        M = self.schedule.n_microbatches
        if len(inputs) != M or len(targets) != M:
            raise ValueError(
                f"schedule expects {M} micro-batches, got {len(inputs)} inputs / {len(targets)} "
                "targets"
            )
        self.clock.reset()
        st = _StepState(inputs, targets, documents or [None] * M, loss_weight)
        loss_total: torch.Tensor | None = None
        mb_size = inputs[0].shape[0]
        plan = steps(self.schedule.actions[self.rank])
        batches = [i for i, item in enumerate(plan) if isinstance(item, list)]
        side_by_side = None  # the backward that runs beside the forward just started
        for i, item in enumerate(plan):
            if isinstance(item, list):
                later = [j for j in batches if j > i]
                upcoming = plan[later[0]] if later else []
                self._communicate(item, upcoming, mb_size, st)
                continue
            a: Action = item
            if a is side_by_side:
                continue  # ran with its unit
            nxt = plan[i + 1] if i + 1 < len(plan) else None
            if (
                self.overlap
                and isinstance(nxt, Action)
                and self.schedule.runs_beside_forward(self.rank, nxt)
            ):
                side_by_side = nxt
                loss = self._unit(a, nxt, st)
            else:
                loss = self._compute(a, st)
            if loss is not None:
                loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
        for w in st.send_works:
            w.wait()
        return loss_total

    def _compute(self, a: Action, st: _StepState) -> torch.Tensor | None:
        """Run one compute action, timed; the loss if it is the last stage's forward."""
        key = (a.stage, a.microbatch)
        start = self.clock.mark()
        loss = None
        if a.kind == "F":
            loss = self._forward(a, key, st)
        elif a.kind in ("B", "I"):
            self._backward(a, key, st)
        elif a.kind == "W":
            self.wgrad.run(key)
        self.clock.record(a, start)
        return loss

    def _unit(self, forward: Action, backward: Action, st: _StepState) -> torch.Tensor | None:
        """DualPipe's overlap unit: ``forward`` (one micro-batch) on the side thread while this
        thread runs ``backward`` (another), so one pass's collectives (an MoE layer's all-to-alls)
        wait while the other computes. Their inputs arrived before the unit and their outputs leave
        after it; they touch different micro-batches' tensors, and their collectives use different
        process groups (forward: the layer's groups, backward: their backward twins), so each group
        sees the same order of calls on every rank. The forward always finishes before the unit
        returns, also when the backward fails (its peers are other ranks' forwards, which do not
        wait for this backward): no call of this unit is left to collide with a later one."""
        if self._side is None:
            self._side = _SideThread()
        grad_mode = torch.is_grad_enabled()

        def run_forward() -> torch.Tensor | None:
            with torch.set_grad_enabled(grad_mode):
                return self._compute(forward, st)

        done = self._side.submit(run_forward)  # returns once the forward is under way
        try:
            self._compute(backward, st)
        finally:
            loss = (
                done.result()
            )  # waits; raises the forward's error (after the backward's, if both failed)
        return loss

    @property
    def records(self) -> list[tuple[str, int, int, float, float]]:
        """(kind, micro-batch, stage, start s, end s) of every compute action of the last step
        (waits for it)."""
        return self.clock.times()

    def _forward(self, a: Action, key: Key, st: _StepState) -> torch.Tensor | None:
        stage = self.stages[a.stage]
        if a.stage == 0:
            x = st.inputs[a.microbatch].to(self.device)
        else:
            x = st.stage_in[key]
            x.requires_grad_(torch.is_grad_enabled())
        # zero-bubble: every `fivefold.ops.linear` in this forward may defer its weight gradient to
        # W
        with (
            recording_weight_grads(self.wgrad)
            if self.schedule.split_backward
            else contextlib.nullcontext()
        ):
            docs = st.documents[a.microbatch]
            out = stage(x) if docs is None else stage(x, docs)
        if a.stage == self.n_stages - 1:
            loss = (  # (× 1.0 then / M: bit for bit the unweighted loss / M)
                self.loss_fn(out, st.targets[a.microbatch].to(self.device))
                * st.loss_weight
                / self.schedule.n_microbatches
            )
            st.stage_out[key] = loss
            return loss
        st.stage_out[key] = out
        nxt = (a.stage + 1, a.microbatch)
        if self.schedule.rank_of(a.stage + 1) == self.rank:  # next stage is local: no communication
            st.stage_in[nxt] = out.detach()
        return None

    def _backward(self, a: Action, key: Key, st: _StepState) -> None:
        out = st.stage_out.pop(key)
        self.wgrad.current = key  # recorded linears queue their weight gradients under this key
        if a.stage == self.n_stages - 1:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, st.grad_out.pop(key))
        if a.kind == "B":  # a full backward: whatever a recorded forward queued is computed now
            self.wgrad.run(key)
        if a.stage > 0:
            x = st.stage_in.pop(key)
            prev = (a.stage - 1, a.microbatch)
            if self.schedule.rank_of(a.stage - 1) == self.rank:
                st.grad_out[prev] = x.grad
            else:
                st.grad_in[key] = x.grad

    def _communicate(
        self,
        batch: list[Action],
        upcoming: list[Action],
        mb_size: int,
        st: _StepState,
    ) -> None:
        """One batch_isend_irecv of this batch's sends and receives (plus, buffered, the next
        batch's receives). A receive is complete when the work covering it is: its own (gloo) or the
        whole batch's (NCCL coalesces); sends are waited at the end of the step."""
        ops: list[tuple[str, torch.Tensor, int]] = []
        new_recvs: list[tuple[int, Action, torch.Tensor]] = []
        shape = tuple(self.activation_shape(mb_size))
        for a in batch:
            key = (a.stage, a.microbatch)
            if a.kind == SEND_F:
                ops.append(("send", st.stage_out[key].detach().contiguous(), a.peer))
            elif a.kind == SEND_B:
                ops.append(("send", st.grad_in.pop(key).contiguous(), a.peer))
        for a in [*batch, *(upcoming if self.lookahead_recv else [])]:
            if a.kind in (RECV_F, RECV_B) and a not in st.posted:
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                new_recvs.append((len(ops), a, buf))
                ops.append(("recv", buf, a.peer))
        # every message between stages is one activation (or its gradient): the peer allocated
        # exactly this
        issued = self.comm.batch_p2p(ops, tag="pp", expect=[(shape, self.dtype)] * len(ops))
        if issued.coalesced and self.lookahead_recv:
            raise RuntimeError(
                "p2p='buffered' needs one work per message, but this backend returned one for the "
                f"whole batch of {issued.n_ops} (it coalesces, as NCCL does): use p2p='rendezvous'"
            )
        st.send_works.extend(
            {
                id(w): w
                for i, (kind, _, _) in enumerate(ops)
                if kind == "send"
                for w in [issued.work_of(i)]
            }.values()
        )
        for i, a, buf in new_recvs:
            st.posted[a] = (buf, issued.work_of(i))
        for a in batch:
            if a.kind in (RECV_F, RECV_B):
                buf, w = st.posted.pop(a)
                w.wait()
                # a batch's one work also covers its sends; waited, it is done (gloo's p2p works
                # wait only once)
                st.send_works[:] = [s for s in st.send_works if s is not w]
                (st.stage_in if a.kind == RECV_F else st.grad_out)[(a.stage, a.microbatch)] = buf
