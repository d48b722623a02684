"""Benchmark fivefold against torch's reference implementations on local gloo CPU ranks: the command line.

    python bench/run.py ddp                       # preset small; defaults sized for ~1-2 min on 2 cores
    python bench/run.py ddp --preset tiny --steps 10 --json out.json
    python bench/run.py zero                      # ZeRO 0-3 vs torch DDP / ZeroRedundancyOptimizer / FSDP2
    python bench/run.py zero --stages 0,3         # a subset (each fivefold stage brings its counterpart)
    python bench/run.py zero --stages 3 --keep    # + ZeRO-3 with the gathered units kept for backward (2Ψ, not 3Ψ)
    python bench/run.py zeropp                    # ZeRO-3 with qwZ / qgZ / hpZ vs plain ZeRO-3: bytes and time
    python bench/run.py offload                   # ZeRO-2/3 with optimizer offload / constant buffers vs without
    python bench/run.py optim                     # the optimizer step on the CPU: 1 MiB segments vs whole shards
    python bench/run.py optim-ops                 # operations one optimizer step dispatches (meta, fake group)
    python bench/run.py tp                        # TP (and TP+SP) vs torch DTensor TP, tp 2
    python bench/run.py pp                        # schedules vs torch.distributed.pipelining, P 2
    python bench/run.py cp                        # ring attention vs all-gather K/V, cp 2, seq 2k-8k
    python bench/run.py cp-modes                  # ring vs Ulysses vs ring × Ulysses hybrid, cp 4 (hybrid
                                                  # Ulysses 2 × ring 2), seq 2k-8k: step, traffic, memory
    python bench/run.py cp-kernel                 # ring attention's block kernels, fused vs fp32 math, one
                                                  # device (a GPU: 8k tokens, cp 4 emulated by blocks);
                                                  # --dry-run: a CPU-sized run in seconds
    python bench/run.py syncs                     # host syncs per training step, per layout (fake group, meta
                                                  # standing in for CUDA): first, unlogged and log steps
    python bench/run.py ckpt                      # checkpoint save (sync/async), load, export: time and memory
    python bench/run.py ckpt-share                # the share of a run's time the default saves take (at the
                                                  # end, by time; the 50-waits rule at a tiny interval)
    python bench/run.py init                      # start-up's initial values drawn: CPU (1 thread) vs accelerator
    python bench/run.py debug                     # what --debug.collectives costs per collective
    python bench/run.py recompute                 # activation recompute none/full/selective (+ torch's): memory
                                                  # kept, peak, step time; seq 1024, eager and sdpa attention
    python bench/run.py ep                        # Llama-MoE: experts over ep 2 vs replicated experts, then
                                                  # DualPipeV pp 2 x ep 2 with (F, B) units overlapped vs not
    python bench/run.py experts                   # one MoE layer: experts as a grouped matmul / padded bmm vs
                                                  # the loop, forward + backward at three sizes
    python bench/run.py scaling                   # DDP (world 2, 4), ZeRO-3 (+ kept), TP 2 at ~10M/40M/125M:
                                                  # fivefold/torch, step/ideal, MFU (docs/benchmarks.md)
    python bench/run.py compile                   # train.compile: compiled vs eager blocks in DDP, ZeRO-3, tp 2, pp 2
    python bench/run.py fp8                       # FP8 linears (tensorwise, rowwise; ZeRO-3 + FP8 gathers) vs bf16:
                                                  # step time (slower on a CPU: expected) and gather bytes
    python bench/run.py muon                      # Muon (whole matrices owned) vs AdamW under ZeRO-1: step time
    python bench/run.py documents                 # attention inside packed documents: dense-mask SDPA, eager,
                                                  # per-document SDPA, flex vs causal SDPA; L 2k and 8k
    python bench/run.py prepare                   # fivefold prepare (1, 2 workers) vs a tokenizers encode_batch
                                                  # loop: tokens/s on a few MiB of stdlib sources
    python bench/run.py ft                        # ft.replica_groups 2 vs HSDP dp_replicate 2: step time; a
                                                  # group SIGKILLed / SIGSTOPped to the next step, to rejoin
    python bench/run.py parallel                  # tp, then pp
    python bench/run.py all --json out.json       # ddp, zero, tp, then pp

Same as ``make bench ARGS="..."`` and, from a source checkout, ``fivefold bench ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import `bench` from the checkout, not this folder's modules by name
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_here)]
    sys.path.insert(0, str(Path(_here).parent))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from bench.checkpoint import (  # noqa: E402
    CheckpointSpec,
    SaveShareSpec,
    bench_checkpoint,
    bench_save_share,
    format_checkpoint_table,
    format_save_share_table,
)
from bench.compile import CompileSpec, bench_compile, format_compile_table  # noqa: E402
from bench.context_parallel import (  # noqa: E402
    CPKernelSpec,
    CPModesSpec,
    CPSpec,
    bench_cp,
    bench_cp_kernels,
    bench_cp_modes,
    format_cp_kernel_table,
    format_cp_modes_table,
    format_cp_table,
)
from bench.data_parallel import (  # noqa: E402
    DPSpec,
    bench_ddp,
    bench_offload,
    bench_optimizer,
    bench_zero,
    format_offload_table,
    format_optimizer_ops_table,
    format_optimizer_table,
    format_table,
    optimizer_ops,
)
from bench.debug_collectives import DebugSpec, bench_debug, format_debug_table  # noqa: E402
from bench.documents import DocumentsSpec, bench_documents, format_documents_table  # noqa: E402
from bench.expert_parallel import (  # noqa: E402
    EPOverlapSpec,
    EPSpec,
    ExpertsSpec,
    bench_ep,
    bench_ep_overlap,
    bench_experts,
    format_ep_overlap_table,
    format_ep_table,
    format_experts_table,
)
from bench.ft import FtSpec, bench_ft, format_ft_table  # noqa: E402
from bench.host_syncs import bench_syncs, format_syncs_table  # noqa: E402
from bench.init import InitSpec, bench_init, format_init_table  # noqa: E402
from bench.numerics import (  # noqa: E402
    NumericsSpec,
    bench_fp8,
    bench_muon,
    format_fp8_table,
    format_muon_table,
)
from bench.pipeline import PPSpec, bench_pp, format_pp_table  # noqa: E402
from bench.plan import PlanSpec, bench_plan, format_plan_table  # noqa: E402
from bench.prepare import PrepareSpec, bench_prepare, format_prepare_table  # noqa: E402
from bench.published import bench_published, format_published_table  # noqa: E402
from bench.recompute import RecomputeSpec, bench_recompute, format_recompute_table  # noqa: E402
from bench.scaling import ScaleSpec, bench_scaling, format_scaling_table  # noqa: E402
from bench.tensor_parallel import TPSpec, bench_tp, format_tp_table  # noqa: E402
from bench.zeropp import ZeroPPSpec, bench_zeropp, format_zeropp_table  # noqa: E402

__all__ = ["main"]

WHAT = {  # command -> the benchmarks it runs, in order
    "ddp": ("ddp",), "zero": ("zero",), "offload": ("offload",), "tp": ("tp",), "pp": ("pp",), "cp": ("cp",),
    "cp-kernel": ("cp-kernel",), "cp-modes": ("cp-modes",), "syncs": ("syncs",),
    "ep": ("ep", "ep-overlap"), "experts": ("experts",),
    "parallel": ("tp", "pp", "cp", "ep", "ep-overlap"), "ckpt": ("ckpt",), "ckpt-share": ("ckpt-share",), "debug": ("debug",), "zeropp": ("zeropp",),
    "recompute": ("recompute",), "scaling": ("scaling",), "compile": ("compile",), "init": ("init",),
    "optim": ("optim",), "optim-ops": ("optim-ops",), "documents": ("documents",),
    "prepare": ("prepare",), "ft": ("ft",), "plan": ("plan",), "plan-published": ("plan-published",),
    "fp8": ("fp8",), "muon": ("muon",),
    "all": ("ddp", "zero", "tp", "pp", "cp", "ep", "ep-overlap", "ckpt"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivefold bench",
                                     description="Time fivefold against torch's reference implementations on local "
                                                 "gloo CPU ranks (one launch per benchmark, interleaved blocks).")
    d = DPSpec()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", default=None, help="model preset (ddp, zero, tp: small; pp: tiny)")
    common.add_argument("--steps", type=int, default=None, help="timed steps per implementation")
    common.add_argument("--warmup", type=int, default=None, help="untimed steps per implementation (tp, pp: >= 1)")
    common.add_argument("--repeats", type=int, default=None,
                        help=f"alternating blocks the timed steps are split into (ddp {d.repeats}, zero 16, tp "
                             f"{TPSpec().repeats}, pp {PPSpec().repeats})")
    common.add_argument("--seq-len", type=int, default=None)
    common.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    common.add_argument("--json", metavar="PATH", help="also write the full result(s) (every step) as JSON")
    micro = argparse.ArgumentParser(add_help=False)
    micro.add_argument("--micro-batch", type=int, default=None,
                       help=f"sequences per rank per step (ddp, zero: {d.micro_batch}) or per micro-batch "
                            f"(pp: {PPSpec().micro_batch})")
    dp_opts = argparse.ArgumentParser(add_help=False)
    dp_opts.add_argument("--world", type=int, default=None, help=f"number of gloo ranks ({d.world})")
    dp_opts.add_argument("--bucket-mb", type=float, default=None, help=f"gradient bucket size ({d.bucket_mb})")
    zero_opts = argparse.ArgumentParser(add_help=False)
    zero_opts.add_argument("--stages", default=None, help="comma-separated ZeRO stages to run (0,1,2,3)")
    zero_opts.add_argument("--prefetch", type=int, default=None, help=f"fivefold ZeRO-3 prefetch depth ({d.prefetch})")
    zero_opts.add_argument("--keep", action="store_true",
                           help="also ZeRO-3 keeping the gathered units from forward to backward (fivefold's "
                                "zero.reshard_after_forward false vs FSDP2's reshard_after_forward=False)")
    zpp = ZeroPPSpec()
    zeropp_opts = argparse.ArgumentParser(add_help=False)
    zeropp_opts.add_argument("--world", type=int, default=None, help=f"number of gloo ranks ({zpp.world})")
    zeropp_opts.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                             help=f"parameters and gradients ({zpp.dtype})")
    zeropp_opts.add_argument("--quant-block", type=int, default=None, help=f"int8 block size ({zpp.quant_block})")
    zeropp_opts.add_argument("--hpz", type=int, default=None, help=f"hpZ group size, 0: no hpZ ({zpp.hpz})")
    tp_opts = argparse.ArgumentParser(add_help=False)
    tp_opts.add_argument("--tp", type=int, default=None, help="tensor-parallel degree = gloo ranks (2)")
    tp_opts.add_argument("--batch", type=int, default=None, help="sequences per step, every TP rank (8)")
    tp_opts.add_argument("--sp", default=None, choices=("both", "off", "on"), help="sequence parallel variants")
    pp_opts = argparse.ArgumentParser(add_help=False)
    pp_opts.add_argument("--pp", type=int, default=None, help="pipeline ranks (2)")
    pp_opts.add_argument("--microbatches", default=None, help="comma-separated M values (4,8)")
    pp_opts.add_argument("--schedules", default=None, help="comma-separated: gpipe,1f1b,interleaved,zb-h1")
    cp_opts = argparse.ArgumentParser(add_help=False)
    cp_opts.add_argument("--cp", type=int, default=None, help="context-parallel degree = gloo ranks (2)")
    cp_opts.add_argument("--seq-lens", default=None, help="comma-separated sequence lengths (2048,4096,8192)")
    ep_opts = argparse.ArgumentParser(add_help=False)
    ep_opts.add_argument("--ep", type=int, default=None, help="expert-parallel degree = dp = gloo ranks (2)")

    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("ddp", parents=[common, micro, dp_opts], help="fivefold DDP vs torch DistributedDataParallel")
    zp = sub.add_parser("zero", parents=[common, micro, dp_opts, zero_opts],
                        help="fivefold ZeRO 0/1/2/3 vs torch DDP / ZeroRedundancyOptimizer / FSDP2")
    zp.add_argument("--only", default=None,
                    help="comma-separated contestant names to run, e.g. fivefold-z3 (alone: its own processes, no "
                         "other contestant's memory around)")
    sub.add_parser("zeropp", parents=[common, micro, zeropp_opts],
                   help="fivefold ZeRO-3 with ZeRO++ qwZ / qgZ / hpZ vs plain ZeRO-3 (bytes, time, hpZ memory)")
    sub.add_parser("offload", parents=[common, micro, dp_opts, zero_opts],
                   help="fivefold ZeRO-2/3 with the optimizer offloaded / constant buffers vs without")
    sub.add_parser("optim", parents=[common, dp_opts],
                   help="the optimizer step alone on the CPU (bench-120m): 1 MiB segments vs whole shards")
    ops = sub.add_parser("optim-ops", parents=[common, dp_opts, zero_opts],
                         help="operations one optimizer step dispatches, DDP / ZeRO-3 (meta device, fake group)")
    ops.add_argument("--foreach", action="store_true", help="the multi-tensor kernels meta has, not fused ones")
    sub.add_parser("tp", parents=[common, tp_opts], help="fivefold TP/SP vs torch DTensor TP")
    sub.add_parser("pp", parents=[common, micro, pp_opts], help="fivefold schedules vs torch.distributed.pipelining")
    sub.add_parser("cp", parents=[common, cp_opts], help="fivefold ring attention vs all-gather K/V (context parallel)")
    cm_ = CPModesSpec()
    cmp = sub.add_parser("cp-modes", parents=[common],
                         help="ring attention vs Ulysses vs the ring × Ulysses hybrid (context parallel, cp 4)")
    cmp.add_argument("--cp", type=int, default=None, help=f"context-parallel degree = gloo ranks ({cm_.cp})")
    cmp.add_argument("--seq-lens", default=None,
                     help=f"comma-separated sequence lengths ({','.join(map(str, cm_.seq_lens))})")
    cmp.add_argument("--hybrid-ulysses", type=int, default=None,
                     help=f"the hybrid's Ulysses degree (ring: cp / it) ({cm_.hybrid_ulysses})")
    cmp.add_argument("--long-steps", type=int, default=None,
                     help=f"timed steps at seq_len >= {cm_.long_from} (default: --steps)")
    ck_ = CPKernelSpec()
    ckp = sub.add_parser("cp-kernel", parents=[common],
                         help="ring attention's block kernels side by side on one device (fused vs fp32 math)")
    ckp.add_argument("--cp", type=int, default=None, help=f"context-parallel degree emulated by blocks ({ck_.cp})")
    ckp.add_argument("--device", default=None, help="auto (the accelerator, else the CPU), cpu, cuda, ...")
    ckp.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"), help=f"inputs ({ck_.dtype})")
    ckp.add_argument("--heads", type=int, default=None, help=f"query heads ({ck_.heads})")
    ckp.add_argument("--kv-heads", type=int, default=None, help=f"kv heads ({ck_.kv_heads})")
    ckp.add_argument("--head-dim", type=int, default=None, help=f"head dimension ({ck_.head_dim})")
    ckp.add_argument("--batch", type=int, default=None, help=f"sequences ({ck_.batch})")
    ckp.add_argument("--kernels", default=None, help="comma-separated parallel.cp_kernel choices (flash,math)")
    ckp.add_argument("--dry-run", action="store_true",
                     help="a CPU-sized run (1k tokens, 4/2 heads of 64, fp32, 3 steps); other options still apply")
    sub.add_parser("ep", parents=[common, micro, ep_opts], help="Llama-MoE: experts over ep vs replicated experts")
    sub.add_parser("experts", parents=[common],
                   help="one MoE layer: experts as a grouped matmul / padded bmm vs the loop (forward + backward)")
    sub.add_parser("parallel", parents=[common, micro, tp_opts, pp_opts, cp_opts, ep_opts], help="tp, pp, cp, ep")
    sub.add_parser("debug", parents=[common], help="what --debug.collectives costs per collective")
    sy = sub.add_parser("syncs", parents=[common],
                        help="host syncs per training step, per layout (simulated: fake group, meta device)")
    sy.add_argument("--layouts", default=None, help="comma-separated layouts of bench/host_syncs.py (all)")
    rc = sub.add_parser("recompute", parents=[common, micro],
                        help="activation recompute none/full/selective and torch's: memory and step time")
    rc.add_argument("--cores", default=None, help="comma-separated attention cores (eager,sdpa)")
    sc = sub.add_parser("scaling", parents=[common, micro],
                        help="DDP / ZeRO-3 / TP 2 at three model sizes: fivefold/torch, step/ideal, MFU")
    sc.add_argument("--presets", default=None, help="comma-separated model presets (small,bench-40m,bench-120m)")
    sc.add_argument("--worlds", default=None, help="comma-separated DDP worlds (2,4)")
    co = sub.add_parser("compile", parents=[common],
                        help="train.compile: torch.compile'd blocks vs eager ones, per layout (step time, first step)")
    co.add_argument("--layouts", default=None, help="comma-separated: ddp,zero3,tp2,pp2 (all)")
    co.add_argument("--world", type=int, default=None, help=f"gloo ranks ({CompileSpec().world})")
    co.add_argument("--batch", type=int, default=None, help=f"sequences per step ({CompileSpec().batch})")
    for name, what in (("fp8", "FP8 linears (tensorwise, rowwise; ZeRO-3 + FP8 gathers) vs bf16, per layout"),
                       ("muon", "Muon (whole matrices owned) vs AdamW under ZeRO-1")):
        nu = sub.add_parser(name, parents=[common], help=what)
        nu.add_argument("--world", type=int, default=None, help=f"gloo ranks ({NumericsSpec().world})")
        nu.add_argument("--batch", type=int, default=None, help=f"sequences per step ({NumericsSpec().batch})")
        if name == "fp8":
            nu.add_argument("--layouts", default=None, help="comma-separated: ddp,zero3 (all)")
    do = sub.add_parser("documents", parents=[common],
                        help="attention inside packed documents (one process): masked cores vs causal SDPA")
    do.add_argument("--seq-lens", default=None, help="comma-separated sequence lengths (2048,8192)")
    do.add_argument("--eager-max-len", type=int, default=None, help="longest L eager runs at (2048)")
    sub.add_parser("init", parents=[common], help="start-up's initial values drawn on the CPU (1 thread) vs an accelerator")
    prp = sub.add_parser("prepare", parents=[common],
                         help="fivefold prepare (1, 2 workers) vs a tokenizers encode_batch loop: tokens/s")
    prp.add_argument("--mb", type=float, default=None, help=f"MiB of stdlib sources ({PrepareSpec().mb:g})")
    sub.add_parser("ft", parents=[common],
                   help="ft.replica_groups: step time off vs on, a group's death to the next step")
    ck = sub.add_parser("ckpt", parents=[common], help="checkpoint save (sync, async), load and export costs")
    ck.add_argument("--max-shard-mb", type=float, default=None, help="export's largest safetensors file (8)")
    sub.add_parser("ckpt-share", parents=[common], help="the share of a run's time its default saves take")
    pl = sub.add_parser("plan", parents=[common],
                        help="fivefold plan's step time vs measured steps of the test layouts on this CPU")
    pl.add_argument("--layouts", help="comma-separated names of tests/plan_layouts.py's LAYOUTS (default: all)")
    sub.add_parser("plan-published", parents=[common],
                   help="fivefold plan beside published runs (bench/published_runs.py): throughput, memory")
    sub.add_parser("all", parents=[common, micro, dp_opts, zero_opts, tp_opts, pp_opts, cp_opts, ep_opts],
                   help="ddp, zero, tp, pp, cp, then ep (--preset and the other common options apply to every one)")
    return parser


def _given(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _runs(args: argparse.Namespace) -> dict[str, tuple[Callable[[], dict], Callable[[dict], str]]]:
    """name -> (run the benchmark, format its result), in the order ``args.what`` asks for them."""
    opt = vars(args)  # the options of this subcommand (absent ones are None)
    common = _given(preset=args.preset, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                    seq_len=args.seq_len, threads=args.threads)
    dp = _given(world=opt.get("world"), micro_batch=opt.get("micro_batch"), bucket_mb=opt.get("bucket_mb"))
    stages = tuple(int(s) for s in (opt.get("stages") or "0,1,2,3").split(",") if s.strip())
    offload_stages = tuple(int(s) for s in (opt.get("stages") or "2,3").split(",") if s.strip())
    zero = _given(prefetch=opt.get("prefetch"))
    sp = {"both": (False, True), "off": (False,), "on": (True,), None: None}[opt.get("sp")]
    tp = _given(tp=opt.get("tp"), batch=opt.get("batch"), sequence_parallel=sp)
    microbatches, schedules = opt.get("microbatches"), opt.get("schedules")
    pp = _given(pp=opt.get("pp"), micro_batch=opt.get("micro_batch"),
                microbatches=tuple(int(m) for m in microbatches.split(",")) if microbatches else None,
                schedules=tuple(s.strip() for s in schedules.split(",")) if schedules else None)
    seq_lens = opt.get("seq_lens")
    cp = _given(cp=opt.get("cp"), seq_lens=tuple(int(n) for n in seq_lens.split(",")) if seq_lens else None)
    cp_common = {k: v for k, v in common.items() if k != "seq_len"}  # cp runs each of --seq-lens
    every: dict[str, tuple[Callable[[], dict], Callable[[dict], str]]] = {
        "ddp": (lambda: bench_ddp(**common, **dp), format_table),
        "zero": (lambda: bench_zero(**common, **dp, stages=stages, **zero, keep=bool(opt.get("keep")),
                                    only=tuple(n.strip() for n in opt["only"].split(",")) if opt.get("only") else None),
                 format_table),
        "zeropp": (lambda: bench_zeropp(ZeroPPSpec(**common, **_given(
            world=opt.get("world"), micro_batch=opt.get("micro_batch"), dtype=opt.get("dtype"),
            quant_block=opt.get("quant_block"), hpz=opt.get("hpz")))), format_zeropp_table),
        "offload": (lambda: bench_offload(**common, **dp, stages=offload_stages), format_offload_table),
        "optim": (lambda: bench_optimizer(**_given(preset=args.preset, steps=args.steps, warmup=args.warmup,
                                                   repeats=args.repeats, threads=args.threads,
                                                   bucket_mb=opt.get("bucket_mb"))), format_optimizer_table),
        "optim-ops": (lambda: optimizer_ops(**_given(preset=args.preset, world=opt.get("world"),
                                                     bucket_mb=opt.get("bucket_mb")),
                                            stages=tuple(int(s) for s in (opt.get("stages") or "0,3").split(",")),
                                            fused=not opt.get("foreach")), format_optimizer_ops_table),
        "tp": (lambda: bench_tp(TPSpec(**common, **tp)), format_tp_table),
        "pp": (lambda: bench_pp(PPSpec(**common, **pp)), format_pp_table),
        "cp": (lambda: bench_cp(CPSpec(**cp_common, **cp)), format_cp_table),
        "cp-kernel": (lambda: bench_cp_kernels(_cp_kernel_spec(args)), format_cp_kernel_table),
        "cp-modes": (lambda: bench_cp_modes(CPModesSpec(**cp_common, **cp, **_given(
            hybrid_ulysses=opt.get("hybrid_ulysses"), long_steps=opt.get("long_steps")))), format_cp_modes_table),
        "ep": (lambda: bench_ep(EPSpec(**common, **_given(ep=opt.get("ep"), micro_batch=opt.get("micro_batch")))),
               format_ep_table),
        "experts": (lambda: bench_experts(ExpertsSpec(**_given(
            steps=args.steps, warmup=args.warmup, repeats=args.repeats, threads=args.threads))),
            format_experts_table),
        "ep-overlap": (lambda: bench_ep_overlap(EPOverlapSpec(**common, **_given(ep=opt.get("ep")))),
                       format_ep_overlap_table),
        "debug": (lambda: bench_debug(DebugSpec(**_given(repeats=args.repeats, threads=args.threads))),
                  format_debug_table),
        "recompute": (lambda: bench_recompute(RecomputeSpec(**common, **_given(
            micro_batch=opt.get("micro_batch"),
            cores=tuple(c.strip() for c in opt["cores"].split(",")) if opt.get("cores") else None))),
            format_recompute_table),
        "scaling": (lambda: bench_scaling(ScaleSpec(**_given(
            steps=args.steps, warmup=args.warmup, repeats=args.repeats, seq_len=args.seq_len, threads=args.threads,
            micro_batch=opt.get("micro_batch"),
            presets=tuple(p.strip() for p in opt["presets"].split(",")) if opt.get("presets") else None,
            worlds=tuple(int(w) for w in opt["worlds"].split(",")) if opt.get("worlds") else None))),
            format_scaling_table),
        "compile": (lambda: bench_compile(CompileSpec(**common, **_given(
            world=opt.get("world"), batch=opt.get("batch"),
            layouts=tuple(s.strip() for s in opt["layouts"].split(",")) if opt.get("layouts") else None))),
            format_compile_table),
        "fp8": (lambda: bench_fp8(NumericsSpec(**common, **_given(
            world=opt.get("world"), batch=opt.get("batch"),
            layouts=tuple(s.strip() for s in opt["layouts"].split(",")) if opt.get("layouts") else None))),
            format_fp8_table),
        "muon": (lambda: bench_muon(NumericsSpec(**common, **_given(
            world=opt.get("world"), batch=opt.get("batch"), param="fp32"))), format_muon_table),
        "documents": (lambda: bench_documents(DocumentsSpec(**_given(
            steps=args.steps, warmup=args.warmup, repeats=args.repeats, threads=args.threads,
            eager_max_len=opt.get("eager_max_len"),
            seq_lens=tuple(int(n) for n in seq_lens.split(",")) if seq_lens else None))),
            format_documents_table),
        "syncs": (lambda: bench_syncs(tuple(n.strip() for n in opt["layouts"].split(",")) if opt.get("layouts")
                                      else None), format_syncs_table),
        "init": (lambda: bench_init(InitSpec(**_given(preset=args.preset, repeats=args.repeats,
                                                      threads=args.threads))), format_init_table),
        "prepare": (lambda: bench_prepare(PrepareSpec(**_given(repeats=args.repeats, mb=opt.get("mb")))),
                    format_prepare_table),
        "ft": (lambda: bench_ft(FtSpec(**_given(preset=args.preset, steps=args.steps, warmup=args.warmup,
                                                repeats=args.repeats, seq_len=args.seq_len))),
               format_ft_table),
        "ckpt": (lambda: bench_checkpoint(CheckpointSpec(**_given(
            preset=args.preset, repeats=args.repeats, seq_len=args.seq_len, threads=args.threads,
            max_shard_mb=opt.get("max_shard_mb")))), format_checkpoint_table),
        "plan": (lambda: bench_plan(PlanSpec(**_given(
            steps=args.steps, warmup=args.warmup,
            layouts=tuple(s.strip() for s in opt["layouts"].split(",")) if opt.get("layouts") else None))),
            format_plan_table),
        "plan-published": (bench_published, format_published_table),
        "ckpt-share": (lambda: bench_save_share(SaveShareSpec(**_given(
            preset=args.preset, steps=args.steps, seq_len=args.seq_len))), format_save_share_table),
    }
    return {name: every[name] for name in WHAT[args.what]}


def _cp_kernel_spec(args: argparse.Namespace) -> CPKernelSpec:
    given = _given(seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, threads=args.threads, cp=args.cp,
                   device=args.device, dtype=args.dtype, heads=args.heads, kv_heads=args.kv_heads,
                   head_dim=args.head_dim, batch=args.batch,
                   kernels=tuple(k.strip() for k in args.kernels.split(",")) if args.kernels else None)
    return CPKernelSpec.dry_run(**given) if args.dry_run else CPKernelSpec(**given)


def main(argv: Sequence[str] | None = None) -> int:
    """``fivefold bench {ddp,zero,zeropp,tp,pp,cp,ep,parallel,all} [options]`` / ``python bench/run.py ...``: print the
    tables."""
    args = _parser().parse_args(argv)
    runs = _runs(args)
    results = {}
    for name, (run, fmt) in runs.items():
        t0 = time.perf_counter()
        results[name] = run()
        if len(runs) > 1:
            print(f"## {name}\n")
        print(fmt(results[name]))
        print(f"(wall time {time.perf_counter() - t0:.0f} s)\n", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results if len(results) > 1 else next(iter(results.values())), fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
