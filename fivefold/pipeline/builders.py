"""Schedule builders: one function per pipeline schedule, ``(P, M, V) -> Schedule`` (compute actions only;
`lowering.lower` adds the communication). A new schedule is one more builder here and one entry in `SCHEDULES`.
"""

from __future__ import annotations

from collections.abc import Callable

from fivefold.pipeline.actions import Action, B, F, I, Schedule, W

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "forward_only", "SCHEDULES",
           "build_schedule"]


def _check_sizes(name: str, P: int, M: int, V: int = 1) -> None:
    for label, value in (("P (pipeline ranks)", P), ("M (micro-batches)", M), ("V (virtual stages per rank)", V)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")


def _check_m_ge_p(name: str, P: int, M: int, why: str) -> None:
    if M < P:
        raise ValueError(f"{name} needs at least as many micro-batches as stages (M={M} < P={P}): {why}; use M >= P")


def _plain_placement(P: int) -> list[int]:
    return list(range(P))


def _one_stage_per_rank(name: str, V: int) -> None:
    if V != 1:
        raise ValueError(f"schedule {name!r} has one stage per rank (V=1), got V={V}; only 'interleaved' takes V > 1")


def gpipe(P: int, M: int, V: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019; seed 003 §9.2): all M forwards, then all M backwards in reverse order (the stack
    order of the stored activations). Every rank holds M micro-batches at the turn; bubble (P-1)/(M+P-1)."""
    name = "gpipe"
    _check_sizes(name, P, M, V)
    _one_stage_per_rank(name, V)
    _check_m_ge_p(name, P, M, "with fewer the pipeline never fills (no moment has every stage busy) and the bubble "
                  "(P-1)/(M+P-1) is at least 50%")
    actions = [[Action(F, m, r) for m in range(M)] + [Action(B, m, r) for m in reversed(range(M))] for r in range(P)]
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


def one_f_one_b(P: int, M: int, V: int = 1) -> Schedule:
    """1F1B (PipeDream-flush / Megatron, seed 003 §9.5): rank r warms up with P-1-r forwards, then runs (F, B)
    pairs, then the last P-1-r backwards. Rank r holds at most P-r micro-batches; bubble as GPipe."""
    name = "1f1b"
    _check_sizes(name, P, M, V)
    _one_stage_per_rank(name, V)
    _check_m_ge_p(name, P, M, "with fewer, the first stage runs out of forwards before the first backward returns")
    actions = []
    for r in range(P):
        n_warmup = P - 1 - r
        acts = [Action(F, m, r) for m in range(n_warmup)]
        for i in range(M - n_warmup):
            acts += [Action(F, n_warmup + i, r), Action(B, i, r)]
        acts += [Action(B, i, r) for i in range(M - n_warmup, M)]
        actions.append(acts)
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


def interleaved_1f1b(P: int, M: int, V: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. SC 2021; seed 003 §9.4): rank r holds chunks r, P + r, ...;
    micro-batches pass them in groups of P (M % P == 0, as in Megatron). Warm-up ``2·(P-1-r) + (V-1)·P`` forwards,
    also for M == P (Megatron runs all forwards first there: same makespan, more memory). Bubble (P-1)/(V·M+P-1)."""
    name = "interleaved"
    _check_sizes(name, P, M, V)
    if V < 2:
        raise ValueError(f"{name}: needs V >= 2 virtual stages per rank (got V={V}); V=1 is plain 1F1B, use '1f1b'")
    _check_m_ge_p(name, P, M, "micro-batches enter each model chunk in groups of P, and with fewer the first "
                  "chunk's group is incomplete before the second chunk starts")
    if M % P != 0:
        raise ValueError(f"{name} needs the number of micro-batches to be a multiple of the pipeline size "
                         f"(M={M}, P={P}, M % P = {M % P}), as Megatron requires: micro-batches are processed in "
                         f"groups of P per model chunk; use M = {(M // P + 1) * P} or {max(P, M // P * P)}")
    S = P * V
    total = M * V

    def chunk(k: int, forward: bool) -> int:
        c = (k % S) // P
        return c if forward else V - 1 - c

    def microbatch(k: int) -> int:
        return (k // S) * P + k % P

    actions = []
    for r in range(P):

        def fwd(k: int, r: int = r) -> Action:
            return Action(F, microbatch(k), chunk(k, True) * P + r)

        def bwd(k: int, r: int = r) -> Action:
            return Action(B, microbatch(k), chunk(k, False) * P + r)

        n_warmup = min(2 * (P - 1 - r) + (V - 1) * P, total)
        acts = [fwd(k) for k in range(n_warmup)]
        n_steady = total - n_warmup
        for k in range(n_steady):
            acts += [fwd(n_warmup + k), bwd(k)]
        acts += [bwd(k) for k in range(n_steady, total)]
        actions.append(acts)
    # M > P: pair each F with the backward after it when lowering (Megatron's combined step), else
    # sends that block (NCCL) deadlock; M == P: that pairing itself deadlocks, per-action batches are safe
    return Schedule(name, P, M, V, [s % P for s in range(S)], actions, fuse_forward_backward=M > P)


def zero_bubble_h1(P: int, M: int, V: int = 1) -> Schedule:
    """ZB-H1 ("Zero Bubble Pipeline Parallelism", Qi et al. 2023, §3.1): 1F1B with B split into I (critical path)
    and W, deferred: rank r runs W(i) after I(i + r), filling 1F1B's cool-down; with F = I = W the bubble shrinks to
    (P-1)/(3M+P-1). Activations live F to W: at most P micro-batches per rank (1F1B's peak, "same peak memory")."""
    name = "zb-h1"
    _check_sizes(name, P, M, V)
    _one_stage_per_rank(name, V)
    _check_m_ge_p(name, P, M, "with fewer, the first stage runs out of forwards before the first input-gradient "
                  "pass returns")
    actions = []
    for r in range(P):
        n_warmup = P - 1 - r
        acts = [Action(F, m, r) for m in range(n_warmup)]
        n_w = 0  # weight-gradient passes emitted so far (in micro-batch order)
        for i in range(M):
            if i < M - n_warmup:  # steady state: forward of the next micro-batch first
                acts.append(Action(F, n_warmup + i, r))
            acts.append(Action(I, i, r))
            while n_w <= i - r:  # W of micro-batch i - r: r micro-batches behind the I's
                acts.append(Action(W, n_w, r))
                n_w += 1
        acts += [Action(W, m, r) for m in range(n_w, M)]  # flush the last r
        actions.append(acts)
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


SCHEDULES: dict[str, Callable[..., Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b,
                                                 "zb-h1": zero_bubble_h1}


def forward_only(P: int, M: int, stage_to_rank: list[int], name: str = "forward-only") -> Schedule:
    """Evaluation: every micro-batch through every stage in model order, no backward (no cycle can form)."""
    actions = [[Action(F, m, s) for m in range(M) for s in range(len(stage_to_rank)) if stage_to_rank[s] == r]
               for r in range(P)]
    V = len(stage_to_rank) // P
    return Schedule(name, P, M, V, list(stage_to_rank), actions)


def build_schedule(name: str, P: int, M: int, V: int = 1) -> Schedule:
    """Build schedule ``name`` (a key of `SCHEDULES`) for P ranks, M micro-batches, V chunks per rank."""
    try:
        builder = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    return builder(P, M, V)
