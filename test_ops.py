"""Tests for kdtree_ops. CPU tests always run; GPU tests need a CUDA GPU and the built kernels.

Every op is checked the same way: CUDA against the CPU reference on fresh random data at odd
sizes, ``torch.library.opcheck``, CUDA-graph capture + replay with changed inputs, and
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math

import pytest
import torch

import kdtree_ops

GPU = kdtree_ops.cuda_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the built kdtree kernels")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of x against ref, computed in float64; NaN never passes."""
    x, ref = x.double().cpu(), ref.double().cpu()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def graph_replay(fn, make_inputs, check):
    """Capture fn(*inputs) in a CUDA graph, then refill the inputs and replay twice.

    check(inputs, outputs) compares the replayed outputs against the reference.
    """
    static = make_inputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*static)  # warm-up outside capture (lazy init, allocator)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for _ in range(2):
        fresh = make_inputs()
        for s, f in zip(static, fresh):
            if isinstance(s, torch.Tensor):
                s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        check(static, out)


# ---- merge_state ----

MERGE_SHAPES = [(1, 1, 8), (113, 3, 512), (239, 16, 64), (7, 5, 3), (33, 128, 512)]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def merge_inputs(T, H, D, dtype, device, empty_frac=0.1):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    v_a = torch.randn(T, H, D, generator=g).to(dtype)
    v_b = torch.randn(T, H, D, generator=g).to(dtype)
    s_a = torch.randn(T, H, generator=g) * 4
    s_b = torch.randn(T, H, generator=g) * 4
    # empty partials (-inf), including rows where both are empty
    s_a[torch.rand(T, H, generator=g) < empty_frac] = -math.inf
    s_b[torch.rand(T, H, generator=g) < empty_frac] = -math.inf
    return [t.to(device) for t in (v_a, s_a, v_b, s_b)]


def test_merge_state_reference_matches_full_softmax():
    """Merging two partial softmaxes equals one softmax over the union of keys (float64)."""
    T, H, D, ka, kb = 17, 3, 11, 5, 9
    scores = torch.randn(T, H, ka + kb, dtype=torch.float64) * 3
    values = torch.randn(ka + kb, D, dtype=torch.float64)

    def part(sl):
        s = scores[..., sl]
        return torch.softmax(s, -1) @ values[sl], torch.logsumexp(s, -1)

    v_a, s_a = part(slice(0, ka))
    v_b, s_b = part(slice(ka, ka + kb))
    v, s = kdtree_ops.merge_state(v_a, s_a, v_b, s_b)
    full_v, full_s = part(slice(0, ka + kb))
    assert rel_err(v, full_v) < 1e-12
    assert rel_err(s, full_s) < 1e-12


def test_merge_state_empty_partials():
    v_a, s_a, v_b, s_b = merge_inputs(5, 2, 8, torch.float32, "cpu", empty_frac=0.0)
    s_a[0, 0] = -math.inf
    s_a[1, 1] = s_b[1, 1] = -math.inf
    v, s = kdtree_ops.merge_state(v_a, s_a, v_b, s_b)
    assert torch.equal(v[0, 0], v_b[0, 0]) and s[0, 0] == s_b[0, 0]
    assert torch.all(v[1, 1] == 0) and s[1, 1] == -math.inf
    assert torch.isfinite(v).all()


@needs_gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,H,D", MERGE_SHAPES)
def test_merge_state_cuda_matches_reference(T, H, D, dtype):
    inputs = merge_inputs(T, H, D, dtype, "cuda")
    v, s = kdtree_ops.merge_state(*inputs)
    v_ref, s_ref = kdtree_ops.merge_state(*[t.cpu() for t in inputs])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(v, v_ref) < tol
    assert torch.equal(torch.isinf(s).cpu(), torch.isinf(s_ref))
    fin = torch.isfinite(s_ref)
    assert torch.allclose(s.cpu()[fin], s_ref[fin], atol=1e-5, rtol=1e-5)

    v_a, s_a = inputs[0].clone(), inputs[1].clone()
    kdtree_ops.merge_state_(v_a, s_a, inputs[2], inputs[3])
    assert torch.equal(v_a, v) and torch.equal(s_a, s)


@needs_gpu
def test_merge_state_cuda_strided_inputs():
    """Non-contiguous T/H strides (a view into a larger buffer) and the scalar path."""
    base = merge_inputs(9, 4, 64, torch.bfloat16, "cuda")
    v_a = torch.randn(9, 8, 64, device="cuda", dtype=torch.bfloat16)[:, ::2]
    s_a = (torch.randn(4, 9, device="cuda") * 3).t()
    args = [v_a, s_a, base[2], base[3]]
    v, s = kdtree_ops.merge_state(*args)
    v_ref, s_ref = kdtree_ops.merge_state(*[t.cpu() for t in args])
    assert rel_err(v, v_ref) < 1e-2 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_opcheck(device):
    args = merge_inputs(13, 3, 16, torch.bfloat16, device)
    torch.library.opcheck(torch.ops.kdtree.merge_state.default, args)
    torch.library.opcheck(torch.ops.kdtree.merge_state_.default, [a.clone() for a in args])


@needs_gpu
def test_merge_state_cuda_graph():
    def check(inputs, out):
        v_ref, s_ref = kdtree_ops.merge_state(*[t.cpu() for t in inputs])
        assert rel_err(out[0], v_ref) < 1e-2
        fin = torch.isfinite(s_ref)
        assert torch.allclose(out[1].cpu()[fin], s_ref[fin], atol=1e-5)

    graph_replay(kdtree_ops.merge_state, lambda: merge_inputs(57, 16, 512, torch.bfloat16, "cuda"), check)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_compile(device):
    @torch.compile(fullgraph=True)
    def f(v_a, s_a, v_b, s_b):
        v, s = kdtree_ops.merge_state(v_a * 2, s_a, v_b, s_b)
        return v + 1, s

    args = merge_inputs(11, 2, 32, torch.float32, device)
    v, s = f(*args)
    v_ref, s_ref = kdtree_ops.merge_state(args[0].cpu() * 2, *[t.cpu() for t in args[1:]])
    assert rel_err(v, v_ref + 1) < 1e-5


def test_merge_state_rejects_bad_input():
    v_a, s_a, v_b, s_b = merge_inputs(4, 2, 8, torch.float32, "cpu")
    if GPU:
        cuda = [t.cuda() for t in (v_a, s_a, v_b, s_b)]
        with pytest.raises(RuntimeError, match="s_a must be float32"):
            kdtree_ops.merge_state(cuda[0], cuda[1].double(), cuda[2], cuda[3])
        with pytest.raises(RuntimeError, match="v_b must have shape"):
            kdtree_ops.merge_state(cuda[0], cuda[1], cuda[2][:, :1], cuda[3])
        with pytest.raises(RuntimeError, match="v_b must be a CUDA tensor"):
            kdtree_ops.merge_state(cuda[0], cuda[1], v_b, cuda[3])
    with pytest.raises(RuntimeError):
        kdtree_ops.merge_state(v_a, s_a[:, :1], v_b, s_b)


# ---- verify attention ----


# ---- tree ops ----


# ---- kv movement ----
