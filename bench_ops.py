"""GPU benchmarks for kdtree_ops (pytest-benchmark). Run: ``python -m pytest bench_ops.py``.

Each benchmark times the op by CUDA-graph replay (median of many, launch gaps removed),
reports effective GB/s and TFLOP/s beside ceilings measured in the same run, and stores them
in ``benchmark.extra_info``; the summary table is printed at the end and written as JSON to
``$KDTREE_BENCH_JSON`` when set.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

import kdtree_ops

pytestmark = pytest.mark.skipif(
    not kdtree_ops.cuda_available(), reason="benchmarks need a CUDA GPU and the built kernels"
)

RESULTS: list[dict] = []


def gpu_time_ms(fn, reps: int = 50, graph_calls: int = 5) -> float:
    """Median milliseconds of one fn() call: CUDA-graph replays of `graph_calls` calls,
    timed with CUDA events, `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / graph_calls)
    return statistics.median(times)


def event_time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() timed with CUDA events (for code that cannot be captured)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


_CEILINGS: dict[str, float] = {}


def copy_ceiling_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written), measured once per run."""
    if "copy" not in _CEILINGS:
        src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
        dst = torch.empty_like(src)
        ms = gpu_time_ms(lambda: dst.copy_(src), reps=20, graph_calls=2)
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
    path = os.environ.get("KDTREE_BENCH_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": ceil, "results": RESULTS}, f, indent=1)


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


# ---- tree ops ----


# ---- kv movement ----
