"""`linear(x, w, b)`, which layers opt into so a zero-bubble pipeline (Qi et al. 2023) can split
backward into I (input gradient) and W (weight gradients, deferred into bubbles): under
`recording_weight_grads` I only queues (x, grad_out), and `WeightGradStore.run` (W) later hands dW,
db to autograd, so accumulation and DP hooks fire then. `recompute(fn, *args)`: activation
checkpointing (docs/design.md#activation-memory) that keeps the same recording state, and tells a
watcher (`watch_recompute`: the tracer) when a recomputation runs; `host_values(fetch)` inside it
reads values on the host once, in the forward, and hands the recomputation the same ones (no second
host sync); `recomputing()` says whether a recomputation is running. ``recompute(fn, *args,
selective=...)``: op-level selective checkpointing (torch's selective contexts merged with these),
where every collective ``fn`` issues runs once, in the forward, and the recomputation gets its
buffers back (`collective_outputs`). Backward markers shared by
ZeRO-3's unit hooks and the tracer: `call_in_backward` (an identity whose backward calls a hook
first), `in_backward`."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar, Token
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

__all__ = [
    "Linear",
    "Matmul",
    "WeightGradStore",
    "call_in_backward",
    "collective_outputs",
    "graph_task_id",
    "host_values",
    "in_backward",
    "linear",
    "recompute",
    "recomputing",
    "recording_weight_grads",
    "unwatch_recompute",
    "watch_recompute",
    "weight_grad_store",
]


def graph_task_id() -> int:
    """Id of the backward being run by autograd (-1 where torch does not tell)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


def in_backward() -> bool:
    """True while autograd runs a backward on this thread (a recomputed forward inside it, for
    instance)."""
    return graph_task_id() != -1


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward first calls a hook: on a module's outputs it runs before the module's
    backward, on its inputs after it."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.hook = hook
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.hook()
        return (None, *grads)


def call_in_backward(tree: Any, hook: Callable[[], None]) -> Any:
    """`tree` with its grad-requiring tensors passed through one identity whose backward calls
    ``hook`` first, once their gradients are all there (None if there are none, as a module hook
    returns to change nothing)."""
    leaves, spec = tree_flatten(tree)
    idx = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    wrapped = _RunInBackward.apply(hook, *[leaves[k] for k in idx])
    wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
    for k, t in zip(idx, wrapped):
        leaves[k] = t
    return tree_unflatten(leaves, spec)


# A linear's weight gradient from its input x and output gradient: dW = grad_outᵀ x (2-D)
WeightGrad = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class WeightGradStore:
    """Deferred weight-gradient matmuls, queued per key (the runtime's (stage, micro-batch))."""

    def __init__(self) -> None:
        # the key the queued work belongs to (set by the runtime for an I)
        self.current: Hashable = None
        self._pending: dict[Hashable, list[tuple]] = defaultdict(list)

    def queue(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        weight_grad: WeightGrad | None = None,
    ) -> None:
        """Queue one linear's W: its weight gradient ``weight_grad(x, grad_out)`` (default
        ``grad_outᵀ x`` in the inputs' precision; an FP8 linear passes its own GEMM) and the bias
        gradient, handed to autograd by `run`."""
        self._pending[self.current].append((weight, bias, x, grad_out, weight_grad))

    def run(self, key: Hashable) -> None:
        """Compute the queued weight (and bias) gradients of `key` through autograd."""
        items = self._pending.pop(key, [])
        if not items:
            return
        with _full_shaped(items):
            torch.autograd.backward([_ApplyWeightGrad.apply(*item) for item in items])

    def pending(self) -> int:
        return sum(len(v) for v in self._pending.values())


@contextmanager
def _full_shaped(items: list[tuple]) -> Iterator[None]:
    """Autograd checks a gradient against its parameter's shape *now*. By W time ZeRO-3 may have
    freed the gathered unit (the parameter is an empty placeholder until the next gather), so stand
    in a zero-cost view of the full shape (the reducer only reads the gradient) while the gradients
    are handed over, then put the placeholder back."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    for weight, bias, x, grad_out, _ in items:
        for p, shape in (
            (weight, (grad_out.shape[-1], x.shape[-1])),
            (bias, (grad_out.shape[-1],)),
        ):
            if p is not None and tuple(p.shape) != shape and all(p is not q for q, _ in swapped):
                swapped.append((p, p.data))
                p.data = torch.full((), float("nan"), dtype=p.dtype, device=p.device).expand(shape)
    try:
        yield
    finally:
        for p, placeholder in swapped:
            p.data = placeholder


_recording: ContextVar[WeightGradStore | None] = ContextVar(
    "fivefold_weight_grad_store", default=None
)


@contextmanager
def recording_weight_grads(store: WeightGradStore) -> Iterator[None]:
    """Linears run in this block leave their weight gradients to `store` (added later by
    `store.run(key)`)."""
    token = _recording.set(store)
    try:
        yield
    finally:
        _recording.reset(token)


def weight_grad_store() -> WeightGradStore | None:
    """The store `recording_weight_grads` set (None outside it, and while compiling, as `linear`
    sees it): for layers that defer their weight gradients themselves (grouped MoE experts)."""
    return None if torch.compiler.is_compiling() else _recording.get()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ + b; under `recording_weight_grads` its weight gradients wait in the store."""
    # A compiled block (train.compile) never records: validate refuses compile with the zero-bubble
    # schedules, and dynamo cannot read a ContextVar (it would break the graph at every linear).
    store = weight_grad_store()
    if store is None or not (torch.is_grad_enabled() and x.requires_grad):
        # nothing to defer to: without a gradient path through x there is no I pass to split off
        # (the first layer of a stage fed raw inputs), so the weight gradient is computed by the one
        # backward there is
        return F.linear(x, weight, bias)
    # The parameters travel outside autograd's inputs: no AccumulateGrad (and no hook) until W.
    return _LinearInputGradOnly.apply(
        x, weight.detach(), None if bias is None else bias.detach(), _Deferred(store, weight, bias)
    )


# Who wants to know when the recomputation of a `recompute` region runs (the tracer's span of the
# enclosing block): read at forward time, so the backward (on any thread) tells the watcher of the
# forward that set it.
_recompute_watcher: ContextVar[Callable[[bool], None] | None] = ContextVar(
    "fivefold_recompute_watch", default=None
)


def watch_recompute(watcher: Callable[[bool], None] | None) -> Token:
    """Regions `recompute` runs from now on (in this context) call ``watcher(True)`` when their
    recomputation starts in backward and ``watcher(False)`` when it ends (also when torch stops it
    early, once backward has what it needs). Returns the token for ``unwatch_recompute``."""
    return _recompute_watcher.set(watcher)


def unwatch_recompute(token: Token) -> None:
    _recompute_watcher.reset(token)


class _Told(AbstractContextManager):
    """A recomputation's context (entered on each recomputation): ``inner``'s, with the watcher told
    around it."""

    def __init__(self, inner: AbstractContextManager, watcher: Callable[[bool], None]) -> None:
        self.inner, self.watcher = inner, watcher

    def __enter__(self) -> None:
        self.watcher(True)
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.watcher(False)


class _HostMemo:
    """What a `recompute` region read on the host in its forward, in order, for recomputing it;
    with ``keep_collectives`` also the buffers its collectives wrote (`collective_outputs`)."""

    def __init__(self, keep_collectives: bool = False) -> None:
        self.values: list[Any] = []
        self.replaying, self.next = False, 0
        self.keep_collectives = keep_collectives
        self.collectives: list[list[torch.Tensor]] = []
        self.next_collective = 0


_host_memo: ContextVar[_HostMemo | None] = ContextVar("fivefold_host_memo", default=None)


def host_values(fetch: Callable[[], Any]) -> Any:
    """``fetch()`` (a read of device values on the host: a sync), except while `recompute` runs a
    region again in backward: then the value the forward's ``fetch()`` returned, so a
    recomputation makes no host sync and sees the forward's host values (split sizes, say)."""
    memo = _host_memo.get()
    if memo is None:
        return fetch()
    if memo.replaying:
        value = memo.values[memo.next]
        memo.next += 1
        return value
    value = fetch()
    memo.values.append(value)
    return value


class _Done:
    """The handle of a collective a recomputation did not issue (its buffers are filled)."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def collective_outputs(outputs: Sequence[torch.Tensor], issue: Callable[[], Any]) -> Any:
    """``issue()`` (a collective writing ``outputs``), except inside a `recompute` region that keeps
    its collectives (``selective=``): there the forward issues it and keeps ``outputs``, and the
    recomputation issues nothing — it copies the kept buffers into ``outputs`` (nothing where they
    are the same storage: an op output the selective policy saved) and returns a completed handle.
    Every rank's recomputation so sends nothing, and no buffer written in place is written twice."""
    memo = _host_memo.get()
    if memo is None or not memo.keep_collectives:
        return issue()
    if not memo.replaying:
        result = issue()
        memo.collectives.append(list(outputs))
        return result
    kept = memo.collectives[memo.next_collective]
    memo.next_collective += 1
    # The copies are fivefold's, not the region's ops: hidden from torch's selective mode, which
    # matches a recomputation's ops one by one, per op, to the forward's.
    with torch.no_grad(), _disable_current_modes():
        for out, was in zip(outputs, kept, strict=True):
            if out.data_ptr() != was.data_ptr():
                out.copy_(was)
    return _Done()


def recomputing() -> bool:
    """True while `recompute` runs a region again in backward (its recomputation, which replays the
    forward's `host_values`): for state a forward accumulates once per real forward (an MoE layer's
    expert loads, its share of a pooled loss), which a recomputation must not add again."""
    memo = _host_memo.get()
    return memo is not None and memo.replaying


def _remembering(fn: Callable[..., Any], keep_collectives: bool = False) -> Callable[..., Any]:
    """fn, recording its `host_values` (and with ``keep_collectives`` its collectives' buffers) on
    the first call and replaying them on every later one."""
    memo = _HostMemo(keep_collectives)

    def run(*args: Any) -> Any:
        token = _host_memo.set(memo)
        memo.next = memo.next_collective = 0
        try:
            return fn(*args)
        finally:
            _host_memo.reset(token)
            memo.replaying = True

    return run


class _Both(AbstractContextManager):
    """Two contexts entered in order (torch's selective recomputation context, then fivefold's)."""

    def __init__(self, first: AbstractContextManager, second: AbstractContextManager) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


# (forward, recomputation) contexts of torch's selective checkpointing, made per region
SelectiveContexts = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]


def recompute(
    fn: Callable[..., Any], *args: Any, selective: SelectiveContexts | None = None
) -> Any:
    """``fn(*args)`` keeping only its inputs for backward: its activations are computed again when
    backward needs them (non-reentrant `torch.utils.checkpoint`, so parameter gradients arrive once,
    through the normal graph, and DP hooks see nothing new). The recomputation runs in the same
    `recording_weight_grads` state as the forward did (the I pass of a zero-bubble pipeline computes
    it outside that context): the same ops, the same saved tensors. The RNG state is not stashed
    (fivefold's models draw no random numbers in forward: no dropout), which saves its copy per call
    (5 KiB on the CPU); a function that draws would need ``preserve_rng_state``. What ``fn`` reads
    on the host through `host_values` is read once, in the forward: the recomputation replays it.
    ``selective``: op-level selective checkpointing (`fivefold.models.recompute_policy`): torch's
    pair of contexts (its policy saves the chosen ops' outputs) around fivefold's, and every
    collective of ``fn`` issued once (`collective_outputs`)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    store = _recording.get()
    watcher = _recompute_watcher.get()

    def contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
        again = recording_weight_grads(store) if store is not None else nullcontext()
        forward: AbstractContextManager = nullcontext()
        if selective is not None:
            forward, saved = selective()
            again = _Both(saved, again)
        return forward, (again if watcher is None else _Told(again, watcher))

    return checkpoint(
        _remembering(fn, keep_collectives=selective is not None),
        *args,
        use_reentrant=False,
        context_fn=contexts,
        preserve_rng_state=False,
    )


# A linear layer's matmul: y = x Wᵀ + b from (x, weight, bias) — `linear`, or another strategy a
# layer is given (an FP8 one: `fivefold.float8.Float8Matmul`)
Matmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class Linear(nn.Linear):
    """`nn.Linear` computed by ``matmul`` (`linear`, unless a precision pass gave it another: FP8)
    — same parameters, names and initialisation."""

    matmul: Matmul = staticmethod(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


def _weight_grads(
    x: torch.Tensor, grad_out: torch.Tensor, with_bias: bool, weight_grad: WeightGrad | None = None
) -> tuple:
    g = grad_out.flatten(0, -2)
    grad_w = g.t() @ x.flatten(0, -2) if weight_grad is None else weight_grad(x, grad_out)
    return grad_w, (g.sum(0) if with_bias else None)


class _Deferred:
    # where a recorded linear's weight gradients go: a plain object, so not an autograd input
    def __init__(
        self, store: WeightGradStore, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        self.store, self.weight, self.bias = store, weight, bias


class _LinearInputGradOnly(torch.autograd.Function):  # backward returns dL/dx and queues dW, db
    @staticmethod
    def forward(ctx, x, weight, bias, deferred):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.deferred = deferred
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        d = ctx.deferred
        d.store.queue(d.weight, d.bias, x.detach(), grad_out.detach())
        return grad_out @ weight, None, None, None


class _ApplyWeightGrad(
    torch.autograd.Function
):  # deferred dW, db through autograd, so AccumulateGrad and hooks run
    @staticmethod
    def forward(ctx, weight, bias, x, grad_out, weight_grad=None):  # type: ignore[override]
        ctx.save_for_backward(x, grad_out)
        ctx.with_bias = bias is not None
        ctx.weight_grad = weight_grad
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]
        x, grad_out = ctx.saved_tensors
        grad_w, grad_b = _weight_grads(x, grad_out, ctx.with_bias, ctx.weight_grad)
        return grad_w, grad_b, None, None, None
