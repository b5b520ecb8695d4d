"""GPU benchmarks for kdtree_ops (pytest-benchmark). Run: ``python -m pytest bench_ops.py``.

Each benchmark times the op by CUDA-graph replay (median of many, launch gaps removed),
reports effective GB/s and TFLOP/s beside ceilings measured in the same run, and stores them
in ``benchmark.extra_info``; the summary table is printed at the end and written as JSON to
``$KDTREE_BENCH_JSON`` when set.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
from typing import Optional, Sequence

import pytest
import torch

import defrag
import kdtree_ops
import sglang_hook
import testkit
from kdtree_ops import (MLA_QK_DIM, MLA_V_DIM, Tree, accept_retrieve, accept_walk, build, build_tree, cache_root,
                        cuda_available, draft_topk, flat_mask_size, merge_state, move_kv, pack_tree_mask,
                        sglang_build_tree, verify_attn, verify_metadata)
from testkit import (ROW_TOL, assert_same_round, cpu_time_ms, ddtree_batch, ddtree_logits, ddtree_round,
                     ddtree_targets, event_time_ms, gpu_time_ms, make_verify_case, median_ms, rel_err, rows_close,
                     sglang_flat_mask, verify_args)

pytestmark = pytest.mark.skipif(
    not kdtree_ops.cuda_available(), reason="benchmarks need a CUDA GPU and the built kernels"
)

RESULTS: list[dict] = []


_CEILINGS: dict[str, float] = {}


def copy_ceiling_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written), measured once per run."""
    if "copy" not in _CEILINGS:
        src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
        dst = torch.empty_like(src)
        # events, not graph replay: a captured device copy can become a copy-engine node
        ms = event_time_ms(lambda: dst.copy_(src), reps=20)
        _CEILINGS["copy"] = 2 * src.numel() * 2 / ms / 1e6
        del src, dst
    return _CEILINGS["copy"]


def matmul_ceiling_tflops() -> float:
    """bf16 matrix-product rate on random data, measured once per run."""
    if "mm" not in _CEILINGS:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = gpu_time_ms(lambda: a @ b, reps=10, graph_calls=3)
        _CEILINGS["mm"] = 2 * n**3 / ms / 1e9
    return _CEILINGS["mm"]


def report(benchmark, name: str, ms: float, nbytes: float = 0.0, flops: float = 0.0, **extra) -> dict:
    """Record one measurement: time, GB/s and TFLOP/s and their % of the measured ceilings."""
    row = {"name": name, "ms": ms, **extra}
    if nbytes:
        row["GB/s"] = nbytes / ms / 1e6
        row["%copy"] = 100 * row["GB/s"] / copy_ceiling_gbs()
    if flops:
        row["TFLOP/s"] = flops / ms / 1e9
        row["%mm"] = 100 * row["TFLOP/s"] / matmul_ceiling_tflops()
    RESULTS.append(row)
    if benchmark is not None:
        benchmark.extra_info.update(row)
    return row


def run(benchmark, fn) -> None:
    """Let pytest-benchmark time a few synchronised calls too (its own wall-clock view)."""

    def call():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=5, iterations=1, warmup_rounds=1)


@pytest.fixture(scope="session", autouse=True)
def summary():
    yield
    if not RESULTS:
        return
    ceil = {"copy GB/s": _CEILINGS.get("copy"), "bf16 mm TFLOP/s": _CEILINGS.get("mm")}
    print(f"\n\nceilings measured this run: {ceil}  device: {torch.cuda.get_device_name()}")
    keys = ["ms", "GB/s", "%copy", "TFLOP/s", "%mm"]
    extra = sorted({k for r in RESULTS for k in r} - set(keys) - {"name"})
    print(f"{'name':58s}" + "".join(f"{k:>11s}" for k in keys + extra))
    for r in RESULTS:
        cells = [r.get(k) for k in keys + extra]
        print(f"{r['name']:58s}" + "".join(f"{c:>11.4g}" if isinstance(c, float) else f"{str(c or ''):>11s}" for c in cells))
    if FP8_RESULTS:
        print_fp8_table()
    path = os.environ.get("KDTREE_BENCH_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": ceil, "results": RESULTS,
                       "fp8": FP8_RESULTS}, f, indent=1)


FP8_COLUMNS = (("bf16_ms", "bf16 pool ms"), ("fp8_ms", "fp8 pool ms"), ("fp8_speedup", "bf16/fp8"),
               ("sglang_fp8_ms", "SGLang fp8 ms"), ("speedup_vs_sglang", "SGLang/ours"),
               ("err_fp8", "err ours"), ("err_sglang_fp8", "err SGLang"))


def print_fp8_table() -> None:
    """verify_attn on a bf16 pool vs the same rows in an fp8 pool vs SGLang's Triton fp8 verify;
    errors are relative to the float64 reference on the dequantized rows."""
    print(f"\nverify_attn over an fp8 KV pool (k_scale {FP8_K_SCALE}; cold: >= {COLD_BYTES / 1e6:.0f} MB of fp8 rows rotated)")
    print(f"{'shape':30s}{'L2':>6s}" + "".join(f"{title:>15s}" for _, title in FP8_COLUMNS))
    for r in FP8_RESULTS:
        cells = [r.get(key) for key, _ in FP8_COLUMNS]
        print(f"{r['shape']:30s}{r['L2']:>6s}" + "".join(f"{c:>15.4g}" if isinstance(c, float) else f"{'':>15s}" for c in cells))


# ---- merge_state ----


@pytest.mark.parametrize("T,H,D", [(8192, 16, 512), (131072, 1, 512), (1024, 128, 512)])
def test_bench_merge_state(benchmark, T, H, D):
    def inputs():
        v = [torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        s = [torch.randn(T, H, device="cuda") for _ in range(2)]
        return v[0], s[0], v[1], s[1]

    sets = [inputs() for _ in range(2)]  # alternate input sets so L2 never holds the data
    state = {"i": 0}

    def fn():
        state["i"] ^= 1
        return kdtree_ops.merge_state(*sets[state["i"]])

    ms = gpu_time_ms(fn)
    nbytes = 3 * T * H * D * 2 + 3 * T * H * 4
    report(benchmark, f"merge_state bf16 T={T} H={H} D={D}", ms, nbytes=nbytes)
    run(benchmark, fn)


# ---- verify attention ----


VERIFY_BENCH = [  # (batch, heads, nodes, context)
    (1, 16, 9, 4096),
    (1, 16, 9, 8192),
    (1, 16, 9, 16384),
    (1, 16, 9, 32768),
    (1, 16, 9, 65536),
    (1, 16, 9, 131072),
    (1, 128, 9, 131072),
    (1, 128, 65, 32768),
    (1, 16, 257, 32768),
    (8, 16, 9, 65536),
    (1, 16, 1025, 32768),
]


def sglang_verify(case, N, kv_cache=None, k_scale: float = 1.0):
    """SGLang 0.5.23's TARGET_VERIFY call for MLA: extend_attention_fwd with the flat mask (the
    same call the main job times), over the case's pool or ``kv_cache`` (an fp8 pool with its
    ``k_scale``)."""
    flat, mask_indptr = sglang_flat_mask(case)
    T, H, _ = case["q"].shape
    o = torch.empty(T, H, 512, device="cuda", dtype=case["q"].dtype)
    args = verify_args(case)
    if kv_cache is not None:
        args[1] = kv_cache
    return sglang_extend_attention(*args[:6], flat.cuda(), mask_indptr.cuda(), N, case["sm_scale"], o,
                                   k_scale=k_scale)


@pytest.mark.parametrize("B,H,N,ctx", VERIFY_BENCH)
def test_bench_verify_attn(benchmark, B, H, N, ctx):
    case = make_verify_case([ctx] * B, [N] * B, H)
    T = B * N
    out = torch.empty(T, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(T, H, device="cuda")
    args = verify_args(case)

    def ours():
        return kdtree_ops.verify_attn(*args, out=out, lse=lse, max_kv_len=ctx)

    ms = gpu_time_ms(ours, reps=30)
    nbytes = B * ctx * 1152 + T * H * (576 + 512) * 2
    flops = B * N * H * (ctx + N) * 2 * (576 + 512)
    extra = {}
    theirs = sglang_verify(case, N)  # None without SGLang's kernels: ours are still timed
    if theirs is not None:
        sg_ms = event_time_ms(theirs, reps=5)
        extra = {"sglang_ms": sg_ms, "speedup": sg_ms / ms, "err_vs_sglang": rel_err(ours()[0], theirs())}
        report(None, f"sglang extend_attention_fwd B={B} H={H} N={N} ctx={ctx}", sg_ms, nbytes=nbytes, flops=flops)
    report(benchmark, f"verify_attn B={B} H={H} N={N} ctx={ctx}", ms, nbytes=nbytes, flops=flops, **extra)
    run(benchmark, ours)
    del case
    torch.cuda.empty_cache()


# ---- verify attention over an fp8 KV pool ----
# `python -m pytest -s bench_ops.py -k verify_attn_fp8` runs these rows alone.


FP8_BENCH = [  # (batch, heads, nodes, context): the FlashMLA table's shapes, then two memory-bound ones
    (1, 16, 9, 4096),
    (1, 16, 9, 32768),
    (1, 16, 9, 131072),
    (1, 128, 9, 131072),
    (1, 128, 1, 131072),
    (1, 128, 65, 32768),
    (1, 16, 257, 32768),
    (8, 16, 9, 65536),
    (64, 128, 1, 8192),
    (64, 16, 1, 8192),
    (16, 16, 4, 32768),
]
FP8_K_SCALE = 0.5  # the pool holds kv / 0.5 in e4m3, as SGLang stores k / layer.k_scale
COLD_BYTES = 240e6  # a cold run rotates over at least this many bytes of prefix rows per pool (L2: 50-60 MB)


class Fp8VerifySet:
    """One verify batch three ways: ours on the bf16 pool, ours on the same rows quantized
    to an fp8 pool, SGLang's Triton extend_attention_fwd on that fp8 pool with k/v descale
    (None without SGLang's kernels)."""

    def __init__(self, B, H, N, ctx, seed):
        case = make_verify_case([ctx] * B, [N] * B, H, seed=seed)
        self.case, self.ctx = case, ctx
        self.kv8 = testkit.e4m3_bytes(case["kv_cache"], FP8_K_SCALE)  # unused slots: NaN bytes, as in the bf16 pool
        self.out = torch.empty(B * N, H, MLA_V_DIM, device="cuda", dtype=torch.bfloat16)
        self.lse = torch.empty(B * N, H, device="cuda")
        self.sglang = sglang_verify(case, N, self.kv8, FP8_K_SCALE)

    def ours(self, fp8: bool):
        c = self.case
        return kdtree_ops.verify_attn(c["q"], self.kv8 if fp8 else c["kv_cache"], c["kv_indptr"], c["kv_indices"],
                                      c["qo_indptr"], c["tree_k"], c["tree_mask"], c["sm_scale"], out=self.out,
                                      lse=self.lse, max_kv_len=self.ctx, k_scale=FP8_K_SCALE if fp8 else None)[0]

    def errors(self) -> dict:
        """Relative error against the float64 reference on the dequantized rows, of ours on
        the fp8 pool and of SGLang's fp8 kernel (which rounds q and P to e4m3 as well)."""
        c = self.case
        ref, _ = kdtree_ops.verify_attn_reference(c["q"].double(), self.kv8, c["kv_indptr"], c["kv_indices"],
                                                  c["qo_indptr"], c["tree_k"].double(), c["tree_mask"], c["sm_scale"],
                                                  k_scale=FP8_K_SCALE)
        err = {"err_fp8": rel_err(self.ours(True), ref)}
        if self.sglang is not None:
            err["err_sglang_fp8"] = rel_err(self.sglang(), ref)
        return err


def rotating(sets, fn):
    """A zero-argument call that runs fn on the next set each time: captured once per set in
    one graph (gpu_time_ms with graph_calls=len(sets)), every replay streams all of them."""
    state = {"i": -1}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(sets[state["i"]])

    return call


FP8_RESULTS: list[dict] = []  # one row per shape and L2 state, for the fp8 summary table


@pytest.mark.parametrize("B,H,N,ctx", FP8_BENCH)
def test_bench_verify_attn_fp8(benchmark, B, H, N, ctx):
    """Ours on a bf16 pool vs ours on the same rows in an fp8 pool vs SGLang's Triton fp8
    verify, CUDA-graph replay; cold rotates over >= COLD_BYTES of fp8 prefix rows, hot repeats
    one batch."""
    T = B * N
    fp8_bytes, bf16_bytes = B * ctx * MLA_QK_DIM, B * ctx * MLA_QK_DIM * 2
    io_bytes = T * H * (MLA_QK_DIM + MLA_V_DIM) * 2
    flops = B * N * H * (ctx + N) * 2 * (MLA_QK_DIM + MLA_V_DIM)
    sets = [Fp8VerifySet(B, H, N, ctx, seed) for seed in range(max(2, math.ceil(COLD_BYTES / fp8_bytes)))]
    shape = f"B={B} H={H} N={N} ctx={ctx}"
    rows = {}
    for mode, use in (("cold", sets), ("hot", sets[:1])):
        calls = len(use) if mode == "cold" else 5
        bf16_ms = gpu_time_ms(rotating(use, lambda s: s.ours(False)), reps=30, graph_calls=calls)
        fp8_ms = gpu_time_ms(rotating(use, lambda s: s.ours(True)), reps=30, graph_calls=calls)
        row = {"shape": shape, "L2": mode, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "fp8_speedup": bf16_ms / fp8_ms}
        report(None, f"verify_attn bf16 pool {shape} {mode}", bf16_ms, nbytes=bf16_bytes + io_bytes, flops=flops)
        if sets[0].sglang is not None:
            sg_ms = gpu_time_ms(rotating(use, lambda s: s.sglang()), reps=5, graph_calls=calls)
            row.update(sglang_fp8_ms=sg_ms, speedup_vs_sglang=sg_ms / fp8_ms)
            report(None, f"sglang triton fp8 {shape} {mode}", sg_ms, nbytes=fp8_bytes + io_bytes, flops=flops)
        rows[mode] = report(None, f"verify_attn fp8 pool {shape} {mode}", fp8_ms, nbytes=fp8_bytes + io_bytes,
                            flops=flops, **{k: v for k, v in row.items() if k not in ("shape", "L2", "fp8_ms")})
        FP8_RESULTS.append(row)
    errors = sets[0].errors()
    FP8_RESULTS[-1].update(errors)
    FP8_RESULTS[-2].update(errors)
    benchmark.extra_info.update(cold=rows["cold"], hot=rows["hot"], **errors)
    run(benchmark, lambda: sets[0].ours(True))
    sets.clear()  # the next shape's sets need the memory
    torch.cuda.empty_cache()



# ---- tree ops ----


TREE_B, TREE_L, TREE_V = 8, 15, 32000


def tree_bench_inputs(budget: int, seed: int = 0, sharpness: float = 3.0):
    """Draft top-K (K = budget) from peaked random logits, as a DFlash drafter would give;
    higher sharpness gives deeper trees with more candidates per depth."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(TREE_B, TREE_L, TREE_V, device="cuda", generator=g) * sharpness
    lp, tok = kdtree_ops.draft_topk(logits, budget)
    root = torch.randint(0, TREE_V, (TREE_B,), device="cuda", generator=g)
    return lp, tok, root


@pytest.mark.parametrize("budget,sharpness", [(16, 3), (64, 3), (512, 3), (1024, 3), (512, 8), (1024, 8)])
def test_bench_build_tree(benchmark, budget, sharpness):
    """Batch 8, L = 15: the GPU build vs the per-request CPU heapq build (the reference)."""
    lp, tok, root = tree_bench_inputs(budget, sharpness=sharpness)
    ms = gpu_time_ms(lambda: kdtree_ops.build_tree(lp, tok, root, budget))
    args_cpu = [t.cpu() for t in (lp, tok, root)]
    cpu_ms = cpu_time_ms(lambda: kdtree_ops.build_tree(*args_cpu, budget), reps=3)
    depth = kdtree_ops.build_tree(lp, tok, root, budget).depths.max().item()  # GPU: no second heapq build
    report(benchmark, f"build_tree B={TREE_B} L={TREE_L} budget={budget} logits x{sharpness}", ms,
           cpu_heapq_ms=cpu_ms, speedup=cpu_ms / ms, max_depth=depth)
    run(benchmark, lambda: kdtree_ops.build_tree(lp, tok, root, budget))


@pytest.mark.parametrize("context", [1024, 131072])
@pytest.mark.parametrize("budget", [16, 64, 512, 1024])
def test_bench_verify_metadata(benchmark, budget, context):
    """Positions + EAGLE retrieve arrays + SGLang's flat custom mask vs the Python loop."""
    lp, tok, root = tree_bench_inputs(budget)
    tree = kdtree_ops.build_tree(lp, tok, root, budget)
    lens = [context - 17 * b for b in range(TREE_B)]  # unequal, so rows are misaligned
    prefix_lens = torch.tensor(lens, device="cuda")
    N = budget + 1
    size = kdtree_ops.flat_mask_size(sum(lens), TREE_B, N)

    def fn():
        return kdtree_ops.verify_metadata(tree, prefix_lens, retrieve=True, custom_mask_capacity=size)

    ms = gpu_time_ms(fn, reps=20, graph_calls=2)
    loop_ms = event_time_ms(lambda: python_metadata(tree, lens), reps=10)
    report(benchmark, f"verify_metadata B={TREE_B} budget={budget} ctx={context}", ms, nbytes=size,
           python_loop_ms=loop_ms, speedup=loop_ms / ms)
    run(benchmark, fn)


@pytest.mark.parametrize("budget", [64, 512, 1024])
def test_bench_accept_walk(benchmark, budget):
    lp, tok, root = tree_bench_inputs(budget)
    tree = kdtree_ops.build_tree(lp, tok, root, budget)
    target = tree.tokens[:, torch.randperm(budget + 1, device="cuda")].contiguous()
    ms = gpu_time_ms(lambda: kdtree_ops.accept_walk(tree, target, max_depth=TREE_L))
    report(benchmark, f"accept_walk B={TREE_B} budget={budget}", ms)
    run(benchmark, lambda: kdtree_ops.accept_walk(tree, target, max_depth=TREE_L))



# ---- kv movement ----



@pytest.mark.parametrize("disjoint", [True, False])
def test_bench_move_kv(benchmark, disjoint):
    """61 layers x 4096 moved slots of bf16 [S, 576] rows, scattered over a 14 GB pool.

    GB/s counts each moved row once read and once written (the work asked for); the
    overlapping path (disjoint=False) really moves twice that through its scratch buffer."""
    layers, n, S, D = 61, 4096, 200_000, 576
    kv = [torch.randn(S, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    perm = torch.randperm(S, device="cuda")
    if disjoint:
        src, dst = perm[:n], perm[n : 2 * n]
    else:
        src, dst = perm[:n], perm[n // 2 : n // 2 + n]  # half the destinations are also sources
    ms = gpu_time_ms(lambda: kdtree_ops.move_kv(kv, src, dst, disjoint=disjoint), reps=30)
    nbytes = 2 * layers * n * D * 2
    report(benchmark, f"move_kv bf16 {layers} layers x {n} slots disjoint={disjoint}", ms, nbytes=nbytes)
    run(benchmark, lambda: kdtree_ops.move_kv(kv, src, dst, disjoint=disjoint))


def verify_attn_defrag_effect(benchmark, prefix: int = 131072, heads: int = 16, nodes: int = 9, pool_gb: float = 40.0):
    """verify_attn over one request's prefix in a >= pool_gb pool: slots scattered at random
    versus one contiguous run (what defrag produces). Reports both and their ratio."""
    D = 576
    S = int(pool_gb * 1e9 / (D * 2)) + 1
    kv = torch.empty(S, D, device="cuda", dtype=torch.bfloat16)
    scattered = torch.randperm(S - 1, device="cuda")[:prefix] + 1
    start = int(torch.randint(1, S - prefix, (1,)))
    contiguous = torch.arange(start, start + prefix, device="cuda")
    for idx in (scattered, contiguous):  # never time on uninitialised (or zero) rows
        kv[idx] = torch.randn(prefix, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(nodes, heads, D, device="cuda", dtype=torch.bfloat16)
    tree_k = torch.randn(nodes, D, device="cuda", dtype=torch.bfloat16)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    tree_mask = kdtree_ops.pack_bits(kdtree_ops.ancestor_mask(parents), (nodes + 31) // 32).cuda()
    kv_indptr = torch.tensor([0, prefix], dtype=torch.int32, device="cuda")
    qo_indptr = torch.tensor([0, nodes], dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(192)
    nbytes = prefix * D * 2 + q.numel() * 2 + nodes * heads * 512 * 2
    times = {}
    for name, idx in (("scattered", scattered), ("defragmented", contiguous)):
        call = lambda idx=idx: kdtree_ops.verify_attn(q, kv, kv_indptr, idx, qo_indptr, tree_k, tree_mask, scale)  # noqa: E731
        times[name] = gpu_time_ms(call, reps=30)
        report(benchmark, f"verify_attn {name} slots {prefix // 1024}k H={heads} N={nodes} pool {pool_gb:.0f}GB", times[name], nbytes=nbytes)
    report(benchmark, "verify_attn defrag speedup (scattered/defragmented)", times["defragmented"],
           speedup=times["scattered"] / times["defragmented"])
    run(benchmark, lambda: kdtree_ops.verify_attn(q, kv, kv_indptr, contiguous, qo_indptr, tree_k, tree_mask, scale))
    del kv


@pytest.mark.skipif(not hasattr(kdtree_ops, "verify_attn"), reason="needs kdtree_ops.verify_attn")
def test_bench_verify_attn_defrag_effect(benchmark):
    verify_attn_defrag_effect(benchmark)


# ---- DDTree step: the PR's own code vs the same calls through the hook ----


def ddtree_step(pr, calls, batch, logits, verified, budget, target_logits, hidden):
    """testkit.ddtree_round timed: (prepare ms, verify ms, round) by CUDA events, so host work
    and syncs count; prepare_for_verify (slot allocation, the same in both) runs untimed."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def mark(i):
        if i == 2:
            torch.cuda.synchronize()
        events[i].record()

    torch.cuda.synchronize()
    round_ = ddtree_round(pr, calls, batch, logits, verified, budget, target_logits, hidden, bs_max=len(batch.reqs),
                         mark=mark)
    events[3].synchronize()
    return events[0].elapsed_time(events[1]), events[2].elapsed_time(events[3]), round_


@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("budget", [64, 256, 512])
@pytest.mark.parametrize("bs", [1, 8, 32])
def test_bench_ddtree_step(benchmark, bs, budget, context):
    """A DDTree step (L = 15, vocab 32000, peaked drafts) with SGLang PR #29907's functions vs
    through the hook (KDTREE_VERIFY=on), same inputs, same results (checked); median of reps.
    Needs SGLang with the PR importable; skipped otherwise."""
    pytest.importorskip("sglang")
    try:
        pr = testkit.ddtree_pr()
    except ImportError as e:
        pytest.skip(f"SGLang's DDTree (PR #29907) is not importable: {e}")
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    sglang_hook.uninstall()
    pr_calls, hooked, eagle_utils = pr.calls, pr.hooked, pr.eagle_utils
    L, V, D = 15, 32000, budget + 1
    g = torch.Generator().manual_seed(bs * 7 + budget)
    logits = ddtree_logits(bs, L, V, "peaked", g).cuda()
    verified = torch.randint(0, V, (bs,), generator=g).cuda()
    prefix = [context - 17 * b for b in range(bs)]
    hidden = torch.randn(bs * D, 256, device="cuda", dtype=torch.bfloat16)

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cuda", attention_backend="triton"), role="test",
            ranks=SpawnRanks(world_rank=0, dp_rank=None))
    native_verify = eagle_utils.verify_tree_greedy_func
    kernel = "SGLang's CUDA verify_tree_greedy"
    try:
        tree = pr_calls.build(draft_logits=logits, tree_budget=budget, device=torch.device("cuda"))
        target = ddtree_targets(tree[2], tree[0], V, g, follow=0.9).cuda()
        target_logits = torch.zeros(bs * D, V, device="cuda")
        target_logits.scatter_(1, target.reshape(-1, 1), 10.0)
        try:  # SGLang's own greedy tree-verify kernel needs its JIT toolchain; its Triton twin does not
            ddtree_step(pr, pr_calls, ddtree_batch("cuda", prefix, D, V), logits, verified, budget, target_logits, hidden)
        except Exception:
            eagle_utils.verify_tree_greedy_func = testkit.verify_tree_greedy_on_triton(pr.spec_tree)
            kernel = "SGLang's Triton verify_tree_greedy"

        def timed(calls, reps):
            ddtree_step(pr, calls, ddtree_batch("cuda", prefix, D, V), logits, verified, budget, target_logits, hidden)
            runs = [ddtree_step(pr, calls, ddtree_batch("cuda", prefix, D, V), logits, verified, budget, target_logits,
                                hidden) for _ in range(reps)]
            return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), runs[-1][2])

        pr_prep, pr_verify, theirs = timed(pr_calls, 5 if bs * budget >= 8192 else 10)
        sglang_hook.install("on")
        prep, verify, ours = timed(hooked, 20)
        counters = sglang_hook._STATE.ddtree
        assert counters.sglang == dict.fromkeys(sglang_hook.DDTREE_CALLS, 0), counters.summary()
    finally:
        sglang_hook.uninstall()
        eagle_utils.verify_tree_greedy_func = native_verify
        reset_context()
    assert_same_round(ours, theirs)
    accepted = statistics.mean(len(a) for a in theirs.vi.accepted_indices)
    nodes = theirs.tree[5].float().mean().item()
    report(benchmark, f"ddtree step bs={bs} B={budget} ctx={context}", prep + verify, pr_ms=pr_prep + pr_verify,
           speedup=(pr_prep + pr_verify) / (prep + verify), prep_ms=prep, pr_prep_ms=pr_prep, verify_ms=verify,
           pr_verify_ms=pr_verify, nodes=nodes, accepted=accepted, pr_verify_kernel=kernel)

# ---- the hooked verify step through SGLang's own metadata paths ----
# SGLang 0.5.23's TritonAttnBackend builds the TARGET_VERIFY metadata itself (eager
# init_forward_metadata, and its CUDA-graph path: init_cuda_graph_state, then
# init_forward_metadata_out_graph at capture and before each replay) over its real pools,
# allocator and KV index translator (testkit.py). Per layer, SGLang's own forward_extend
# (hook uninstalled) is timed against the hook in mode "on", eagerly and replayed from a CUDA
# graph captured as SGLang's graph runner captures (metadata first, a warm-up, then the
# layers), on the same batches; the replayed batch differs from the captured one.



# (verify input, batch, heads, nodes per request, context). "tree": an EAGLE topk > 1 verify
# input from SGLang's own draft-result organiser and tree builder (flat custom mask); "chain":
# a DFlash verify input (no mask).
REAL_METADATA_CASES = [
    ("tree", 1, 16, 9, 4096),
    ("tree", 1, 16, 9, 32768),
    ("tree", 1, 16, 9, 131072),
    ("tree", 1, 16, 65, 32768),
    ("tree", 1, 16, 65, 131072),
    ("tree", 1, 128, 9, 32768),
    ("tree", 8, 16, 9, 65536),
    ("chain", 1, 16, 16, 4096),
    ("chain", 1, 16, 16, 32768),
    ("chain", 1, 16, 16, 131072),
    ("chain", 1, 128, 16, 32768),
    ("chain", 8, 16, 16, 65536),
]
EAGLE_TREE_SHAPE = {9: (4, 3), 65: (8, 6)}  # nodes -> (topk, draft steps) of the EAGLE draft loop
REAL_METADATA_LAYERS = 4


def real_metadata_runner(tbd, kind: str, B: int, H: int, N: int, ctx: int, *, layers: int, device: str = "cuda",
                         dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """SGLang's target runner for one case, its server arguments published: pools for B
    requests of up to ctx prefix tokens plus N nodes each, every KV row random."""
    topk, steps = EAGLE_TREE_SHAPE[N] if kind == "tree" else (1, N - 1)
    tbd.publish_server(device, algorithm="EAGLE" if kind == "tree" else "DFLASH", num_draft_tokens=N, topk=topk,
                       steps=steps)
    runner = tbd.Runner(device=device, dtype=dtype, heads=H, layers=layers, num_tokens_per_req=N,
                        pool_size=B * (ctx + N) + 64, max_context=ctx + N + 64, max_reqs=B + 1)
    gen = torch.Generator(device=device).manual_seed(seed)
    for buf in runner.kv_pool.kv_buffer:
        buf.normal_(generator=gen)
    return runner, topk, steps


def real_metadata_batch(tbd, runner, kind: str, prefix_lens, N: int, topk: int, steps: int, g: torch.Generator):
    """One TARGET_VERIFY step laid out by SGLang's classes, and q, k, v for every layer."""
    seq = torch.tensor(prefix_lens, device=runner.device)
    if kind == "tree":
        spec = tbd.eagle_tree(runner, seq, topk=topk, steps=steps, num_draft_tokens=N, generator=g)
    else:
        spec = tbd.dflash_chain(seq, N, g)
    step = tbd.verify_step(runner, prefix_lens, spec, generator=g)
    return step, [tbd.layer_inputs(runner, step.T, g) for _ in range(runner.layers)]


def run_layers(backend, fb, layers, inputs) -> list:
    """forward_extend of every layer, as the model calls it: [T, H * 512] outputs."""
    return [backend.forward_extend(q, k, v, layer, fb) for layer, (q, k, v) in zip(layers, inputs)]


def index_dtypes(md) -> str:
    """The dtypes of the metadata tensors the hook reads, e.g. "qo_indptr:int64 ..."."""
    names = ("qo_indptr", "kv_indptr", "kv_indices", "mask_indptr", "custom_mask")
    return " ".join(f"{n}:{str(getattr(md, n).dtype).removeprefix('torch.')}" for n in names
                    if getattr(md, n) is not None)


def hook_counts() -> tuple:
    """(layer calls kdtree_ops served, calls left to SGLang) so far; (0, 0) with no hook."""
    st = sglang_hook._STATE
    return (st.ours, st.fallbacks) if st is not None else (0, 0)


def counted(fn):
    """fn()'s result and the (kdtree_ops, SGLang) split of the verify layer calls it made."""
    before = hook_counts()
    out = fn()
    after = hook_counts()
    return out, (after[0] - before[0], after[1] - before[1])


def served_by(counts: tuple, calls: int) -> str:
    """Who served the layer calls, for the results table."""
    ours, theirs = counts
    if (ours, theirs) == (calls, 0):
        return f"kdtree_ops {ours}/{calls}"
    return f"kdtree_ops {ours}/{calls}, SGLang {theirs}/{calls}"


def eager_step_ms(backend, fb, step, budget_ms: float = 600.0) -> float:
    """Median milliseconds of step() (one verify step's layers, eager), CUDA events. SGLang's
    init_forward_metadata runs before each step, outside the timed span, so per-step work the
    hook does (the tree mask conversion) is timed as it happens in serving."""
    times = []
    reps = 3
    while len(times) < reps + 1:
        backend.init_forward_metadata(fb)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) == 2:  # the first is a warm-up; size the rest to the budget
            reps = max(3, min(50, int(budget_ms / max(times[1], 1e-3))))
    return statistics.median(times[1:])


def one_replay_ms(graph) -> float:
    """Milliseconds of one replay of a captured graph, CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_replay_ms(graph, budget_ms: float = 600.0) -> float:
    """Median milliseconds of one replay, CUDA events."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    reps = 3
    while len(times) < reps:
        times.append(one_replay_ms(graph))
        if len(times) == 1:
            reps = max(5, min(100, int(budget_ms / max(times[0], 1e-3))))
    return statistics.median(times)


def capture_layers(backend, fb, layers, inputs):
    """SGLang's capture order (decode graph runner): init_forward_metadata_out_graph(in_capture=
    True), a warm-up on the capture stream, then the layers captured. Returns the graph, its
    output tensors and the (kdtree_ops, SGLang) split of the captured calls."""
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # Triton JIT, kernel loads, allocator
        run_layers(backend, fb, layers, inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs, counts = counted(lambda: run_layers(backend, fb, layers, inputs))
    return graph, outs, counts


@pytest.mark.parametrize("kind,B,H,N,ctx", REAL_METADATA_CASES)
def test_bench_hook_real_metadata(benchmark, monkeypatch, kind, B, H, N, ctx):
    """Per layer: SGLang's forward_extend vs the hooked one, eager and CUDA-graph replayed,
    through SGLang's own metadata paths; asserts kdtree_ops served every hooked call, the
    outputs agree and the replayed graphs followed the changed batch."""
    pytest.importorskip("sglang")  # and transformers
    tbd = testkit
    from sglang.srt.runtime_context import reset_context

    for name in ("KDTREE_PROFILE", "KDTREE_DEFRAG", "KDTREE_VERIFY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KDTREE_LOG_EVERY", str(1 << 30))  # counters never reset mid-case
    sglang_hook.uninstall()
    L = REAL_METADATA_LAYERS
    reasons: set = set()
    gc.collect()
    torch.cuda.empty_cache()
    runner, topk, steps = real_metadata_runner(tbd, kind, B, H, N, ctx, layers=L)
    try:
        backend = runner.backend
        layers = [runner.layer(i) for i in range(L)]
        g = torch.Generator().manual_seed(B * 1000003 + H * 101 + N + ctx)
        lens_a = [ctx - 13 * b for b in range(B)]
        lens_b = [ctx - 97 - 29 * b for b in range(B)]  # the replayed batch: other lengths, slots, tree
        step, inputs = real_metadata_batch(tbd, runner, kind, lens_a, N, topk, steps, g)
        fb = step.fb

        # eager, batch A: SGLang's own path, then the hook
        backend.init_forward_metadata(fb)
        md = backend.forward_metadata
        dtypes = index_dtypes(md)
        ref = [o.clone() for o in run_layers(backend, fb, layers, inputs)]
        sg_eager = eager_step_ms(backend, fb, lambda: run_layers(backend, fb, layers, inputs)) / L
        sglang_hook.install("on")
        ours, eager_counts = counted(lambda: [o.clone() for o in run_layers(backend, fb, layers, inputs)])
        err_eager = max(rows_close(o, r, H, math.inf) for o, r in zip(ours, ref))
        our_eager = eager_step_ms(backend, fb, lambda: run_layers(backend, fb, layers, inputs)) / L
        reasons |= sglang_hook._STATE.warned

        # CUDA graphs over SGLang's graph buffers, captured on batch A
        backend.init_cuda_graph_state(max_bs=B, max_num_tokens=B * N)
        static = [(q.clone(), k.clone()) for q, k, _ in inputs]
        static = [(q, k, k[..., : tbd.MLA_V]) for q, k in static]  # v: a view of k, as DeepSeek passes it
        sglang_hook.uninstall()
        sg_graph, sg_outs, _ = capture_layers(backend, fb, layers, static)
        sglang_hook.install("on")
        our_graph, our_outs, graph_counts = capture_layers(backend, fb, layers, static)
        reasons |= sglang_hook._STATE.warned
        md = backend.forward_metadata
        graph_dtypes = index_dtypes(md)

        # replay on batch B: SGLang's metadata refill, new inputs, both graphs
        step_b, inputs_b = real_metadata_batch(tbd, runner, kind, lens_b, N, topk, steps, g)
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            getattr(fb, name).copy_(getattr(step_b.fb, name))
        fb.seq_lens_cpu, fb.seq_lens_sum = step_b.fb.seq_lens_cpu, step_b.fb.seq_lens_sum
        fb.spec_info, fb.kv_loc_plan = step_b.fb.spec_info, step_b.fb.kv_loc_plan
        backend.init_forward_metadata_out_graph(fb, in_capture=False)
        for (q, k, _), (q_b, k_b, _) in zip(static, inputs_b):
            q.copy_(q_b)
            k.copy_(k_b)
        sg_graph.replay()
        replayed_sg = [o.clone() for o in sg_outs]
        our_graph.replay()
        replayed_ours = [o.clone() for o in our_outs]
        sglang_hook.uninstall()
        backend.init_forward_metadata(step_b.fb)
        ref_b = run_layers(backend, step_b.fb, layers, static)
        err_graph = max(rows_close(o, r, H, math.inf) for o, r in zip(replayed_ours, ref_b))
        err_sglang_graph = max(rows_close(o, r, H, math.inf) for o, r in zip(replayed_sg, ref_b))
        sg_graph_ms = graph_replay_ms(sg_graph) / L
        our_graph_ms = graph_replay_ms(our_graph) / L
        run(benchmark, our_graph.replay)
    finally:
        sglang_hook.uninstall()
        reset_context()

    T, prefix = B * N, sum(lens_b)
    nbytes = prefix * 1152 + T * H * (576 + 512) * 2  # per layer: prefix KV, q, out
    flops = sum(N * H * (p + N) * 2 * (576 + 512) for p in lens_b)
    row = report(
        benchmark, f"hook real metadata {kind} B={B} H={H} N={N} ctx={ctx}", our_graph_ms, nbytes=nbytes, flops=flops,
        sglang_eager_ms=sg_eager, ours_eager_ms=our_eager, sglang_graph_ms=sg_graph_ms,
        speedup_eager=sg_eager / our_eager, speedup_graph=sg_graph_ms / our_graph_ms,
        err_eager=err_eager, err_graph=err_graph, err_sglang_graph=err_sglang_graph,
        served_eager=served_by(eager_counts, L), served_graph=served_by(graph_counts, L),
        eager_dtypes=dtypes, graph_dtypes=graph_dtypes,
    )
    print(f"\n{row['name']}: per layer, SGLang eager {sg_eager:.4f} ms / graph {sg_graph_ms:.4f} ms; "
          f"hook eager {our_eager:.4f} ms / graph {our_graph_ms:.4f} ms; served eager: {row['served_eager']}, "
          f"graph: {row['served_graph']}; err eager {err_eager:.3g}, graph {err_graph:.3g}")
    reasons = sorted(reasons) or "see the kdtree_ops warnings"
    assert eager_counts == (L, 0), f"eager: {row['served_eager']}; {reasons}"
    assert graph_counts == (L, 0), f"graph capture: {row['served_graph']}; {reasons}"
    tol = ROW_TOL["cuda"]
    assert err_eager < tol and err_graph < tol, (err_eager, err_graph)
    assert err_sglang_graph < tol, f"SGLang's replayed graph missed the new batch: error {err_sglang_graph}"


# ---- plot: python bench_ops.py plot BENCH_JSON OUT_PNG ----


def plot(bench_json: str, out_png: str) -> None:
    """Effective bandwidth vs context of verify_attn and SGLang's extend_attention_fwd (B=1,
    H=16, N=9) from a $KDTREE_BENCH_JSON file, with the measured copy ceiling and the
    compute-bound limit of that shape."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(bench_json) as f:
        data = json.load(f)
    ours, theirs = {}, {}  # context -> GB/s
    for r in data["results"]:
        m = re.fullmatch(r"(verify_attn|sglang extend_attention_fwd) B=1 H=16 N=9 ctx=(\d+)", r["name"])
        if m and "GB/s" in r:
            (ours if m[1] == "verify_attn" else theirs)[int(m[2])] = r["GB/s"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points, marker in (("kdtree_ops verify_attn", ours, "o"),
                                  ("SGLang extend_attention_fwd (Triton)", theirs, "s")):
        if points:
            ctx = sorted(points)
            ax.plot(ctx, [points[c] for c in ctx], marker=marker, label=label)
    ceil = data.get("ceilings", {})
    if ceil.get("copy GB/s"):
        ax.axhline(ceil["copy GB/s"], color="gray", ls="--", label=f"device copy ceiling ({ceil['copy GB/s']:,.0f} GB/s)")
    if ceil.get("bf16 mm TFLOP/s"):
        # 144 (node, head) rows x 2 x (576 + 512) FLOP per 1,152-byte prefix token at the matrix
        # ceiling: above this effective bandwidth the shape is compute-bound.
        limit = 1152 / (144 * 2176 / (ceil["bf16 mm TFLOP/s"] * 1e12)) / 1e9
        ax.axhline(limit, color="black", ls=":",
                   label=f"compute-bound limit at {ceil['bf16 mm TFLOP/s']:.0f} TFLOP/s ({limit:,.0f} GB/s)")
    ax.set_xscale("log", base=2)
    ticks = sorted(set(ours) | set(theirs))
    ax.set_xticks(ticks, [f"{c // 1024}k" if c >= 1024 else str(c) for c in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("context (prefix tokens)")
    ax.set_ylabel("effective GB/s (prefix KV + q + out, once)")
    ax.set_title(f"MLA tree-verify attention, B=1, 16 heads, 9 nodes\n{data.get('device', '?')}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=150)


# ---- main job: python bench_ops.py ----


def _selfcheck_cases(device: str):
    """Small random inputs for every op: name -> (call(inputs) -> outputs, inputs)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    cases = {}
    T, H = 113, 16
    cases["merge_state"] = (lambda a: merge_state(*a), [rnd(T, H, 512), rnd(T, H, dtype=torch.float32), rnd(T, H, 512), rnd(T, H, dtype=torch.float32)])

    B, N, P, S = 4, 9, 4099, 40000
    slots = torch.randperm(S, generator=g)[: B * P].to(device)
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)] for _ in range(B)]
    vis = torch.cat([kdtree_ops.ancestor_mask(par) for par in parents])
    attn = [rnd(B * N, H, 576), rnd(S, 576), torch.arange(0, (B + 1) * P, P, dtype=torch.int32, device=device), slots.int(),
            torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=device), rnd(B * N, 576)]
    scale = 1 / math.sqrt(192)
    cases["verify_attn (tree)"] = (lambda a: verify_attn(*a[:6], pack_tree_mask(a[6]), scale), [*attn, vis.to(device)])
    cases["verify_attn (chain)"] = (lambda a: verify_attn(*a, None, scale), attn)
    cases["pack_tree_mask"] = (lambda a: pack_tree_mask(a[0]), [vis.to(device)])

    layers = [rnd(S, 576) for _ in range(3)]
    src = torch.randperm(S, generator=g)[:1000].to(device)
    dst = torch.cat([src[500:], torch.randperm(S, generator=g)[:500].to(device)])  # overlaps src
    dst = torch.unique(dst)[:1000]

    def moved(a):
        kv = [t.clone() for t in a[0]]
        move_kv(kv, a[1][: a[2].numel()], a[2])
        return kv

    cases["move_kv"] = (moved, [layers, src, dst])

    lp, tok = draft_topk(torch.randn(3, 7, 500, generator=g) * 3, 6)
    cases["sglang_build_tree"] = (lambda a: sglang_build_tree(a[0], a[1], 40), [lp.to(device), tok.to(device)])
    tree = sglang_build_tree(lp, tok, 40)
    par = tree.parents.int()
    _, _, _, first_child, sibling = torch.ops.kdtree.verify_metadata(torch.zeros_like(par), par, torch.zeros(3, dtype=torch.int32), True)
    cand = torch.cat((tok[:, :1, 0], tree.node_tokens), 1)
    target = cand[:, torch.randperm(41, generator=g)]  # draft tokens in random places: some paths accepted
    cases["accept_retrieve"] = (lambda a: accept_retrieve(*a, 7), [t.to(device) for t in (first_child, sibling, cand, target)])
    return cases


def _flatten(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flatten(item)]
    return []


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(t) for t in x) if not hasattr(x, "_fields") else type(x)(*[_to_cpu(t) for t in x])
    return x


def _exact(a, b) -> bool:
    """Every tensor in a (tensor, tuple or list, Nones skipped) equals its counterpart in b."""
    xs, ys = _flatten(a), _flatten(b)
    return len(xs) == len(ys) and all(x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in zip(xs, ys))


def _selfcheck(device: str) -> int:
    """One row per op: the op on `device` against its CPU reference (on the CPU, the bf16
    reference against float64). Returns the number of mismatches."""
    failures = 0
    print(f"\n{'op':24s} {'device':7s} {'max rel err':>12s} {'ms':>9s}  result")
    for name, (call, inputs) in _selfcheck_cases(device).items():
        start = time.perf_counter()
        out = call(inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        if device == "cuda":
            ref = call(_to_cpu(inputs))
        elif name.startswith("verify"):  # the float64 reference (the op takes bf16/fp16 only)
            a = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
            mask = pack_tree_mask(a[6]) if len(a) > 6 else None
            ref = kdtree_ops.verify_attn_reference(*a[:6], mask, 1 / math.sqrt(192))
        else:
            print(f"{name:24s} {device:7s} {'-':>12s} {ms:9.3f}  reference ran (no CUDA kernel to compare)")
            continue
        errs = [rel_err(a, b) if a.is_floating_point() else (0.0 if _exact(a, b) else math.inf)
                for a, b in zip(_flatten(out), _flatten(ref))]
        err = max(errs, default=0.0)
        failures += not err < 1e-2
        print(f"{name:24s} {device:7s} {err:12.2e} {ms:9.3f}  {'ok' if err < 1e-2 else 'MISMATCH'}")
    return failures


# ---- one DDTree verify round (the rest of `python bench_ops.py`) ----

# GPU default: one tensor-parallel rank of DeepSeek-V3 (128 heads / TP 8) at 32k context, its
# vocabulary, DDTree's usual block (L = 15). The CPU default is small: there the ops are the
# pure-torch references.
_ROUND_DEFAULTS = {
    "cuda": dict(batch=4, context=32768, budget=64, heads=16, layers=4, depth=15, vocab=129280),
    "cpu": dict(batch=2, context=1024, budget=16, heads=4, layers=2, depth=15, vocab=129280),
}
_ROUND_STAGES = ("draft_topk", "build_tree", "verify_metadata", "kv_write", "verify_attn", "accept_walk",
                 "commit_accept", "defragment")
_MLA_SCALE = 1 / math.sqrt(192)  # DeepSeek's softmax scale (nope 128 + rope 64 before absorption)


def sglang_extend_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, custom_mask, mask_indptr,
                             max_nodes: int, sm_scale: float, out, k_scale: float = 1.0):
    """SGLang 0.5.23's TARGET_VERIFY attention for an MLA layer (Triton ``extend_attention_fwd``
    with the flat custom mask, as its Triton backend calls it) as a zero-argument callable that
    writes ``out [T, H, 512]``; None when SGLang's kernels are not importable. The baseline of
    the main job and of bench_ops.py. An fp8 pool's uint8 bytes are handed over as e4m3, with
    ``k_scale`` as the k and v descale (its pool's get_key_buffer and layer.k_scale_float)."""
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except Exception:  # noqa: BLE001  (no SGLang or no Triton: nothing to compare against)
        return None
    T = q.shape[0]
    k = tree_k.reshape(T, 1, MLA_QK_DIM)
    v = tree_k.reshape(T, MLA_QK_DIM)[:, :MLA_V_DIM].contiguous().view(T, 1, MLA_V_DIM)  # MLA: value = latent[:512]
    kv = kv_cache.view(-1, 1, MLA_QK_DIM)
    if kv.dtype == torch.uint8:
        kv = kv.view(torch.float8_e4m3fn)
    indices = kv_indices.long()

    def call():
        extend_attention_fwd(q, k, v, out, kv, kv[..., :MLA_V_DIM], qo_indptr, kv_indptr, indices, custom_mask, True,
                             mask_indptr, max_nodes, k_scale, k_scale, sm_scale=sm_scale)
        return out

    return call


def python_metadata(tree: Tree, prefix: list[int]):
    """Baseline: the verify inputs as SGLang's DDTree PR builds them, request by request in
    Python: kv indices (arange over the prefix), positions, the flat mask (prefix columns
    true + the tree's ancestor rows), then cat."""
    N, dev = tree.tokens.shape[1], tree.tokens.device
    j = torch.arange(N, device=dev)
    kv, pos, masks = [], [], []
    for b, P in enumerate(prefix):
        kv.append(torch.arange(P, device=dev))
        pos.append(P + tree.depths[b].long())
        ancestors = ((tree.mask[b][:, j // 32] >> (j % 32)) & 1).bool()
        masks.append(torch.cat([torch.ones(N, P, dtype=torch.bool, device=dev), ancestors], 1).flatten())
    return torch.cat(kv), torch.cat(pos), torch.cat(masks)


def _python_accept(tree: Tree, target: torch.Tensor) -> list[list[int]]:
    """Baseline: the accept walk request by request in Python on host copies."""
    paths = []
    for par, tok, tgt in zip(tree.parents.tolist(), tree.tokens.tolist(), target.tolist()):
        child = {}
        for j in range(len(par) - 1, 0, -1):  # the lowest-index child carrying a token wins
            child[par[j], tok[j]] = j
        path = [0]
        while (nxt := child.get((path[-1], tgt[path[-1]]))) is not None:
            path.append(nxt)
        paths.append(path)
    return paths


def _synthetic_targets(tree: Tree, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Target tokens [B, N] for a host tree, and the accept length each request must get.

    Request b walks from the root towards a random leaf: all the way for even b, a random
    number of steps for odd b. Each node on the walk gets the token of its next node as
    target; where the walk stops the target is a token none of its children carries (it
    becomes the bonus token); nodes off the walk keep random tokens (never visited).
    """
    par, tok = tree.parents.tolist(), tree.tokens.tolist()
    target = torch.randint(0, vocab, tree.tokens.shape, generator=g).tolist()
    expect = []
    for b, n in enumerate(tree.num_nodes.tolist()):
        kids = [[] for _ in range(n)]
        for j in range(1, n):
            kids[par[b][j]].append(j)
        leaves = [j for j in range(n) if not kids[j]]
        path = [leaves[int(torch.randint(0, len(leaves), (1,), generator=g))]]
        while path[-1]:
            path.append(par[b][path[-1]])
        path.reverse()
        steps = len(path) - 1 if b % 2 == 0 else int(torch.randint(0, len(path), (1,), generator=g))
        for u, v in zip(path[:steps], path[1 : steps + 1]):
            target[b][u] = tok[b][v]
        stop, taken = path[steps], {tok[b][c] for c in kids[path[steps]]}
        while target[b][stop] in taken:
            target[b][stop] = (target[b][stop] + 1) % vocab
        expect.append(steps + 1)
    return torch.tensor(target), expect


def _round(cfg: dict, device: str, check: bool) -> int:
    """One DDTree verify round (Ringel & Romano 2026, arXiv 2604.12989) on a synthetic MLA layer stack: prints a line per
    stage as it starts, then the stage table. Returns the number of failed checks."""

    B, ctx, budget, H, layers, L, V = (cfg[k] for k in ("batch", "context", "budget", "heads", "layers", "depth", "vocab"))
    N, cuda, dev = budget + 1, device == "cuda", torch.device(device)
    g = torch.Generator().manual_seed(0)  # host: slot lists, targets
    gd = torch.Generator(device=dev).manual_seed(0)  # device: bulk random data
    bf16 = dict(device=dev, dtype=torch.bfloat16)

    # Page-size-1 pool as SGLang's allocator leaves it: slot 0 is padding and allocation takes
    # the front of the free list. Earlier requests came and went in the first `work` slots (that
    # part of the list is shuffled), the rest was never used: a pool twice the working set.
    prefix = [max(ctx - 17 * b, 0) for b in range(B)]  # unequal, so the requests' rows misalign
    offsets = [0, *itertools.accumulate(prefix)]
    total, work = offsets[-1], offsets[-1] + B * N
    size = 2 * work
    free = torch.cat([torch.randperm(work, generator=g) + 1, torch.arange(work + 1, size + 1)])
    kv_indices, out_cache_loc, free_rest = free[:total].to(dev), free[total:work].to(dev), free[work:].to(dev)
    req_to_token = torch.zeros(B + 1, max(prefix) + N, dtype=torch.int32)  # row 0: padding, like SGLang's
    for b, P in enumerate(prefix):
        req_to_token[b + 1, :P] = free[offsets[b] : offsets[b + 1]]
        req_to_token[b + 1, P : P + N] = free[total + b * N : total + (b + 1) * N]  # the verify window
    req_to_token, req_rows = req_to_token.to(dev), torch.arange(1, B + 1, device=dev)
    kv_indptr = torch.tensor(offsets, dtype=torch.int32, device=dev)
    prefix_lens = torch.tensor(prefix, device=dev)
    pools = [torch.randn(size + 1, MLA_QK_DIM, generator=gd, **bf16) for _ in range(layers)]  # never zeros
    q = [torch.randn(B * N, H, MLA_QK_DIM, generator=gd, **bf16) for _ in range(layers)]
    tree_k = [torch.randn(B * N, MLA_QK_DIM, generator=gd, **bf16) for _ in range(layers)]
    print(f"\nDDTree verify round on {device}: {B} requests, prefixes {prefix[0]}..{prefix[-1]} tokens, budget {budget} "
          f"(N = {N} nodes with the root), L = {L}, {H} heads, vocab {V};\n{layers} MLA layers, each a bf16 latent pool of "
          f"{size + 1} x 576 ({(size + 1) * 1152 / 1e6:.1f} MB) with the prefixes in scattered slots", flush=True)

    rows = []

    def stage(name, what):
        print(f"[{_ROUND_STAGES.index(name) + 1}/{len(_ROUND_STAGES)}] {name}: {what}", flush=True)

    def record(label, ms, base_ms, verdict):  # verdict() -> (ok, note), run only when checking
        ok, note = verdict() if check else (None, "")
        rows.append((label, ms, base_ms, ok, note))

    stage("draft_topk", f"drafter logits [{B}, {L}, {V}] -> top-{min(budget, V)} log-probs per position")
    # A confident drafter: N(0, 2^2) logits with one token per position raised by 15..19, so
    # the top token carries most of the mass and the best-first tree is deep and branched.
    logits = torch.randn(B, L, V, generator=gd, device=dev) * 2
    lift = 15 + 4 * torch.rand(B, L, 1, generator=gd, device=dev)
    logits.scatter_add_(2, torch.randint(0, V, (B, L, 1), generator=gd, device=dev), lift)
    root = torch.randint(0, V, (B,), generator=gd, device=dev)
    (lp, tok), ms = median_ms(lambda: draft_topk(logits, min(budget, V)), cuda=cuda)

    def verdict():
        host = logits.cpu()
        lp_ref, tok_ref = draft_topk(host, min(budget, V))
        # The same logit at every rank: tokens equal but for the order of exactly tied logits.
        ok = _exact(host.gather(-1, tok.cpu()), host.gather(-1, tok_ref))
        return ok and torch.allclose(lp.cpu(), lp_ref, rtol=1e-5, atol=1e-5), "vs CPU reference: tokens (up to ties), log-probs 1e-5"

    record("draft_topk", ms, None, verdict)

    stage("build_tree", f"best-first tree of {budget} nodes per request")
    tree, ms = median_ms(lambda: build_tree(lp, tok, root, budget), cuda=cuda)
    host_in = (lp.cpu(), tok.cpu(), root.cpu())
    tree_ref, base_ms = median_ms(lambda: build_tree(*host_in, budget), cuda=False, reps=3)  # the CPU heapq build
    record("build_tree", ms, base_ms, lambda: (_exact(tree, tree_ref), "exact vs the CPU heapq build"))

    stage("verify_metadata", "positions, qo_indptr, SGLang's flat custom mask + mask_indptr")
    capacity = flat_mask_size(total, B, N)
    meta, ms = median_ms(lambda: verify_metadata(tree, prefix_lens, custom_mask_capacity=capacity), cuda=cuda)
    loop, base_ms = median_ms(lambda: python_metadata(tree, prefix), cuda=cuda, reps=3)

    def verdict():
        ref = verify_metadata(tree_ref, prefix_lens.cpu(), custom_mask_capacity=capacity)
        ok = _exact(meta, ref) and _exact(loop[1:], (meta.positions, meta.custom_mask))
        return ok, "exact vs CPU reference + Python loop"

    record("verify_metadata", ms, base_ms, verdict)

    stage("kv_write", f"the {N} nodes' latents of each request into its {N} fresh slots, {layers} layers")

    def kv_write():
        for kv, k in zip(pools, tree_k):
            kv.index_copy_(0, out_cache_loc, k)  # SGLang's MLA set_kv_buffer: kv_buffer[layer][loc] = k

    _, ms = median_ms(kv_write, cuda=cuda)
    record(f"kv_write ({layers} layers)", ms, None,
           lambda: (all(torch.equal(kv[out_cache_loc], k) for kv, k in zip(pools, tree_k)), "exact"))

    stage("verify_attn", f"{layers} layers, {B * N} rows x {H} heads over {total} prefix tokens + the tree")
    tree_mask = tree.mask.reshape(B * N, -1)  # packed ancestor rows, one per node
    outs = [torch.empty(B * N, H, MLA_V_DIM, **bf16) for _ in range(layers)]
    lses = [torch.empty(B * N, H, device=dev) for _ in range(layers)]

    def attention():
        for i in range(layers):
            verify_attn(q[i], pools[i], kv_indptr, kv_indices, meta.qo_indptr, tree_k[i], tree_mask, _MLA_SCALE,
                        out=outs[i], lse=lses[i], max_kv_len=max(prefix))

    _, ms = median_ms(attention, cuda=cuda)
    theirs = [torch.empty_like(o) for o in outs]
    sglang = [sglang_extend_attention(q[i], pools[i], kv_indptr, kv_indices, meta.qo_indptr, tree_k[i],
                                       meta.custom_mask, meta.mask_indptr, N, _MLA_SCALE, theirs[i])
              for i in range(layers)] if cuda else [None]
    base_ms = None
    if sglang[0] is not None:
        print("      SGLang's Triton extend_attention_fwd on the same inputs (its first call compiles it)", flush=True)
        try:
            base_ms = median_ms(lambda: [call() for call in sglang], cuda=cuda, reps=3)[1]
        except Exception as e:  # noqa: BLE001  (a broken Triton install must not hide our results)
            print(f"      SGLang's kernel failed, no attention baseline: {type(e).__name__}: {e}", flush=True)

    def verdict():
        errs, sg_errs = [], []
        for i in range(layers):  # float64 reference on the data's device, over the prefix rows only
            ref_out, ref_lse = kdtree_ops.verify_attn_reference(q[i].double(), pools[i][kv_indices].double(), kv_indptr,
                                                 torch.arange(total, device=dev), meta.qo_indptr, tree_k[i].double(),
                                                 tree_mask, _MLA_SCALE)
            errs.append(max(rel_err(outs[i], ref_out), rel_err(lses[i], ref_lse)))
            if base_ms is not None:
                sg_errs.append(rel_err(theirs[i], ref_out))
        sg_note = f", SGLang's {max(sg_errs):.1e}" if sg_errs else ""
        return max(errs) < 1e-2, f"rel err {max(errs):.1e} vs float64{sg_note}"

    record(f"verify_attn ({layers} layers)", ms, base_ms, verdict)
    attn_base_ms = base_ms

    stage("accept_walk", "targets follow a random root-to-leaf path: all of it (even requests) or part (odd)")
    target, expect = _synthetic_targets(tree_ref, V, g)
    target = target.to(dev)
    (accepted, accept_len, bonus), ms = median_ms(lambda: accept_walk(tree, target, max_depth=L), cuda=cuda)
    paths, base_ms = median_ms(lambda: _python_accept(tree, target), cuda=cuda, reps=3)

    def verdict():
        ref = accept_walk(tree_ref, target.cpu(), max_depth=L)
        walked = [a[:n] for a, n in zip(accepted.tolist(), accept_len.tolist())]
        return (_exact((accepted, accept_len, bonus), ref) and walked == paths and accept_len.tolist() == expect,
                "exact vs CPU reference + Python walk")

    record("accept_walk", ms, base_ms, verdict)

    stage("commit_accept", "accepted KV to the front of each verify window, req_to_token updated")
    window_rtt = req_to_token.clone()

    def restore():  # every repeat moves the same KV
        kv_write()
        req_to_token.copy_(window_rtt)

    def commit():
        return defrag.commit_accept(pools, req_to_token, req_rows, prefix_lens, accepted, accept_len, out_cache_loc, N)

    moves, ms = median_ms(commit, cuda=cuda, setup=restore)

    def verdict():
        ref = defrag.accept_moves(accepted.cpu(), accept_len.cpu(), out_cache_loc.cpu(), N)
        b, j = (moves.kept >= 0).nonzero(as_tuple=True)
        kept, node = moves.kept[b, j], b * N + accepted[b, j].long()  # accepted token j <- node's latent
        expected = window_rtt.clone()
        expected[req_rows[b], prefix_lens[b] + j] = kept.to(expected.dtype)
        kv_ok = all(torch.equal(kv[kept], k[node]) for kv, k in zip(pools, tree_k))
        ok = _exact(moves, ref) and kv_ok and torch.equal(req_to_token, expected)
        return ok, "moves vs CPU reference, KV + req_to_token exact"

    record("commit_accept", ms, None, verdict)
    free_slots = torch.cat([free_rest, moves.freed[moves.freed > 0]])  # the allocator takes the rejected slots back

    stage("defragment", "one pass: every request's KV into one contiguous run of slots")
    pool = defrag.TensorPool(req_to_token, pools, free_slots, size)
    lens = prefix_lens + accept_len
    width = int(lens.max())
    owned = torch.arange(width, device=dev) < lens[:, None]
    runs_before = defrag.fragmentation(req_to_token, req_rows, lens)
    kv_before = [kv[req_to_token[req_rows, :width][owned].long()] for kv in pools] if check else []
    plan, ms = median_ms(lambda: defrag.defragment(pool, req_rows, lens, byte_budget=None), cuda=cuda, reps=1)
    runs_after = defrag.fragmentation(req_to_token, req_rows, lens)

    def verdict():
        try:
            defrag.check_partition(pool, req_rows, lens)  # free + owned = every slot exactly once
        except AssertionError as e:
            return False, str(e)
        slots = req_to_token[req_rows, :width][owned].long()
        same = all(torch.equal(kv[slots], old) for kv, old in zip(pools, kv_before))
        one_run = bool((runs_after == 1).all()) and not plan.skipped
        return same and one_run, plan.reason or "KV per request unchanged, slots partitioned, one run each"

    record("defragment", ms, None, verdict)

    print(f"\naccept lengths {accept_len.tolist()} (at most L + 1 = {L + 1}); slot runs per request: "
          f"before defrag {runs_before.tolist()}, after {runs_after.tolist()} "
          f"({plan.moved_slots} slots, {plan.bytes / 1e6:.1f} MB moved over {layers} layers)")
    print(f"\n{'stage':24s} {'ours ms':>9s} {'SGLang path ms':>15s} {'speedup':>8s}  check")
    for label, ms, base_ms, ok, note in rows:
        base = f"{base_ms:15.3f} {base_ms / ms:7.1f}x" if base_ms is not None else f"{'-':>15s} {'-':>8s}"
        verdict = "skipped" if ok is None else f"{'ok' if ok else 'FAIL'}: {note}"
        print(f"{label:24s} {ms:9.3f} {base}  {verdict}")
    clock = "CUDA events" if cuda else "perf_counter"
    attn_note = "" if attn_base_ms is not None else " (needs CUDA and SGLang's kernels)"
    print(f"ms: median of 5 calls after a warm-up ({clock}); baselines: 3 calls, the CPU heapq build by perf_counter;\n"
          "commit_accept restores its inputs between repeats; defragment (host planning + one move_kv) runs once.\n"
          "SGLang path: build_tree = the per-request CPU heapq build (the reference); verify_metadata = a per-request\n"
          "Python loop (arange + cat, as SGLang's DDTree PR); verify_attn = SGLang's Triton extend_attention_fwd with\n"
          f"the flat mask{attn_note}; accept_walk = a per-request Python walk; '-': SGLang does the same or nothing.")
    if attn_base_ms is not None:  # the verify step end to end
        ours, base = sum(r[1] for r in rows[:6]), sum(r[2] if r[2] is not None else r[1] for r in rows[:6])
        print(f"verify step (draft_topk to accept_walk): {ours:.3f} ms vs SGLang path {base:.3f} ms, "
              f"{base / ours:.1f}x (stages without a baseline counted at our time)")
    return sum(ok is False for *_, ok, _ in rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python bench_ops.py``: report the environment, check every op against its reference
    (one row per op), then run one DDTree verify round and print its stage table. Returns 1 if
    any check failed."""
    import platform

    parser = argparse.ArgumentParser(
        prog="python bench_ops.py",
        description="Environment report, per-op self-check, and one DDTree verify round on a synthetic MLA "
        "layer stack (drafter logits to defrag), each stage timed beside SGLang's path and checked "
        "against its reference.",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda where the kernels are built, else cpu (the references, smaller default sizes)")
    sizes = (("batch", "requests"), ("context", "prefix tokens of request 0 (request b has 17 b fewer)"),
             ("budget", "draft tree nodes besides the root"), ("heads", "query heads (of one TP rank)"),
             ("layers", "MLA layers"), ("depth", "draft positions L"), ("vocab", "drafter vocabulary"))
    for name, what in sizes:
        parser.add_argument(f"--{name}", type=int,
                            help=f"{what}; default {_ROUND_DEFAULTS['cuda'][name]} on cuda, {_ROUND_DEFAULTS['cpu'][name]} on cpu")
    parser.add_argument("--no-check", action="store_true", help="skip the self-check and the round's reference checks")
    args = parser.parse_args(argv)

    print(f"kdtree_ops  python {platform.python_version()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
    gpu = torch.cuda.is_available()
    if gpu:
        major, minor = torch.cuda.get_device_capability()
        print(f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor}), {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    else:
        print("GPU: none - CUDA kernels are not built; running the CPU references only")
    print(f"cache: {cache_root()}  KDTREE_NO_BUILD={os.environ.get('KDTREE_NO_BUILD', '')!r}  KDTREE_CHECK={os.environ.get('KDTREE_CHECK', '')!r}")
    if gpu and not cuda_available():
        print("CUDA kernels: not loaded (KDTREE_NO_BUILD set)")
    elif gpu:
        print(f"CUDA kernels: {build()}")
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not cuda_available():
        print("kdtree_ops: --device cuda needs a CUDA GPU and the built kernels", file=sys.stderr)
        return 2

    failures = 0 if args.no_check else _selfcheck(device)
    cfg = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in _ROUND_DEFAULTS[device].items()}
    if device == "cpu":
        print(f"\nCPU: the round runs the pure-torch references at a small default size "
              f"({_ROUND_DEFAULTS['cpu']['batch']} requests x {_ROUND_DEFAULTS['cpu']['context']} context); "
              f"a GPU runs {_ROUND_DEFAULTS['cuda']['batch']} x {_ROUND_DEFAULTS['cuda']['context']}")
    failures += _round(cfg, device, check=not args.no_check)
    verdict = "checks skipped (--no-check)" if args.no_check else f"{failures} check(s) FAILED" if failures else "all checks passed"
    print(f"\n{verdict}", flush=True)
    return 1 if failures else 0


AB_SHAPES = "1x16x9x4096,1x16x9x32768,1x16x9x131072,1x128x9x131072,1x128x1x131072,1x128x65x32768,1x16x257x32768,8x16x9x65536,64x128x1x8192,64x16x1x8192,16x16x4x32768"
AB_SCALE, AB_K_SCALE = 1.0 / math.sqrt(192), 0.5


def _variants(specs: Sequence[str]) -> tuple[dict[str, dict[str, str]], set[str]]:
    """NAME:VAR=VALUE,VAR=VALUE specs -> ({NAME: {VAR: VALUE}}, every VAR named); empty
    settings are the defaults."""
    variants = {}
    for spec in specs:
        name, _, settings = spec.partition(":")
        variants[name] = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    return variants, {k for v in variants.values() for k in v}


class _env:
    """The environment with `settings` applied and every other knob in `knobs` unset, for a block."""

    def __init__(self, settings: dict[str, str], knobs: set[str]):
        self.settings, self.knobs = settings, knobs

    def __enter__(self):
        self.saved = {k: os.environ.pop(k, None) for k in self.knobs}
        os.environ.update(self.settings)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def _ab_case(shape: str, layout: str, pool: str, tree: bool, cpu: torch.Generator, gpu: torch.Generator,
             slot_dtype: torch.dtype = torch.int32, hint: bool = True) -> dict:
    """One verify_attn input set on the GPU for shape BxHxNODESxCONTEXT (CONTEXT as LO-HI spreads
    the B requests' lengths evenly from LO to HI), prefix slots laid out as testkit.prefix_slots's
    `layout` in `slot_dtype` (SGLang's metadata holds int64), over a bf16 pool or its e4m3 bytes
    (k_scale AB_K_SCALE); `call()` runs it into `out` and `lse`, with the longest prefix as
    `max_kv_len` unless `hint` is False (as in the hook's captured steps, which must serve any
    later lengths)."""
    B, H, N, ctx_spec = shape.split("x")
    B, H, N = int(B), int(H), int(N)
    lo, _, hi = ctx_spec.partition("-")
    lens = [int(lo) + (int(hi or lo) - int(lo)) * b // max(B - 1, 1) for b in range(B)]
    c = {"B": B, "H": H, "N": N, "ctx_spec": ctx_spec, "lens": lens, "ctx": max(lens),
         "starts": [sum(lens[:b]) for b in range(B + 1)]}
    slots, S = testkit.prefix_slots(lens, layout, None, cpu)
    c["kv"] = torch.randn(S, MLA_QK_DIM, device="cuda", dtype=torch.bfloat16, generator=gpu)
    c["kv_pool"] = testkit.e4m3_bytes(c["kv"], AB_K_SCALE) if pool == "fp8" else c["kv"]
    c["q"] = torch.randn(B * N, H, MLA_QK_DIM, device="cuda", dtype=torch.bfloat16, generator=gpu)
    c["tree_k"] = torch.randn(B * N, MLA_QK_DIM, device="cuda", dtype=torch.bfloat16, generator=gpu)
    c["kv_indptr"] = torch.tensor(c["starts"], device="cuda", dtype=torch.int32)
    c["qo_indptr"] = torch.arange(B + 1, device="cuda", dtype=torch.int32) * N
    c["kv_indices"] = slots.to(device="cuda", dtype=slot_dtype)
    c["visible"] = torch.cat([testkit.random_tree_mask(N, cpu) if tree else torch.ones(N, N, dtype=torch.bool).tril()
                              for _ in range(B)])
    mask = pack_tree_mask(c["visible"].cuda()) if tree else None
    kw = {"k_scale": AB_K_SCALE} if pool == "fp8" else {}
    c["out"] = torch.empty(B * N, H, MLA_V_DIM, device="cuda", dtype=torch.bfloat16)
    c["lse"] = torch.empty(B * N, H, device="cuda", dtype=torch.float32)

    def call():
        verify_attn(c["q"], c["kv_pool"], c["kv_indptr"], c["kv_indices"], c["qo_indptr"], c["tree_k"], mask, AB_SCALE,
                    out=c["out"], lse=c["lse"], max_kv_len=c["ctx"] if hint else None, **kw)

    c["call"] = call
    return c


def ab(argv: Sequence[str]) -> int:
    """``python bench_ops.py ab NAME:SETTINGS ...``: verify_attn under several settings of its
    KDTREE_VERIFY_* variables (read at every call, so one build serves them all), timed side by
    side on the same inputs: one call per CUDA graph, replayed after a 512 MB write (cold L2),
    median of --reps replays, --rounds rounds with the variants interleaved; every variant's
    output is compared bit for bit with the first's, and the first's with a float32 reference
    on up to two requests. SETTINGS: VAR=VALUE pairs joined by commas (empty: the defaults)."""
    parser = argparse.ArgumentParser(prog="python bench_ops.py ab", description=ab.__doc__)
    parser.add_argument("variants", nargs="+", help="NAME:VAR=VALUE,VAR=VALUE (e.g. 'plain:KDTREE_VERIFY_TMA=0')")
    parser.add_argument("--shapes", default=AB_SHAPES,
                        help="BxHxNODESxCONTEXT, comma-separated; CONTEXT as LO-HI spreads the B requests' lengths evenly from LO to HI")
    parser.add_argument("--layouts", default="pages,scattered", help="prefix slot layouts (testkit.prefix_slots)")
    parser.add_argument("--pool", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--slots", default="int32", help="slot index dtypes, comma-separated: int32, int64 (SGLang's)")
    parser.add_argument("--no-hint", action="store_true",
                        help="no max_kv_len, as the SGLang hook's captured steps call verify_attn")
    parser.add_argument("--tree", action="store_true", help="random trees (default: causal chains, no mask)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args(argv)
    if set(args.slots.split(",")) - {"int32", "int64"}:
        parser.error(f"--slots takes int32 and int64, not {args.slots!r}")
    if not cuda_available():
        print("kdtree_ops: ab needs a CUDA GPU and the built kernels", file=sys.stderr)
        return 2
    variants, knobs = _variants(args.variants)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    gpu = torch.Generator(device="cuda").manual_seed(1234)
    cpu = torch.Generator().manual_seed(1234)
    rows_out = []
    cases = [(shape, layout, slots) for shape in args.shapes.split(",") for layout in args.layouts.split(",")
             for slots in args.slots.split(",")]
    for shape, layout, slots in cases:
        c = _ab_case(shape, layout, args.pool, args.tree, cpu, gpu, getattr(torch, slots), not args.no_hint)
        B, H, N, lens, starts, out = c["B"], c["H"], c["N"], c["lens"], c["starts"], c["out"]
        flops = 2 * N * H * (sum(lens) + B * (N + 1) / 2) * (MLA_QK_DIM + MLA_V_DIM)
        times, outs = {name: [] for name in variants}, {}
        for r in range(args.rounds):
            for name, settings in variants.items():
                with _env(settings, knobs):
                    out.fill_(math.nan)
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):  # warm-up: the build, the kernel's attributes
                        c["call"]()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        c["call"]()
                ms = []
                for _ in range(args.reps):
                    flush.fill_(1)
                    ms.append(one_replay_ms(graph))
                times[name].append(statistics.median(ms))
                if r == 0:
                    outs[name] = out.clone()
        first = next(iter(variants))
        err = None  # not checked: the reference would not fit
        if c["ctx"] * N * H <= 2**28:  # a float32 reference of up to two requests
            keys = c["kv"].float() if args.pool == "bf16" else c["kv_pool"].view(torch.float8_e4m3fn).float() * AB_K_SCALE
            q, tree_k, kv_indices = c["q"], c["tree_k"], c["kv_indices"]
            errs = []
            for b in range(min(B, 2)):
                K = torch.cat([keys[kv_indices[starts[b]:starts[b + 1]].long()], tree_k[b * N:(b + 1) * N].float()])
                sees = torch.cat([torch.ones(N, lens[b], dtype=torch.bool), c["visible"][b * N:(b + 1) * N]], 1).cuda()
                sc = torch.einsum("nhd,ld->nhl", q[b * N:(b + 1) * N].float(), K) * AB_SCALE
                ref = torch.einsum("nhl,lv->nhv", sc.masked_fill(~sees[:, None], -math.inf).softmax(-1), K[:, :MLA_V_DIM])
                errs.append(rel_err(outs[first][b * N:(b + 1) * N], ref))
            err = max(errs)
        row = {"shape": [B, H, N, c["ctx_spec"]], "layout": layout, "slots": slots, "hint": not args.no_hint,
               "pool": args.pool, "tree": args.tree, "rel_err": err,
               **{name: statistics.mean(t) for name, t in times.items()},
               "rounds": times, "same_bits": {name: bool(torch.equal(o, outs[first])) for name, o in outs.items()}}
        rows_out.append(row)
        cells = " | ".join(f"{name} {row[name]:.4f} ms ({row[first] / row[name]:.3f}x{'' if row['same_bits'][name] else ', other bits'})"
                           for name in variants)
        checked = "rel err unchecked" if err is None else f"rel err {err:.1e}"
        print(f"{B}x{H}x{N} @{c['ctx_spec']} {args.pool} {layout} {slots}{' no hint' if args.no_hint else ''}: {checked} | {cells} | {flops / row[first] / 1e9:.0f} TFLOP/s",
              flush=True)
        del c, out, outs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    return 0


HOST_SHAPES = "1x16x9x4096,1x128x9x32768,8x16x9x8192"


def host(argv: Sequence[str]) -> int:
    """``python bench_ops.py host NAME:SETTINGS ...``: host time of one eager verify_attn call
    (argument checks, the launch plan, a tensor map where tiles load as boxes, the launches)
    under several settings of its KDTREE_VERIFY_* variables. The GPU is kept busy
    (torch.cuda._sleep) while --calls calls are issued, so no call waits for the device and the
    wall time over them is the host's alone; median of --rounds rounds, the variants interleaved.
    What a CUDA graph replays costs none of this: it matters to eager steps (batch sizes
    without a captured graph)."""
    parser = argparse.ArgumentParser(prog="python bench_ops.py host", description=host.__doc__)
    parser.add_argument("variants", nargs="*", default=["boxes:", "copies:KDTREE_VERIFY_TMA=0"],
                        help="NAME:VAR=VALUE,VAR=VALUE (default: 'boxes:' 'copies:KDTREE_VERIFY_TMA=0')")
    parser.add_argument("--shapes", default=HOST_SHAPES, help="BxHxNODESxCONTEXT, comma-separated (as for ab)")
    parser.add_argument("--layouts", default="pages,scattered", help="prefix slot layouts (testkit.prefix_slots)")
    parser.add_argument("--pools", default="bf16,fp8", help="bf16, fp8 or both, comma-separated")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not cuda_available():
        print("kdtree_ops: host needs a CUDA GPU and the built kernels", file=sys.stderr)
        return 2
    variants, knobs = _variants(args.variants)
    gpu = torch.Generator(device="cuda").manual_seed(1234)
    cpu = torch.Generator().manual_seed(1234)
    # GPU cycles that outlast the calls: 20 us of host a call at most, at 2 GHz, four times over.
    sleep_cycles = int(4 * args.calls * 20e-6 * 2e9)
    for pool in args.pools.split(","):
        for shape in args.shapes.split(","):
            for layout in args.layouts.split(","):
                c = _ab_case(shape, layout, pool, False, cpu, gpu)
                us = {name: [] for name in variants}
                for _ in range(args.rounds):
                    for name, settings in variants.items():
                        with _env(settings, knobs):
                            c["call"]()  # the build, the kernel's attributes
                            torch.cuda.synchronize()
                            torch.cuda._sleep(sleep_cycles)
                            t0 = time.perf_counter()
                            for _ in range(args.calls):
                                c["call"]()
                            us[name].append((time.perf_counter() - t0) / args.calls * 1e6)
                            torch.cuda.synchronize()
                first = next(iter(variants))
                med = {name: statistics.median(u) for name, u in us.items()}
                cells = " | ".join(f"{name} {med[name]:.1f} us ({med[name] - med[first]:+.1f})" for name in variants)
                print(f"{shape} {pool} {layout}: host per call | {cells}", flush=True)
                del c
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        if len(sys.argv) != 4:
            sys.exit("usage: python bench_ops.py plot BENCH_JSON OUT_PNG")
        plot(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["ab"]:
        sys.exit(ab(sys.argv[2:]))
    elif sys.argv[1:2] == ["host"]:
        sys.exit(host(sys.argv[2:]))
    else:
        sys.exit(main())
