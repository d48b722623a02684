"""What ZeRO promises beyond the steady state: peak memory, exact masters, collectives on device.

Peak model-state bytes are counted independently of the engines' report: every storage reachable
from the wrapper and its optimizer, walked after every operator of backward (`memory.PeakSampler`)
and at block boundaries, against bounds computed here from the layout
(docs/design.md#model-state-memory plus what is in flight) and torch FSDP2's peak on the same units;
controls show it can fail. fp16 / bf16 ZeRO-3 equals hand-written mixed precision. One spawn per
world size (2, 4; `multiprocess`); the AST audit of device-less tensor factories and the storage
walk's own checks run in-process."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import build_toy, initial_state, lm_loss, run_workers, toy_batch
from tolerance import KERNELS, WORKERS, assert_within, reference
from torch import nn

from fivefold.data_parallel import DDP, DynamicLossScaler, MixedPrecision, ZeroDataParallel
from fivefold.distributed.comm import Comm, CommLog
from fivefold.models import build_model, get_config
from fivefold.models.llama import TransformerBlock
from fivefold.observe.memory import PeakSampler, model_state_bytes, reachable_storage_bytes

# The model: 8 blocks, Ψ = 427,072, untied, fp32 AdamW (4 + 4 + 8 bytes per element).
BLOCKS = 8
SMALL_BUCKET_MB = 0.25
UNBOUNDED = 10**6  # "every bucket may stay in flight": the behaviour before the bound (control)


def _model() -> nn.Module:
    return build_model(get_config("tiny", n_layers=BLOCKS, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=192,
                                  max_seq_len=32), seed=0)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


# ---------------------------------------------------------------------------------------------
# 1. Peak model-state bytes during backward
PEAK_LAYOUTS = {
    "ddp": dict(kind="ddp"),
    "z0": dict(kind="zero", stage=0),
    "z1": dict(kind="zero", stage=1),
    "z2": dict(kind="zero", stage=2, bucket_mb=SMALL_BUCKET_MB),
    "z3": dict(kind="zero", stage=3),
    # a parameter that never gets a gradient: with find_unused the unit completes when its backward is over
    "z3-unused": dict(kind="zero", stage=3, unused=True),
    "z2-unbounded": dict(kind="zero", stage=2, bucket_mb=SMALL_BUCKET_MB, inflight=UNBOUNDED),
    "z3-unbounded": dict(kind="zero", stage=3, inflight=UNBOUNDED),
}


def _peak_run(layout: dict, comm: Comm) -> dict:
    model = _model()
    if layout.get("unused"):
        model.layers[BLOCKS - 1].spare = nn.Linear(64, 64)  # never called
    buffers = list(model.buffers())  # the RoPE tables: constants, not model state
    psi = sum(p.numel() for p in model.parameters())
    largest_param = max(p.numel() for p in model.parameters())
    if layout["kind"] == "ddp":
        wrapper = DDP(model, comm, bucket_mb=SMALL_BUCKET_MB)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        roots = [wrapper, optimizer]

        def backward(loss):
            loss.backward()

        def step():
            optimizer.step()
            wrapper.zero_grad()
    else:
        wrapper = ZeroDataParallel(model, comm, zero_stage=layout["stage"], bucket_mb=layout.get("bucket_mb", 25.0),
                                   inflight_buckets=layout.get("inflight", 1), find_unused=layout.get("unused", False),
                                   lr=1e-3)
        optimizer = wrapper.optimizer
        roots = [wrapper]
        backward, step = wrapper.backward, wrapper.step
    sampler = PeakSampler(roots, exclude=buffers)

    def mark_before_backward(i: int):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if out.requires_grad:  # fires when the gradient of the block's output exists
                out.register_hook(lambda grad: sampler.mark(f"block{i}"))
        return hook

    for i, block in enumerate(m for m in model.modules() if isinstance(m, TransformerBlock)):
        block.register_forward_hook(mark_before_backward(i))
    for s in range(2):  # step 1 is measured: the optimizer state exists
        x, y = _batch(s, comm.rank)
        loss = _loss(wrapper(x), y)
        if s == 1:
            sampler.marks.clear()  # step 0's backward marked too
            with sampler:
                backward(loss)
            walk_after = reachable_storage_bytes(roots, exclude=buffers)
            reported = model_state_bytes(wrapper, optimizer if layout["kind"] == "ddp" else None).total
        else:
            backward(loss)
        step()
    out = dict(psi=psi, largest_param=largest_param, peak=sampler.peak, samples=sampler.samples,
               marks=[v for _, v in sampler.marks], walk_after=walk_after, reported=reported,
               step_counters=4 * sum(1 for s in optimizer.state.values() if "step" in s))
    if layout["kind"] == "zero":
        flats = wrapper.flats
        out.update(padded=[f.layout.padded_numel for f in flats], numel=[f.layout.numel for f in flats],
                   owned=sum(max(0, min(f.end, f.layout.numel) - f.start) for f in flats))
    return out


def _fsdp2_peak(comm: Comm) -> int:
    """torch FSDP2 on fivefold's default ZeRO-3 units (blocks, embedding, head; then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fivefold.data_parallel.fsdp import find_unit_modules

    mesh = init_device_mesh("cpu", (comm.size,))
    model = _model()
    buffers = list(model.buffers())
    for name, unit in find_unit_modules(model):
        if name:
            fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = PeakSampler([model, optimizer], exclude=buffers)
    for s in range(2):
        x, y = _batch(s, comm.rank)
        loss = _loss(model(x), y)
        if s == 1:
            with sampler:
                loss.backward()
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return sampler.peak


def _overlap(stage: int, comm: Comm) -> dict:
    """ZeRO-2/3: the first reduce-scatter is launched, and the first bucket completed (its buffer
    freed), while backward still produces gradients."""
    log = comm.log
    model = _model()
    engine = ZeroDataParallel(model, comm, zero_stage=stage, bucket_mb=SMALL_BUCKET_MB, lr=1e-3)
    engine.reducer.trace, engine.reducer.trace_clock = [], log.next_seq
    x, y = _batch(0, comm.rank)
    loss = _loss(engine(x), y)
    log.reset()
    engine.backward(loss)
    trace = engine.reducer.trace
    return dict(first_launch=min(r.seq for r in log.records if r.op == "reduce_scatter"),
                first_completed=min(seq for seq, event, _ in trace if event == "completed"),
                last_ready=max(seq for seq, event, _ in trace if event == "grad_ready"),
                n_buckets=len(engine.buckets))


# ---------------------------------------------------------------------------------------------
# 2. fp32 master weights start exact
def _masters_after_wrapping(comm: Comm) -> dict:
    out = {}
    for model_name, build in (("toy", build_toy), ("llama", _model)):
        for stage in range(4):
            for dtype in ("bf16", "fp16"):
                model = build()
                original = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
                units = [nn.Linear] if model_name == "toy" else None
                engine = ZeroDataParallel(model, comm, zero_stage=stage, units=units, lr=1e-3,
                                          mixed_precision=MixedPrecision.from_names(dtype))
                state = engine.full_state_dict()
                compute = {n: p.detach().clone() for n, p in model.named_parameters()} if stage < 3 else {}
                out[(model_name, stage, dtype)] = dict(
                    original=original, state={n: state[n] for n in original},
                    masters_fp32=all(f.master.dtype == torch.float32 for f in engine.flats),
                    compute={n: compute[n] for n in original if n in compute})
    return out


FP16_STEPS, FP16_LR = 3, 0.5
FP16_TOKENS = 12 * 5  # the global batch's tokens, summed into a weight gradient
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _half_zero3_run(comm: Comm, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """ZeRO-3, 16-bit compute (fp16: loss scale 1, no scaling), SGD: full fp32 states after every step."""
    scaler = DynamicLossScaler(init_scale=1.0) if dtype == torch.float16 else None
    engine = ZeroDataParallel(build_toy(), comm, zero_stage=3, units=[nn.Linear], lr=FP16_LR,
                              mixed_precision=MixedPrecision(dtype), optimizer_class=torch.optim.SGD,
                              loss_scaler=scaler)
    history = []
    for step in range(FP16_STEPS):
        x, y = toy_batch(step)
        engine.backward(lm_loss(engine(x.chunk(comm.size)[comm.rank]).float(), y.chunk(comm.size)[comm.rank]))
        engine.step()
        history.append(engine.full_state_dict())
    return history


def _half_reference(world: int, init: dict[str, torch.Tensor], dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Standard mixed precision, by hand: fp32 master weights (from the workers' initial state), a 16-bit copy for
    forward and backward (each rank's slice), its gradients averaged in fp32, fp32 SGD update."""
    master = build_toy()
    master.load_state_dict(init)
    trainable = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for _, p in trainable], lr=FP16_LR)
    history = []
    for step in range(FP16_STEPS):
        compute = build_toy()
        compute.load_state_dict(master.state_dict())
        compute.to(dtype)
        grads = {n: torch.zeros_like(p) for n, p in trainable}
        x, y = toy_batch(step)
        for xs, ys in zip(x.chunk(world), y.chunk(world)):
            compute.zero_grad()
            lm_loss(compute(xs).float(), ys).backward()
            for n, _ in trainable:
                grads[n] += compute.get_parameter(n).grad.float() / world
        for n, p in trainable:
            p.grad = grads[n]
        optimizer.step()
        state = {k: v.detach().clone() for k, v in master.state_dict().items()}
        state["frozen.weight"] = state["frozen.weight"].to(dtype)  # frozen: held in the compute dtype
        state["frozen.bias"] = state["frozen.bias"].to(dtype)
        history.append(state)
    return history


# ---------------------------------------------------------------------------------------------
# 3. Every tensor handed to a collective lives on the group's device
def _device_checks(comm: Comm) -> dict:
    cpu = torch.zeros(4 * comm.size)
    declared = Comm(comm.group, "dp", CommLog(), device="cuda")  # a group serving another device type
    calls = {
        "all_reduce": lambda: declared.all_reduce(cpu),
        "reduce_scatter": lambda: declared.reduce_scatter(cpu[:4], cpu),
        "all_gather": lambda: declared.all_gather(cpu, cpu[:4]),
        "broadcast": lambda: declared.broadcast(cpu),
        "all_to_all": lambda: declared.all_to_all(cpu.clone(), cpu),
        "send": lambda: declared.batch_p2p([("send", cpu, (comm.rank + 1) % comm.size)]),
    }
    errors = {}
    for op, call in calls.items():
        try:
            call()
            errors[op] = None
        except RuntimeError as e:
            errors[op] = str(e)
    # a p2p message must have the shape and dtype the peer allocated (else NCCL reads garbage or hangs)
    peer = (comm.rank + 1) % comm.size
    for name, tensor in (("shape", torch.zeros(3)), ("dtype", torch.zeros(4, dtype=torch.float64))):
        try:
            comm.batch_p2p([("send", tensor, peer)], expect=[((4,), torch.float32)])
            errors[f"p2p {name}"] = None
        except RuntimeError as e:
            errors[f"p2p {name}"] = str(e)
    scalar = comm.scalar(1.5)
    from_tensor = comm.scalar(torch.tensor(2.0, dtype=torch.float64))
    return dict(errors=errors, logged=len(declared.log.records), inferred=str(comm.device),
                scalar=(str(scalar.device), scalar.dtype, scalar.item()),
                from_tensor=(str(from_tensor.device), from_tensor.dtype, from_tensor.item()))


# ---------------------------------------------------------------------------------------------
def _worker() -> dict:
    comm = Comm(None, "dp", CommLog())
    return dict(peak={name: _peak_run(layout, comm) for name, layout in PEAK_LAYOUTS.items()},
                fsdp2_peak=_fsdp2_peak(comm),
                overlap={stage: _overlap(stage, comm) for stage in (2, 3)},
                masters=_masters_after_wrapping(comm), devices=_device_checks(comm),
                half={name: _half_zero3_run(comm, dtype) for name, dtype in HALF_DTYPES.items()})


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def results(request):
    return request.param, run_workers(_worker, request.param)


def _formula_bytes(name: str, r: dict, n: int) -> float:
    """Model-state bytes of the layout (fp32 AdamW), at the padded Ψ the layout uses, plus AdamW's
    4-byte step counter per optimizer tensor. m and v cover only this rank's real elements."""
    if name == "ddp":
        return 16 * r["psi"] + r["step_counters"]
    stage = PEAK_LAYOUTS[name]["stage"]
    psi_padded = sum(r["padded"])
    params = 4 * psi_padded / (n if stage == 3 else 1)
    grads = 4 * psi_padded / (n if stage >= 2 else 1)
    return params + grads + 8 * r["owned"] + r["step_counters"]


def _in_flight_allowance(name: str, r: dict) -> float:
    """What a layout may hold beyond its formula at the peak (fp32: 4 bytes per element)."""
    if name in ("ddp", "z0"):
        return 0  # gradients accumulate in place in the bucket views
    if name == "z1":
        return 4 * r["largest_param"]  # autograd's gradient before the hook copies it into the kept buffer
    if name.startswith("z2"):
        return 4 * sum(sorted(r["padded"])[-2:])  # the two largest full gradient buckets
    return 2 * 8 * max(r["padded"])  # z3: two units' gathered parameters and full gradients


# torch.autograd.backward's frame holds the loss and the ones it seeds backward with: 2 fp32 scalars.
LOSS_AND_SEED = 2 * 4


def _peak_bound(name: str, r: dict, n: int) -> float:
    return _formula_bytes(name, r, n) + _in_flight_allowance(name, r) + LOSS_AND_SEED


def _climb_bound(name: str, r: dict, n: int) -> float:
    """How much the count may grow from the first block boundary to the last: the gradient shards
    that appear as buckets complete (4Ψ/N, part of the formula) plus what may be in flight."""
    return 4 * sum(r["padded"]) / n + _in_flight_allowance(name, r)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ddp", "z0", "z1", "z2", "z3", "z3-unused"])
def test_peak_during_backward_within_formula_plus_in_flight(results, name):
    n, res = results
    for rank, per_rank in enumerate(res):
        r = per_rank["peak"][name]
        formula, bound = _formula_bytes(name, r, n), _peak_bound(name, r, n)
        assert r["samples"] > 100 and len(r["marks"]) == BLOCKS  # sampled all through backward
        assert r["peak"] <= bound, (f"rank {rank} {name}: peak {r['peak']:,} B > formula {formula:,.0f} "
                                    f"+ in flight = {bound:,.0f} B")
        # The walk agrees with the engine's own accounting once backward is over (same storages).
        assert r["walk_after"] == r["reported"]
        if name in ("ddp", "z0"):
            assert r["peak"] == bound  # nothing beyond the formula, ever


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["z2", "z3"])
def test_sharded_gradients_do_not_pile_up_block_by_block(results, name):
    """From block to block the count grows only by the gradient shards, where the unbounded control
    keeps every full buffer until backward ends: the same checks fail on it, so they can fail."""
    n, res = results
    for per_rank in res:
        bounded, control = per_rank["peak"][name], per_rank["peak"][f"{name}-unbounded"]
        assert max(bounded["marks"]) - bounded["marks"][0] <= _climb_bound(name, bounded, n)
        assert max(control["marks"]) - control["marks"][0] > _climb_bound(name, control, n)
        assert control["peak"] > _peak_bound(name, control, n)


@pytest.mark.multiprocess
def test_zero3_peak_is_not_above_fsdp2_on_the_same_units(results):
    """torch FSDP2 (`fully_shard` on the same units, measured the same way in the same worker) is the
    reference: fivefold's ZeRO-3 must not need more at the peak."""
    _, res = results
    for per_rank in res:
        assert per_rank["peak"]["z3"]["peak"] <= per_rank["fsdp2_peak"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_reduce_scatter_overlaps_and_frees_during_backward(results, stage):
    _, res = results
    for per_rank in res:
        o = per_rank["overlap"][stage]
        assert o["n_buckets"] >= 3
        assert o["first_launch"] < o["last_ready"]
        assert o["first_completed"] < o["last_ready"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_name", ["toy", "llama"])
@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_master_weights_equal_the_original_fp32_bit_for_bit(results, model_name, stage, dtype):
    _, res = results
    torch_dtype = MixedPrecision.from_names(dtype).param_dtype
    for per_rank in res:
        m = per_rank["masters"][(model_name, stage, dtype)]
        assert m["masters_fp32"]
        for name, want in m["original"].items():
            assert want.dtype == torch.float32
            assert torch.equal(m["state"][name], want), name  # full_state_dict before any step
            if name in m["compute"]:  # the compute copy is the original rounded once
                assert torch.equal(m["compute"][name], want.to(torch_dtype)), name
        assert any(not torch.equal(w.to(torch_dtype).float(), w) for w in m["original"].values())  # rounding bites


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("half", list(HALF_DTYPES))
def test_16_bit_zero3_matches_standard_mixed_precision(results, half, kernels):
    n, res = results
    # tests/tolerance.py rule 1's n: on the workers' kernels the reference repeats every rank's 16-bit forward and
    # backward op for op, so only the average over the n ranks (in fp32) is summed in another order; another kernel
    # path also reorders the 16-bit compute's own sums (the global batch's tokens, at that dtype's roundoff).
    dtype = HALF_DTYPES[half]
    terms, bound_dtype = (n, torch.float32) if kernels == WORKERS else (FP16_TOKENS, dtype)
    want, bounds = reference(_half_reference, n, initial_state(build_toy()), dtype, kernels=kernels, terms=terms,
                             dtype=bound_dtype)
    for rank, per_rank in enumerate(res):
        assert len(per_rank["half"][half]) == len(want) == FP16_STEPS
        for step, (got, ref) in enumerate(zip(per_rank["half"][half], want)):
            assert got.keys() == ref.keys()
            assert_within(got, ref, bounds[step], f"rank {rank} step {step}")


@pytest.mark.multiprocess
def test_comm_refuses_a_tensor_on_another_device(results):
    _, res = results
    for per_rank in res:
        d = per_rank["devices"]
        for op in ("p2p shape", "p2p dtype"):
            error = d["errors"].pop(op)
            assert error is not None and "but the peer expects (4,) torch.float32" in error, error
        for op, error in d["errors"].items():
            assert error is not None, f"{op} accepted a CPU tensor on a group declared for cuda"
            assert error.startswith(f"{op} over 'dp'") and "is on cpu" in error and "cuda" in error, error
        assert d["logged"] == 0  # refused before anything was issued
        assert d["inferred"] == "cpu"  # gloo serves the CPU
        assert d["scalar"] == ("cpu", torch.float32, 1.5)
        assert d["from_tensor"] == ("cpu", torch.float64, 2.0)


# ---------------------------------------------------------------------------------------------
# The audit: no tensor is created without saying where, outside the documented CPU-only places.
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "linspace",
             "scalar_tensor"}
CPU_BY_DESIGN = {
    # The model computes its RoPE tables on the CPU so they are bitwise identical on any device, then copies them
    # into its buffers (its initial values are drawn on the CPU too, with device="cpu" spelled out).
    ("models/llama.py", "precompute_rope"),
}


def test_every_tensor_factory_names_its_device():
    package = Path(__file__).resolve().parent.parent / "fivefold"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef) or (rel, func.name) in CPU_BY_DESIGN:
                continue
            for node in ast.walk(func):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                        and node.func.attr in FACTORIES
                        and not any(k.arg == "device" for k in node.keywords)):
                    offenders.append(f"{rel}:{node.lineno} torch.{node.func.attr}(...) in {func.name}")
    assert not offenders, "tensors created without device= (they land on the CPU; NCCL refuses them):\n" + \
        "\n".join(offenders)


class _PositionsOutside(nn.Module):
    """A user model that reads a weight outside its module's forward (GPT-2 positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(10, 8), nn.Embedding(6, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos.weight[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


def test_default_zero3_units_promote_only_what_the_model_declares():
    """Blocks always; besides them only the modules the model names in ``fsdp_units`` (used through
    their own forward alone), and never one whose parameters are shared."""
    from fivefold.data_parallel.fsdp import find_unit_modules

    names = lambda m: [n for n, _ in find_unit_modules(m)]  # noqa: E731
    assert names(_model()) == ["tok_embeddings", *[f"layers.{i}" for i in range(BLOCKS)], "output", ""]
    tied = build_model(get_config("tiny", n_layers=2, tie_embeddings=True))
    assert names(tied) == ["layers.0", "layers.1", ""]
    assert names(_PositionsOutside()) == ["blocks.0", "blocks.1", ""]  # pos stays in the root
    shared = _model()
    shared.layers[0].also_output = shared.output  # the head reachable under a second name
    assert "output" not in names(shared)


def test_walk_sees_what_an_engine_hides():
    """The independent count is not fooled by a buffer an engine keeps but does not report."""
    model = nn.Linear(10, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    base = reachable_storage_bytes([model, optimizer])
    assert base == 4 * 110
    model.stash = {"deep": [(1, torch.zeros(1000))]}  # hidden in a container
    hook_buffer = torch.zeros(500)
    model.register_forward_hook(lambda *a: hook_buffer)  # held by a hook's closure
    assert reachable_storage_bytes([model, optimizer]) == base + 4 * 1500
    assert math.isclose(model_state_bytes(model, optimizer).total, base)  # the self-report misses them
