"""Tests for kdtree_ops. CPU tests always run; GPU tests need a CUDA GPU and the built kernels.

Every op is checked the same way: CUDA against the CPU reference on fresh random data at odd
sizes, ``torch.library.opcheck``, CUDA-graph capture + replay with changed inputs, and
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import sys

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


# ---- JIT build ----


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"), reason="needs nvcc")
def test_two_processes_on_an_empty_cache_build_once(tmp_path):
    """Concurrent importers (e.g. 8 TP ranks) serialise on the lock; only the first compiles."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cu").write_text("__global__ void tiny_kernel(int* x) { *x = 1; }\n")
    script = (
        "import pathlib, sys, kdtree_ops\n"
        "kdtree_ops.SRC_DIR = pathlib.Path(sys.argv[1])\n"
        "print(kdtree_ops.build(arch=['9.0']))\n"
    )
    env = dict(os.environ, KDTREE_CACHE_DIR=str(tmp_path / "cache"), KDTREE_NO_BUILD="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(src)], env=env, cwd=os.path.dirname(__file__),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1 and os.path.exists(paths.pop())
    assert sum("building CUDA kernels" in err for _, err in results) == 1, results


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


def random_tree_mask(nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[nodes, nodes] bool ancestor-or-self mask of a random tree (parents before children)."""
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        if i:
            parent = int(torch.randint(0, i, (1,), generator=generator))
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_verify_case(prefix_lens, node_counts, heads, *, dtype=torch.bfloat16, device="cuda",
                     pool=None, causal=False, index_dtype=torch.int32, kv_3d=False, seed=None):
    """Random verify batch: scattered prefix slots in a pool, random trees, packed masks."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    B, total = len(prefix_lens), sum(prefix_lens)
    T, nmax = sum(node_counts), max(node_counts)
    S = pool or max(2 * total + 16, 64)
    kv_cache = torch.empty(S, 576, dtype=dtype, device=device)
    slots = torch.randperm(S, generator=g)[:total].to(device)
    kv_cache[slots] = torch.randn(total, 576, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(T, heads, 576, generator=g).to(device=device, dtype=dtype)
    tree_k = torch.randn(T, 576, generator=g).to(device=device, dtype=dtype)
    kv_indptr = torch.tensor([0, *itertools.accumulate(prefix_lens)], dtype=torch.int32, device=device)
    qo_indptr = torch.tensor([0, *itertools.accumulate(node_counts)], dtype=torch.int32, device=device)
    visible = torch.zeros(T, nmax, dtype=torch.bool)
    for b, n in enumerate(node_counts):
        q0 = int(qo_indptr[b])
        visible[q0 : q0 + n, :n] = torch.ones(n, n, dtype=torch.bool).tril() if causal else random_tree_mask(n, g)
    return {
        "q": q,
        "kv_cache": kv_cache.view(S, 1, 576) if kv_3d else kv_cache,
        "kv_indptr": kv_indptr,
        "kv_indices": slots.to(index_dtype),
        "qo_indptr": qo_indptr,
        "tree_k": tree_k,
        "tree_mask": None if causal else kdtree_ops._pack_bits(visible, -(-nmax // 32)).to(device),
        "sm_scale": 1.0 / math.sqrt(192),
        "visible": visible,
    }


VERIFY_ARGS = ["q", "kv_cache", "kv_indptr", "kv_indices", "qo_indptr", "tree_k", "tree_mask", "sm_scale"]


def verify_args(case):
    return [case[k] for k in VERIFY_ARGS]


def verify_reference(case):
    """float64 reference on the inputs' own device (fast on a GPU)."""
    args = verify_args(case)
    for i in (0, 1, 5):
        args[i] = args[i].double()
    return kdtree_ops._verify_attn_math(*args)


def assert_verify_close(out, lse, case, tol=1e-2):
    ref_out, ref_lse = verify_reference(case)
    assert out.dtype == case["q"].dtype and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf)
    assert torch.allclose(lse[~inf].double(), ref_lse[~inf], atol=2e-3, rtol=1e-4)


def test_verify_attn_reference_matches_dense_attention():
    """The per-request reference equals one dense masked softmax over [prefix | tree] keys."""
    case = make_verify_case([7, 0, 12], [3, 4, 1], 2, dtype=torch.float64, device="cpu")
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    kv, q, tk = case["kv_cache"], case["q"], case["tree_k"]
    qo, kvp = case["qo_indptr"].tolist(), case["kv_indptr"].tolist()
    for b in range(3):
        for i in range(qo[b], qo[b + 1]):
            keys = [kv[int(s)] for s in case["kv_indices"][kvp[b] : kvp[b + 1]]]
            keys += [tk[qo[b] + j] for j in range(qo[b + 1] - qo[b]) if case["visible"][i, j]]
            keys = torch.stack(keys)
            for h in range(2):
                s = keys @ q[i, h] * case["sm_scale"]
                assert torch.allclose(out[i, h], torch.softmax(s, 0) @ keys[:, :512], atol=1e-12)
                assert torch.allclose(lse[i, h], torch.logsumexp(s, 0), atol=1e-12)


def test_verify_attn_reference_rows_that_see_nothing():
    case = make_verify_case([0], [2], 1, dtype=torch.float32, device="cpu")
    case["tree_mask"] = torch.tensor([[0], [2]], dtype=torch.int32)  # row 0 sees no node
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    assert lse[0, 0] == -math.inf and torch.all(out[0] == 0) and torch.isfinite(lse[1]).all()


VERIFY_GRID = [  # (prefix lens, node counts, heads)
    ([0], [9], 16),  # no prefix
    ([37, 0], [9, 5], 16),
    ([113, 0, 239, 1000, 5], [1, 9, 33, 2, 17], 3),  # unequal trees
    ([100, 64, 127, 129, 1], [60, 65, 1, 2, 64], 5),  # prefix/tree boundaries at and around 64-key tiles
    ([4096], [9], 1),
    ([2049], [65], 128),
    ([300], [1025], 2),  # largest tree
    ([17] * 256, [3] * 256, 4),  # batch 256
    ([8191, 77], [257, 31], 16),
]

# The kernels verify_attn chooses from on an H100/H200 (sm_90); on any other GPU every setting
# runs the portable kernel.
VERIFY_KERNEL_ENV = {
    "seesaw": {},
    "wgmma": {"KDTREE_VERIFY_SEESAW": "0"},
    "portable": {"KDTREE_VERIFY_WGMMA": "0"},
}


@pytest.fixture(params=list(VERIFY_KERNEL_ENV))
def verify_kernel(request, monkeypatch):
    """Runs the test once per kernel (the choice is read at every call, so also at capture)."""
    for name in ("KDTREE_VERIFY_SEESAW", "KDTREE_VERIFY_WGMMA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in VERIFY_KERNEL_ENV[request.param].items():
        monkeypatch.setenv(name, value)
    return request.param


@needs_gpu
@pytest.mark.parametrize("prefix_lens,node_counts,heads", VERIFY_GRID)
def test_verify_attn_cuda_matches_float64(verify_kernel, prefix_lens, node_counts, heads):
    case = make_verify_case(prefix_lens, node_counts, heads)
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    assert_verify_close(out, lse, case)
    # the split count follows the hint; the result must not
    out2, lse2 = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=max(prefix_lens))
    assert_verify_close(out2, lse2, case)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("causal", [False, True])
def test_verify_attn_cuda_dtypes_layouts(verify_kernel, dtype, index_dtype, causal):
    case = make_verify_case([513, 64], [16, 7], 8, dtype=dtype, index_dtype=index_dtype,
                            causal=causal, kv_3d=index_dtype == torch.int64)
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    assert_verify_close(out, lse, case)


@needs_gpu
@pytest.mark.parametrize("sm_scale", [-0.07, 0.0])
def test_verify_attn_cuda_nonpositive_scale(verify_kernel, sm_scale):
    """Scales the seesaw kernel does not take run on another kernel, with the same result."""
    case = dict(make_verify_case([700, 30], [9, 17], 8), sm_scale=sm_scale)
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    assert_verify_close(out, lse, case)


INDPTR_DTYPES = list(itertools.product([torch.int32, torch.int64], repeat=2))  # (kv_indptr, qo_indptr)


def with_indptr_dtypes(case, kv_dtype, qo_dtype):
    return dict(case, kv_indptr=case["kv_indptr"].to(kv_dtype), qo_indptr=case["qo_indptr"].to(qo_dtype))


def test_verify_attn_reference_int64_indptr():
    """The CPU reference reads int64 indptrs (either or both) as it reads int32 ones."""
    case = make_verify_case([7, 0, 12], [3, 4, 1], 2, dtype=torch.float64, device="cpu")
    ref_out, ref_lse = kdtree_ops.verify_attn(*verify_args(case))
    for kv_dtype, qo_dtype in INDPTR_DTYPES[1:]:
        out, lse = kdtree_ops.verify_attn(*verify_args(with_indptr_dtypes(case, kv_dtype, qo_dtype)))
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@needs_gpu
@pytest.mark.parametrize("kv_dtype,qo_dtype", INDPTR_DTYPES)
def test_verify_attn_cuda_indptr_dtypes(verify_kernel, kv_dtype, qo_dtype):
    """kv_indptr and qo_indptr each int32 or int64 (SGLang's graph buffers mix them), read
    natively by every kernel, eager and in a replayed CUDA graph."""
    shape = ([113, 0, 1500], [9, 5, 17], 16)
    case = with_indptr_dtypes(make_verify_case(*shape), kv_dtype, qo_dtype)
    out, lse = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=1500)
    assert_verify_close(out, lse, case)

    def fresh():
        c = with_indptr_dtypes(make_verify_case(*shape, pool=4000), kv_dtype, qo_dtype)
        return [c[k] for k in VERIFY_ARGS[:-1]]

    def check(inputs, out):
        case = dict(zip(VERIFY_ARGS, [*inputs, 1.0 / math.sqrt(192)]))
        assert_verify_close(out[0], out[1], case)

    graph_replay(lambda *a: kdtree_ops.verify_attn(*a, 1.0 / math.sqrt(192), max_kv_len=2048), fresh, check)


@needs_gpu
def test_verify_attn_cuda_long_context_and_big_pool():
    """256k-token prefix with slots spread over a pool past 4 GB (64-bit offsets)."""
    S = (5 << 30) // 1152  # 5 GiB of latent rows
    case = make_verify_case([262144], [9], 16, pool=S)
    case["kv_indices"][-100:] = torch.arange(S - 100, S, device="cuda", dtype=torch.int32)
    case["kv_cache"][S - 100 :] = torch.randn(100, 576, device="cuda", dtype=torch.bfloat16)
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    assert_verify_close(out, lse, case)
    del case
    torch.cuda.empty_cache()


@needs_gpu
def test_verify_attn_out_writes_strided_buffer():
    """SGLang's output buffer is o = q.new_empty(T, H*512), viewed as [T, H, 512]."""
    case = make_verify_case([200, 33], [9, 9], 16)
    T = case["q"].shape[0]
    o = torch.full((T, 16 * 512 + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((T, 16), float("nan"), device="cuda")
    out_view = o[:, : 16 * 512].view(T, 16, 512)
    res, _ = kdtree_ops.verify_attn(*verify_args(case), out=out_view, lse=lse)
    assert res.data_ptr() == out_view.data_ptr()
    assert_verify_close(out_view, lse, case)
    assert torch.isnan(o[:, 16 * 512 :]).all()  # nothing outside the view touched


@needs_gpu
def test_verify_attn_cuda_graph(verify_kernel):
    """Capture and replay with fresh inputs (splits, so the merge is captured too)."""
    shape = ([1500, 40], [9, 13], 16)

    def fresh():
        c = make_verify_case(*shape, pool=4000)
        return [c[k] for k in VERIFY_ARGS[:-1]]

    def check(inputs, out):
        case = dict(zip(VERIFY_ARGS, [*inputs, 1.0 / math.sqrt(192)]))
        assert_verify_close(out[0], out[1], case)

    graph_replay(lambda *a: kdtree_ops.verify_attn(*a, 1.0 / math.sqrt(192), max_kv_len=2048), fresh, check)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_attn_opcheck(device):
    case = make_verify_case([23, 5], [3, 6], 2, device=device)
    torch.library.opcheck(torch.ops.kdtree.verify_attn.default, verify_args(case))
    T = case["q"].shape[0]
    out = torch.empty(T, 2, 512, device=device, dtype=torch.bfloat16)
    lse = torch.empty(T, 2, device=device)
    torch.library.opcheck(torch.ops.kdtree.verify_attn_out.default, [*verify_args(case), out, lse])
    masks = (torch.rand(7, 45) < 0.5).to(device)
    torch.library.opcheck(torch.ops.kdtree.pack_tree_mask.default, [masks])


@pytest.mark.parametrize("device", DEVICES)
def test_verify_attn_compile(device):
    case = make_verify_case([40, 3], [5, 2], 4, device=device)

    @torch.compile(fullgraph=True)
    def f(q, kv, kvp, kvi, qo, tk, mask):
        out, lse = kdtree_ops.verify_attn(q * 1, kv, kvp, kvi, qo, tk, mask, case["sm_scale"])
        return out.float() * 2, lse

    out, lse = f(*verify_args(case)[:-1])
    ref_out, _ = verify_reference(case)
    assert rel_err(out / 2, ref_out) < 1e-2


def sglang_flat_mask(case):
    """SGLang's TARGET_VERIFY custom mask: per request nodes x (prefix + nodes), row-major."""
    qo, kvp = case["qo_indptr"].tolist(), case["kv_indptr"].tolist()
    blocks, indptr = [], [0]
    for b in range(len(qo) - 1):
        n, prefix = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        block = torch.ones(n, prefix + n, dtype=torch.bool)
        block[:, prefix:] = case["visible"][qo[b] : qo[b + 1], :n]
        blocks.append(block.flatten())
        indptr.append(indptr[-1] + block.numel())
    return torch.cat(blocks), torch.tensor(indptr, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_mask_to_packed(device):
    case = make_verify_case([5, 0, 70], [9, 33, 1], 1, device="cpu")
    flat, indptr = sglang_flat_mask(case)
    args = [flat.to(device), indptr.to(device), case["qo_indptr"].to(device), case["kv_indptr"].to(device)]
    packed = kdtree_ops.sglang_mask_to_packed(*args, num_rows=43, max_nodes=33)
    assert torch.equal(packed.cpu(), case["tree_mask"])
    assert torch.equal(kdtree_ops.sglang_mask_to_packed(*args).cpu(), case["tree_mask"])
    assert torch.equal(kdtree_ops.sglang_mask_to_packed(args[0].to(torch.uint8), *args[1:]).cpu(), case["tree_mask"])
    torch.library.opcheck(torch.ops.kdtree.sglang_mask_to_packed.default, [*args, 43, 33])


@pytest.mark.parametrize("device", DEVICES)
def test_pack_tree_mask(device):
    mask = torch.rand(13, 70) < 0.5
    packed = kdtree_ops.pack_tree_mask(mask.to(device)).cpu()
    assert packed.shape == (13, 3) and packed.dtype == torch.int32
    assert torch.equal(kdtree_ops._unpack_bits(packed, 70), mask)


def mask_inputs(device):
    """A fresh verify batch's SGLang flat mask, its expected packed rows and the op inputs."""
    case = make_verify_case([5, 0, 70], [9, 33, 1], 1, device="cpu")
    flat, indptr = sglang_flat_mask(case)
    args = [flat.to(device), indptr.to(device), case["qo_indptr"].to(device), case["kv_indptr"].to(device)]
    return args, case["visible"].to(device), case["tree_mask"]


@needs_gpu
def test_mask_ops_cuda_graph():
    """Both packers captured once, replayed on new trees of the same shapes."""
    def fresh():
        args, visible, _ = mask_inputs("cuda")
        return [*args, visible]

    def check(inputs, out):
        flat, indptr, qo, kvp, visible = [t.cpu() for t in inputs]
        assert torch.equal(out[0].cpu(), kdtree_ops.sglang_mask_to_packed(flat, indptr, qo, kvp, num_rows=43, max_nodes=33))
        assert torch.equal(out[1].cpu(), kdtree_ops.pack_tree_mask(visible))

    def fn(flat, indptr, qo, kvp, visible):
        return (kdtree_ops.sglang_mask_to_packed(flat, indptr, qo, kvp, num_rows=43, max_nodes=33),
                kdtree_ops.pack_tree_mask(visible))

    graph_replay(fn, fresh, check)


@pytest.mark.parametrize("device", DEVICES)
def test_mask_ops_compile(device):
    args, visible, expected = mask_inputs(device)

    @torch.compile(fullgraph=True)
    def f(flat, indptr, qo, kvp, visible):
        return (kdtree_ops.sglang_mask_to_packed(flat, indptr, qo, kvp, num_rows=43, max_nodes=33),
                kdtree_ops.pack_tree_mask(visible))

    packed_flat, packed_bool = f(*args, visible)
    assert torch.equal(packed_flat.cpu(), expected) and torch.equal(packed_bool.cpu(), expected)


def test_verify_attn_check_mode_rejects_bad_indices(monkeypatch):
    case = make_verify_case([10, 4], [3, 2], 2, device="cpu", pool=20)
    monkeypatch.setenv("KDTREE_CHECK", "1")
    bad = dict(case, kv_indices=case["kv_indices"].clone())
    bad["kv_indices"][3] = 20
    with pytest.raises(ValueError, match="kv_indices must lie in"):
        kdtree_ops.verify_attn(*verify_args(bad))
    bad = dict(case, kv_indptr=torch.tensor([0, 10, 15], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_indptr"):
        kdtree_ops.verify_attn(*verify_args(bad))
    kdtree_ops.verify_attn(*verify_args(case))  # the good case passes the checks


@pytest.mark.parametrize("device", DEVICES)
def test_verify_attn_rejects_bad_input(device):
    case = make_verify_case([10], [3], 2, device=device)
    bad = [
        ("q", case["q"][..., :512], "q must be"),
        ("kv_cache", case["kv_cache"].half(), "kv_cache must be"),
        ("kv_indptr", case["kv_indptr"].short(), "kv_indptr must be"),
        ("qo_indptr", case["qo_indptr"].float(), "qo_indptr must be"),
        ("tree_k", case["tree_k"][:2], "tree_k must"),
        ("tree_mask", case["tree_mask"][:1], "tree_mask must be"),
        ("kv_indices", case["kv_indices"].float(), "kv_indices must be"),
    ]
    for name, value, message in bad:
        args = dict(case, **{name: value})
        with pytest.raises(RuntimeError, match=message):
            kdtree_ops.verify_attn(*verify_args(args))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="kv_cache must be a CUDA tensor"):
            kdtree_ops.verify_attn(*verify_args(dict(case, kv_cache=case["kv_cache"].cpu())))



# ---- tree ops ----

import itertools  # noqa: E402

from hypothesis import given, settings, strategies as st  # noqa: E402

# Log-prob value sets: "ties" sums exactly (many equal scores), "absorb" has terms that vanish
# in float32 sums (equal scores across depths), "wild" is unsorted with positive values (the
# build must still replay the heap exactly), "inf" has -inf tails.
TIE_VALUES = [0.0, -0.5, -1.0, -1.5, -2.0]
ABSORB_VALUES = [0.0, -1e-30, -3e-8, -1.0, -1e7]


def tree_inputs(B, L, K, kind="normal", device="cpu", tok_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        lp = torch.log_softmax(torch.randn(B, L, max(K, 2), generator=g) * 3, -1)[..., :K]
    elif kind in ("ties", "absorb", "inf"):
        vals = torch.tensor(ABSORB_VALUES if kind == "absorb" else TIE_VALUES)
        lp = vals[torch.randint(0, len(vals), (B, L, K), generator=g)]
        if kind == "inf":
            lp[torch.rand(B, L, K, generator=g) < 0.3] = -math.inf
    elif kind == "wild":
        lp = torch.randint(-3, 2, (B, L, K), generator=g).float()
    else:
        raise ValueError(kind)
    if kind != "wild":
        lp = lp.sort(-1, descending=True).values
    tok = torch.randint(0, 50000, (B, L, K), generator=g).to(tok_dtype)
    root = torch.randint(0, 50000, (B,), generator=g)
    return [t.contiguous().to(device) for t in (lp.float(), tok, root)]


def brute_force_tree(lp, tok, root, budget):
    """Top-`budget` prefixes by (float32 score desc, rank tuple), by full enumeration."""
    L, K = len(lp), min(len(lp[0]), budget)
    prefixes = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            s = 0.0
            for depth, r in enumerate(ranks):
                s = kdtree_ops._f32_add(s, lp[depth][r])
            prefixes.append((-s, ranks))
    order = [ranks for _, ranks in sorted(prefixes)[:budget]]
    index = {ranks: i + 1 for i, ranks in enumerate(order)}
    tokens = [root] + [tok[len(r) - 1][r[-1]] for r in order]
    parents = [-1] + [index.get(r[:-1], 0) for r in order]
    depths = [0] + [len(r) for r in order]
    return tokens, parents, depths


def check_tree_invariants(tree, topk_tokens, budget):
    B, N = tree.tokens.shape
    L, K = topk_tokens.shape[1], topk_tokens.shape[2]
    keff = min(K, budget)
    possible = sum(keff**d for d in range(1, L + 1))
    assert tree.num_nodes.tolist() == [min(budget, possible) + 1] * B
    W = (N + 31) // 32
    for b in range(B):
        n = int(tree.num_nodes[b])
        par, dep = tree.parents[b].tolist(), tree.depths[b].tolist()
        assert par[0] == -1 and dep[0] == 0
        rows = [0] * N
        for i in range(n):
            if i:
                assert 0 <= par[i] < i and dep[i] == dep[par[i]] + 1 <= L
            rows[i] = (rows[par[i]] if i else 0) | 1 << i
        assert all(p == -1 for p in par[n:]) and all(d == 0 for d in dep[n:])
        assert tree.tokens[b, n:].eq(0).all()
        assert torch.equal(tree.mask[b].cpu(), kdtree_ops._pack_rows(rows, W))


@pytest.mark.parametrize("kind", ["normal", "ties", "absorb", "inf"])
@pytest.mark.parametrize("L,K,budget", [(1, 1, 1), (1, 5, 3), (3, 2, 14), (3, 3, 50), (4, 3, 7), (2, 6, 9), (5, 2, 40)])
def test_build_tree_reference_is_top_prefixes(L, K, budget, kind):
    lp, tok, root = tree_inputs(2, L, K, kind, seed=L * 100 + K * 10 + budget)
    tree = kdtree_ops.build_tree(lp, tok, root, budget)
    check_tree_invariants(tree, tok, budget)
    for b in range(2):
        n = int(tree.num_nodes[b])
        tokens, parents, depths = brute_force_tree(lp[b].tolist(), tok[b].tolist(), int(root[b]), budget)
        assert tree.tokens[b, :n].tolist() == tokens
        assert tree.parents[b, :n].tolist() == parents
        assert tree.depths[b, :n].tolist() == depths


@settings(max_examples=150, deadline=None)
@given(
    L=st.integers(1, 4),
    K=st.integers(1, 4),
    budget=st.integers(1, 60),
    values=st.lists(st.sampled_from(TIE_VALUES + ABSORB_VALUES + [-math.inf]), min_size=1, max_size=64),
)
def test_build_tree_reference_property(L, K, budget, values):
    n = L * K
    lp = torch.tensor((values * n)[:n]).view(1, L, K).sort(-1, descending=True).values.contiguous()
    tok = torch.arange(n, dtype=torch.int64).view(1, L, K)
    tree = kdtree_ops.build_tree(lp, tok, torch.tensor([7]), budget)
    check_tree_invariants(tree, tok, budget)
    m = int(tree.num_nodes[0])
    assert brute_force_tree(lp[0].tolist(), tok[0].tolist(), 7, budget) == (
        tree.tokens[0, :m].tolist(),
        tree.parents[0, :m].tolist(),
        tree.depths[0, :m].tolist(),
    )


def test_build_tree_reference_hand_case():
    # depth 1: a (-0.1), b (-1.0); depth 2: x (-0.2), y (-3.0)
    lp = torch.tensor([[[-0.1, -1.0], [-0.2, -3.0]]])
    tok = torch.tensor([[[10, 11], [20, 21]]])
    tree = kdtree_ops.build_tree(lp, tok, torch.tensor([1]), 5)
    # a (-0.1), ax (-0.3), b (-1.0), bx (-1.2), ay (-3.1)
    assert tree.tokens[0].tolist() == [1, 10, 20, 11, 20, 21]
    assert tree.parents[0].tolist() == [-1, 0, 1, 0, 3, 1]
    assert tree.depths[0].tolist() == [0, 1, 2, 1, 2, 2]
    assert tree.mask[0, :, 0].tolist() == [0b1, 0b11, 0b111, 0b1001, 0b11001, 0b100011]


def test_draft_topk_matches_log_softmax():
    logits = torch.randn(3, 5, 97) * 4
    lp, tok = kdtree_ops.draft_topk(logits, 7)
    ref_lp, ref_tok = torch.log_softmax(logits, -1).topk(7, -1)
    assert lp.dtype == torch.float32 and tok.dtype == torch.int64 and lp.shape == (3, 5, 7)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.equal(tok, ref_tok)
    assert (lp[..., 1:] <= lp[..., :-1]).all()
    lp16, _ = kdtree_ops.draft_topk(logits.bfloat16(), 7)
    assert lp16.dtype == torch.float32


def unpack_mask(mask, N):
    j = torch.arange(N, device=mask.device)
    return ((mask[..., j // 32] >> (j % 32)) & 1).bool()


def python_flat_mask(tree, prefix_lens):
    """SGLang-style per-request loop: prefix columns True, then the tree's ancestor rows."""
    N = tree.tokens.shape[1]
    blocks = []
    for b, P in enumerate(prefix_lens.tolist()):
        prefix = torch.ones(N, P, dtype=torch.bool, device=tree.mask.device)
        blocks.append(torch.cat([prefix, unpack_mask(tree.mask[b], N)], 1).reshape(-1))
    return torch.cat(blocks)


def check_retrieve(meta, tree):
    B, N = tree.parents.shape
    assert torch.equal(meta.retrieve_index.cpu(), torch.arange(B * N).view(B, N))
    nxt, sib, par = meta.retrieve_next_token.tolist(), meta.retrieve_next_sibling.tolist(), tree.parents.tolist()
    for b in range(B):
        for i in range(N):
            children, c = [], nxt[b][i]
            while c != -1:
                children.append(c)
                c = sib[b][c]
            assert children == [j for j in range(N) if par[b][j] == i]
        assert sib[b][0] == -1


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_verify_metadata_reference(index_dtype):
    lp, tok, root = tree_inputs(3, 3, 2, "ties", seed=3)
    tree = kdtree_ops.build_tree(lp, tok, root, 20)  # 14 possible prefixes: unused slots too
    prefix_lens = torch.tensor([5, 0, 17], dtype=index_dtype)
    N = 21
    size = kdtree_ops.flat_mask_size(22, 3, N)
    meta = kdtree_ops.verify_metadata(tree, prefix_lens, retrieve=True, custom_mask_capacity=size + 9)
    assert torch.equal(meta.positions, (prefix_lens[:, None].long() + tree.depths).reshape(-1))
    assert meta.qo_indptr.tolist() == [0, N, 2 * N, 3 * N] and meta.qo_indptr.dtype == torch.int32
    assert meta.mask_indptr.tolist() == [0, N * (5 + N), N * (5 + N) + N * N, size]
    assert torch.equal(meta.custom_mask[:size], python_flat_mask(tree, prefix_lens))
    assert not meta.custom_mask[size:].any()
    check_retrieve(meta, tree)
    small = kdtree_ops.verify_metadata(tree, prefix_lens, custom_mask_capacity=size - 100)
    assert torch.equal(small.custom_mask, meta.custom_mask[: size - 100])
    assert small.retrieve_index is None


def test_accept_walk_reference_hand_case():
    # root -> 1 (5), 2 (7), 3 (5); 1 -> 4 (9); 3 -> 5 (8)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 3]], dtype=torch.int32)
    tokens = torch.tensor([[100, 5, 7, 5, 9, 8]])
    tree = kdtree_ops.Tree(tokens, parents, parents.clamp_min(0) * 0, torch.tensor([6], dtype=torch.int32), None)
    target = torch.tensor([[5, 9, 0, 8, 11, 12]])
    acc, n, bonus = kdtree_ops.accept_walk(tree, target, max_depth=3)
    assert acc.tolist() == [[0, 1, 4, -1]] and n.tolist() == [3] and bonus.tolist() == [11]
    acc, n, bonus = kdtree_ops.accept_walk(tree, target, max_depth=1)  # capacity stops the walk
    assert acc.tolist() == [[0, 1]] and n.tolist() == [2] and bonus.tolist() == [9]
    acc, n, bonus = kdtree_ops.accept_walk(tree, torch.tensor([[6, 0, 0, 0, 0, 0]]))
    assert acc.tolist() == [[0, -1, -1, -1, -1, -1]] and n.tolist() == [1] and bonus.tolist() == [6]


def walk_targets(tree, seed, follow=0.85):
    """Target tokens that mostly follow the tree; some siblings share a token (tie rule)."""
    g = torch.Generator().manual_seed(seed)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    B, N = len(tokens), len(tokens[0])
    rand = torch.rand(B, N, 2, generator=g).tolist()
    target = torch.randint(0, 50000, (B, N), generator=g).tolist()
    for b in range(B):
        kids = [[] for _ in range(N)]
        for j in range(1, N):
            p = parents[b][j]
            if p < 0:
                continue
            if kids[p] and rand[b][j][0] < 0.2:  # duplicate an earlier sibling's token
                tokens[b][j] = tokens[b][kids[p][0]]
            kids[p].append(j)
        for i in range(N):
            if kids[i] and rand[b][i][1] < follow:
                target[b][i] = tokens[b][kids[i][int(rand[b][i][0] * len(kids[i]))]]
    dev = tree.tokens.device
    return tree._replace(tokens=torch.tensor(tokens, device=dev)), torch.tensor(target, device=dev)


def test_accept_walk_reference_properties():
    lp, tok, root = tree_inputs(6, 6, 4, "normal", seed=11)
    tree, target = walk_targets(kdtree_ops.build_tree(lp, tok, root, 60), seed=1)
    acc, n, bonus = kdtree_ops.accept_walk(tree, target, max_depth=6)
    assert acc.shape == (6, 7) and (n >= 1).all()
    for b in range(6):
        path = acc[b, : int(n[b])].tolist()
        assert path[0] == 0 and (acc[b, int(n[b]) :] == -1).all()
        for u, v in zip(path, path[1:]):
            assert int(tree.parents[b, v]) == u and tree.tokens[b, v] == target[b, u]
            assert not any(int(tree.parents[b, j]) == u and tree.tokens[b, j] == target[b, u] for j in range(1, v))
        last = path[-1]
        assert int(bonus[b]) == int(target[b, last])
        assert not any(int(tree.parents[b, j]) == last and tree.tokens[b, j] == bonus[b] for j in range(1, 61))


def tree_op_args(device, budget=40, B=3):
    lp, tok, root = tree_inputs(B, 5, 6, "ties", device=device, seed=5)
    tree = kdtree_ops.build_tree(lp, tok, root, budget)
    prefix_lens = torch.tensor([3, 0, 12][:B], device=device)
    return lp, tok, root, tree, prefix_lens


@pytest.mark.parametrize("device", DEVICES)
def test_tree_ops_opcheck(device):
    lp, tok, root, tree, prefix_lens = tree_op_args(device)
    tree, target = walk_targets(tree, seed=2)
    torch.library.opcheck(torch.ops.kdtree.build_tree.default, (lp, tok, root, 40))
    torch.library.opcheck(torch.ops.kdtree.build_tree.default, (lp, tok.int(), root, 7))
    for retrieve in (False, True):
        torch.library.opcheck(torch.ops.kdtree.verify_metadata.default, (tree.depths, tree.parents, prefix_lens, retrieve))
    torch.library.opcheck(torch.ops.kdtree.flat_custom_mask.default, (tree.mask, prefix_lens, 41 * (15 + 3 * 41) + 5))
    torch.library.opcheck(torch.ops.kdtree.accept_walk.default, (tree.parents, tree.tokens, target, 5))


def tree_pipeline(lp, tok, root, prefix_lens, target, budget=40, capacity=6000):
    tree = kdtree_ops.build_tree(lp, tok, root, budget)
    meta = kdtree_ops.verify_metadata(tree, prefix_lens, retrieve=True, custom_mask_capacity=capacity)
    walk = kdtree_ops.accept_walk(tree, target, max_depth=5)
    return tree, meta, walk


def check_pipeline(args, out):
    ref = tree_pipeline(*[a.cpu() for a in args])
    for got, want in zip(out, ref):
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w), (g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_tree_ops_compile(device):
    lp, tok, root, tree, prefix_lens = tree_op_args(device)
    target = walk_targets(tree, seed=3)[1]
    args = (lp, tok, root, prefix_lens, target)
    check_pipeline(args, torch.compile(tree_pipeline, fullgraph=True)(*args))


def test_tree_ops_reject_bad_input():
    lp, tok, root, tree, prefix_lens = tree_op_args("cpu")
    devices = ["cpu", "cuda"] if GPU else ["cpu"]
    for dev in devices:
        lp_, tok_, root_ = lp.to(dev), tok.to(dev), root.to(dev)
        with pytest.raises(RuntimeError, match="topk_logprobs must be (float32|Float)"):
            kdtree_ops.build_tree(lp_.double(), tok_, root_, 8)
        with pytest.raises(RuntimeError, match="topk_tokens must have shape"):
            kdtree_ops.build_tree(lp_, tok_[:, :, :2], root_, 8)
        with pytest.raises(RuntimeError, match="budget must be in"):
            kdtree_ops.build_tree(lp_, tok_, root_, 1025)
        with pytest.raises(RuntimeError, match="root_tokens must be (int64|Long)"):
            kdtree_ops.build_tree(lp_, tok_, root_.int(), 8)
        with pytest.raises(RuntimeError, match="prefix_lens must have shape"):
            kdtree_ops.verify_metadata(tree._replace(**{k: v.to(dev) for k, v in tree._asdict().items()}), prefix_lens[:2].to(dev))
        with pytest.raises(RuntimeError, match="target_tokens must have shape"):
            kdtree_ops.accept_walk(tree._replace(**{k: v.to(dev) for k, v in tree._asdict().items()}), tree.tokens[:, :3].to(dev))
    if GPU:
        with pytest.raises(RuntimeError, match="topk_tokens must be a CUDA tensor"):
            kdtree_ops.build_tree(lp.cuda(), tok, root.cuda(), 8)
        with pytest.raises(RuntimeError, match="topk_logprobs must be contiguous"):
            kdtree_ops.build_tree(lp.cuda().transpose(1, 2), tok.cuda().transpose(1, 2), root.cuda(), 8)


def random_tree_configs(count, seed):
    """(B, L, K, budget, kind, token dtype) covering budgets 1..1024, L 1..31, batch 1..64."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    kinds = ["normal", "ties", "absorb", "inf", "wild"]
    for i in range(count):
        budget = [pick(1, 16), pick(17, 128), pick(129, 1024), pick(1, 1024)][i % 4]
        B = pick(1, 64) if budget <= 128 else pick(1, 6)
        K = [pick(1, 4), pick(1, budget), budget + pick(0, 40), pick(1, 2048)][pick(0, 3)]
        yield B, pick(1, 31), K, budget, kinds[i % len(kinds)], [torch.int64, torch.int32][i % 2]


@needs_gpu
def test_build_tree_cuda_matches_reference():
    trees = 0
    for i, (B, L, K, budget, kind, tok_dtype) in enumerate(random_tree_configs(160, seed=1234)):
        args = tree_inputs(B, L, K, kind, device="cuda", tok_dtype=tok_dtype, seed=i)
        got = kdtree_ops.build_tree(*args, budget)
        want = kdtree_ops.build_tree(*[a.cpu() for a in args], budget)
        for name, g, w in zip(kdtree_ops.Tree._fields, got, want):
            assert torch.equal(g.cpu(), w), (i, B, L, K, budget, kind, name)
        trees += B
    assert trees >= 1000


@needs_gpu
@pytest.mark.parametrize(
    "B,L,K,budget,kind",
    [(1, 1, 1, 1, "normal"), (2, 31, 1, 1024, "ties"), (3, 1, 2000, 1024, "ties"), (64, 15, 512, 512, "normal"),
     (4, 31, 1024, 1024, "absorb"), (2, 2, 3, 1024, "inf"), (5, 15, 1, 8, "wild")],
)
def test_build_tree_cuda_edge_cases(B, L, K, budget, kind):
    args = tree_inputs(B, L, K, kind, device="cuda", seed=B + L + K)
    got = kdtree_ops.build_tree(*args, budget)
    want = kdtree_ops.build_tree(*[a.cpu() for a in args], budget)
    for name, g, w in zip(kdtree_ops.Tree._fields, got, want):
        assert torch.equal(g.cpu(), w), name


@needs_gpu
@pytest.mark.parametrize("case", ["flat", "peaked", "zeros", "wide_small_k"])
def test_build_tree_cuda_parallel_and_replay_paths(case):
    """The depth-wise build and the heap replay it falls back to agree with the reference.

    flat (logits x 3) gives shallow bushy trees; peaked (logits x 8) deep ones with thousands of
    candidates per depth until the bar is raised; K < budget leaves the top list short of the
    budget with K * K candidates at depth 2; all-zero log-probs make every prefix tie, so the
    bar cannot split them and the build overflows into the heap replay.
    """
    B, L = 4, 15
    g = torch.Generator().manual_seed(5)
    if case in ("flat", "peaked"):
        budget = K = 1024
        lp = torch.log_softmax(torch.randn(B, L, 4096, generator=g) * (3 if case == "flat" else 8), -1)
        lp = lp.topk(K, -1).values
    elif case == "zeros":
        budget = K = 1000
        lp = torch.zeros(B, 3, K)
    else:
        budget, K = 1024, 700
        lp = torch.log_softmax(torch.randn(B, L, K, generator=g), -1).sort(-1, descending=True).values
    tok = torch.randint(0, 50000, lp.shape, generator=g)
    root = torch.randint(0, 50000, (B,), generator=g)
    args = [t.contiguous() for t in (lp.float(), tok, root)]
    got = kdtree_ops.build_tree(*[a.cuda() for a in args], budget)
    want = kdtree_ops.build_tree(*args, budget)
    for name, a, b in zip(kdtree_ops.Tree._fields, got, want):
        assert torch.equal(a.cpu(), b), name


@needs_gpu
def test_verify_metadata_and_accept_walk_cuda_match_reference():
    g = torch.Generator().manual_seed(7)
    for i, (B, L, K, budget, kind, _) in enumerate(random_tree_configs(40, seed=99)):
        tree = kdtree_ops.build_tree(*tree_inputs(B, L, K, kind, device="cuda", seed=i), budget)
        tree, target = walk_targets(tree, seed=i)
        dtype = [torch.int32, torch.int64][i % 2]
        prefix_lens = torch.randint(0, 3000, (B,), generator=g, dtype=dtype)
        prefix_lens[0] = 0
        N = budget + 1
        size = kdtree_ops.flat_mask_size(int(prefix_lens.sum()), B, N)
        capacity = [size, size + 37, max(size - 1000, 0)][i % 3]
        args = (prefix_lens.cuda(),)
        meta = kdtree_ops.verify_metadata(tree, *args, retrieve=True, custom_mask_capacity=capacity)
        ref = kdtree_ops.verify_metadata(kdtree_ops.Tree(*[t.cpu() for t in tree]), prefix_lens, retrieve=True, custom_mask_capacity=capacity)
        for name, a, b in zip(kdtree_ops.VerifyMetadata._fields, meta, ref):
            assert torch.equal(a.cpu(), b), (i, name)
        for depth in (L, N - 1):
            got = kdtree_ops.accept_walk(tree, target, max_depth=depth)
            want = kdtree_ops.accept_walk(kdtree_ops.Tree(*[t.cpu() for t in tree]), target.cpu(), max_depth=depth)
            for a, b in zip(got, want):
                assert torch.equal(a.cpu(), b), i


@needs_gpu
def test_tree_ops_cuda_graph():
    seeds = iter(range(100))

    def make_inputs():
        s = next(seeds)
        lp, tok, root = tree_inputs(4, 7, 9, ["ties", "normal"][s % 2], device="cuda", seed=s)
        tree = kdtree_ops.build_tree(lp, tok, root, 40)
        prefix_lens = torch.randint(0, 20, (4,), device="cuda")
        return [lp, tok, root, prefix_lens[:4], walk_targets(tree, seed=s)[1][:4]]

    def fn(lp, tok, root, prefix_lens, target):
        return tree_pipeline(lp, tok, root, prefix_lens, target, capacity=4 * 41 * (20 + 41))

    def check(inputs, out):
        ref = fn(*[t.cpu() for t in inputs])
        for got, want in zip(out, ref):
            for g, w in zip(got, want):
                assert torch.equal(g.cpu(), w)

    graph_replay(fn, make_inputs, check)



# ---- kv movement ----

import defrag  # noqa: E402  (kept with its tests so other sections stay independent)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# (row shape, dtype): MLA latent rows, fp8-as-bytes, odd row sizes for every vector width
MOVE_LAYOUTS = [
    ((576,), torch.bfloat16),
    ((1, 576), torch.bfloat16),
    ((576,), torch.uint8),
    ((1, 576), torch.float32),
    ((3,), torch.float32),  # 12-byte rows: 4-byte vectors
    ((1, 5), torch.bfloat16),  # 10-byte rows: 2-byte vectors
    ((7,), torch.uint8),  # 7-byte rows: byte copies
]


def kv_pool(S, row_shape, dtype, layers, device, gen=None):
    bits = torch.randint(0, 256, (layers, S, *row_shape[:-1], row_shape[-1] * torch.empty(0, dtype=dtype).element_size()), dtype=torch.uint8, generator=gen)
    return [b.view(dtype).to(device) for b in bits]  # random bytes, NaN patterns included


def move_pairs(S, n, overlap, gen, pad_frac=0.1, dtype=torch.int64):
    """n slot pairs with distinct dst; src drawn from all slots (overlap) or from non-dst slots."""
    perm = torch.randperm(S, generator=gen)
    dst = perm[:n]
    pool = perm if overlap else perm[n:]
    src = pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
    pad = torch.rand(n, generator=gen) < pad_frac
    src[pad & (torch.rand(n, generator=gen) < 0.5)] = -1
    dst[pad] = -1
    return src.to(dtype), dst.to(dtype)


def move_kv_naive(kv_layers, src, dst):
    """The specification, one pair at a time, from a snapshot."""
    out = [kv.clone() for kv in kv_layers]
    for kv, o in zip(kv_layers, out):
        for s, d in zip(src.tolist(), dst.tolist()):
            if s >= 0 and d >= 0:
                o[d] = kv[s]
    return out


def same_bytes(a, b):
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


@pytest.mark.parametrize("disjoint", [False, True])
@pytest.mark.parametrize("row_shape,dtype", MOVE_LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_move_kv_matches_spec(device, row_shape, dtype, disjoint):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    S, n, layers = 97, 41, 3
    kv = kv_pool(S, row_shape, dtype, layers, "cpu", g)
    src, dst = move_pairs(S, n, overlap=not disjoint, gen=g)
    want = move_kv_naive(kv, src, dst)
    got = [t.to(device) for t in kv]
    kdtree_ops.move_kv(got, src.to(device), dst.to(device), disjoint=disjoint)
    assert all(same_bytes(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("device", DEVICES)
def test_move_kv_chains_cycles_and_many_layers(device):
    """Permutation cycles (every src is a dst), int32 indices, >64 layers (two launches),
    and a strided [S,1,512] view of a [S,1,576] pool (SGLang's value buffer)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    S = 300
    kv = kv_pool(S, (1, 576), torch.bfloat16, 70, "cpu", g)
    cyc = torch.randperm(S, generator=g)[:120]
    src, dst = cyc.to(torch.int32), cyc.roll(1).to(torch.int32)
    views = [t[..., :512] for t in kv]
    want = move_kv_naive(kv, src, dst)
    got = [t.to(device) for t in kv]
    kdtree_ops.move_kv(got, src.to(device), dst.to(device))
    assert all(same_bytes(a, b) for a, b in zip(got, want))
    want_v = move_kv_naive(views, src, dst)
    got = [t.to(device) for t in kv]
    got_v = [t[..., :512] for t in got]
    kdtree_ops.move_kv(got_v, src.to(device), dst.to(device))
    assert all(same_bytes(a, b) for a, b in zip(got_v, want_v))
    assert all(same_bytes(a[..., 512:], b[..., 512:]) for a, b in zip(got, kv))  # untouched


@pytest.mark.parametrize("device", DEVICES)
def test_move_kv_check_mode(device, monkeypatch):
    monkeypatch.setenv("KDTREE_CHECK", "1")
    kv = kv_pool(10, (8,), torch.bfloat16, 2, device)
    t = lambda *x: torch.tensor(x, device=device)  # noqa: E731
    with pytest.raises(RuntimeError, match="dst_slots must be distinct"):
        kdtree_ops.move_kv(kv, t(1, 2), t(3, 3))
    with pytest.raises(RuntimeError, match="must lie in"):
        kdtree_ops.move_kv(kv, t(1, 10), t(3, 4))
    with pytest.raises(RuntimeError, match="disjoint=True needs"):
        kdtree_ops.move_kv(kv, t(1, 3), t(3, 4), disjoint=True)
    kdtree_ops.move_kv(kv, t(1, -1, 5), t(-1, 3, 3))  # padding pairs never count


def test_move_kv_rejects_bad_input():
    kv = kv_pool(10, (8,), torch.bfloat16, 2, "cpu")
    cases = [
        ((kv, torch.tensor([1.0]), torch.tensor([2.0])), "src_slots must be int32 or int64"),
        ((kv, torch.tensor([1]), torch.tensor([2], dtype=torch.int32)), "dst_slots must be torch.int64"),
        ((kv, torch.tensor([1, 2]), torch.tensor([2])), "dst_slots must have 2 entries"),
        ((kv + [torch.zeros(11, 8, dtype=torch.bfloat16)], torch.tensor([1]), torch.tensor([2])), r"kv_layers\[2\] must have 10 slots"),
        ((kv + [torch.zeros(10, 4, dtype=torch.bfloat16)], torch.tensor([1]), torch.tensor([2])), r"kv_layers\[2\] must have rows of 16 bytes"),
    ]
    for dev in ["cpu"] + (["cuda"] if GPU else []):
        for (layers, s, d), msg in cases:
            with pytest.raises(RuntimeError, match=msg):
                kdtree_ops.move_kv([x.to(dev) for x in layers], s.to(dev), d.to(dev))
    if GPU:
        with pytest.raises(RuntimeError, match="contiguous rows"):
            kdtree_ops.move_kv([torch.zeros(10, 8, 2, device="cuda")[..., 0]], torch.tensor([1], device="cuda"), torch.tensor([2], device="cuda"))
        with pytest.raises(RuntimeError, match=r"kv_layers\[0\] must be a CUDA tensor"):
            kdtree_ops.move_kv([kv[0]], torch.tensor([1], device="cuda"), torch.tensor([2], device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_move_kv_opcheck(device):
    g = torch.Generator().manual_seed(0)
    kv = kv_pool(33, (1, 24), torch.bfloat16, 3, device, g)
    src, dst = move_pairs(33, 9, overlap=True, gen=g)
    torch.library.opcheck(torch.ops.kdtree.move_kv.default, (kv, src.to(device), dst.to(device)))
    torch.library.opcheck(torch.ops.kdtree.move_kv.default, (kv, src.to(device), dst.to(device)), {"disjoint": False})


@needs_gpu
@pytest.mark.parametrize("disjoint", [False, True])
def test_move_kv_cuda_graph(disjoint):
    S, n, layers = 4099, 517, 5
    last = {}

    def make_inputs():
        g = torch.Generator().manual_seed(torch.seed() % 2**31)
        src, dst = move_pairs(S, n, overlap=not disjoint, gen=g)
        kv = kv_pool(S, (1, 576), torch.bfloat16, layers, "cpu", g)
        last["want"] = move_kv_naive(kv, src, dst)
        return [src.cuda(), dst.cuda(), *[t.cuda() for t in kv]]

    def fn(src, dst, *kv):
        kdtree_ops.move_kv(list(kv), src, dst, disjoint=disjoint)

    def check(inputs, out):
        assert all(same_bytes(a, b) for a, b in zip(inputs[2:], last["want"]))

    graph_replay(fn, make_inputs, check)


@pytest.mark.parametrize("device", DEVICES)
def test_move_kv_compile(device):
    @torch.compile(fullgraph=True)
    def f(a, b, src, dst):
        kdtree_ops.move_kv([a, b], src, dst)
        return a.float().sum(-1) + b.float().sum(-1)

    g = torch.Generator().manual_seed(1)
    kv = kv_pool(40, (16,), torch.float32, 2, "cpu", g)
    kv = [t.nan_to_num(0.0, 0.0, 0.0) for t in kv]
    src, dst = move_pairs(40, 12, overlap=True, gen=g)
    want = move_kv_naive(kv, src, dst)
    got = [t.to(device) for t in kv]
    out = f(*got, src.to(device), dst.to(device))
    assert all(same_bytes(a, b) for a, b in zip(got, want))
    assert torch.allclose(out.cpu(), want[0].sum(-1) + want[1].sum(-1))


# accept: random increasing root-first paths through N-node windows


def accepted_paths(B, N, width, gen, device):
    accepted = torch.full((B, width), -1, dtype=torch.int32)
    accept_len = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        k = int(torch.randint(0, min(N, width) + 1, (1,), generator=gen))  # 0: padding request
        if k:
            rest = torch.randperm(N - 1, generator=gen)[: k - 1].sort().values + 1
            accepted[b, :k] = torch.cat((torch.zeros(1, dtype=torch.int32), rest.int()))
        accept_len[b] = k
    return accepted.to(device), accept_len.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_accept_compacts_windows(device):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, N, width, S, ctx = 5, 9, 7, 120, 64
    kv = kv_pool(S, (1, 24), torch.bfloat16, 3, device, g)
    loc = (torch.randperm(S - 1, generator=g)[: B * N] + 1).to(device)
    rows = torch.tensor([3, 1, 4, 2, 5], device=device)
    prefix = torch.tensor([0, 10, 50, 33, 7], device=device)
    rtt = torch.randint(1, S, (8, ctx), dtype=torch.int32, generator=g).to(device)
    accepted, accept_len = accepted_paths(B, N, width, g, device)
    before, rtt0 = [t.clone() for t in kv], rtt.clone()
    m = defrag.commit_accept(kv, rtt, rows, prefix, accepted, accept_len, loc, N)
    want_rtt = rtt0.clone()
    win = loc.view(B, N)
    for b in range(B):
        k, r, p = int(accept_len[b]), int(rows[b]), int(prefix[b])
        for j in range(k):
            node = int(accepted[b, j])
            for a, o in zip(kv, before):
                assert same_bytes(a[win[b, j]], o[win[b, node]])
            want_rtt[r, p + j] = win[b, j]
        assert m.kept[b, :k].tolist() == win[b, :k].tolist() and (m.kept[b, k:] == -1).all()
        assert m.freed[b].tolist() == [-1] * k + win[b, k:].tolist()
    assert torch.equal(rtt, want_rtt)


@needs_gpu
def test_commit_accept_cuda_graph():
    B, N, width, S, ctx = 4, 17, 9, 2000, 256
    last = {}

    def make_inputs():
        g = torch.Generator().manual_seed(torch.seed() % 2**31)
        kv = kv_pool(S, (576,), torch.bfloat16, 3, "cpu", g)
        loc = torch.randperm(S - 1, generator=g)[: B * N] + 1
        accepted, accept_len = accepted_paths(B, N, width, g, "cpu")
        rtt = torch.randint(1, S, (B + 1, ctx), dtype=torch.int32, generator=g)
        rows, prefix = torch.randperm(B, generator=g) + 1, torch.randint(0, ctx - width, (B,), generator=g)
        ref = [t.clone() for t in kv]
        ref_rtt = rtt.clone()
        m = defrag.commit_accept(ref, ref_rtt, rows, prefix, accepted, accept_len, loc, N)
        last.update(kv=ref, rtt=ref_rtt, m=m)
        return [rtt.cuda(), rows.cuda(), prefix.cuda(), accepted.cuda(), accept_len.cuda(), loc.cuda(), *[t.cuda() for t in kv]]

    def fn(rtt, rows, prefix, accepted, accept_len, loc, *kv):
        return defrag.commit_accept(list(kv), rtt, rows, prefix, accepted, accept_len, loc, N)

    def check(inputs, out):
        assert torch.equal(inputs[0].cpu(), last["rtt"])
        assert all(same_bytes(a, b) for a, b in zip(inputs[6:], last["kv"]))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(out, last["m"]))

    graph_replay(fn, make_inputs, check)


# defrag: random allocate / finish / verify / defragment histories against a shadow model


class PoolSim:
    """Drives a pool through allocations and checks after every step that each request reads
    exactly the bytes it wrote, in order, and that slot ownership is a partition."""

    def __init__(self, kind, device, size=48, rows=5, ctx=40, layers=2, gen=None):
        self.gen, self.size, self.rows, self.ctx = gen, size, rows, ctx
        if kind == "tensor":
            self.pool = defrag.TensorPool(
                req_to_token=torch.zeros(rows + 1, ctx, dtype=torch.int32, device=device),
                kv_layers=kv_pool(size + 1, (1, 6), torch.bfloat16, layers, device, gen),
                free_slots=torch.arange(1, size + 1, device=device),
                size=size,
            )
            self.allocator = None
        else:
            mp = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
            tok = pytest.importorskip("sglang.srt.mem_cache.allocator.token")
            rtp = mp.ReqToTokenPool(size=rows, max_context_len=ctx, device=device, enable_memory_saver=False)
            kv = mp.MLATokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, kv_lora_rank=4, qk_rope_head_dim=2,
                                     layer_num=layers, device=device, enable_memory_saver=False)
            self.allocator = tok.TokenToKVPoolAllocator(size=size, dtype=torch.bfloat16, device=device, kvcache=kv,
                                                        need_sort=kind == "sglang-sort")
            self.pool = defrag.SGLangPool(rtp, self.allocator)
        self.device = device
        self.lens: dict[int, int] = {}
        self.want: dict[int, torch.Tensor] = {}  # row -> [len, layers, row bytes] uint8

    # allocator
    def free_count(self):
        return self.pool.free().numel()

    def alloc(self, n):
        if self.allocator is not None:
            return self.allocator.alloc(n)
        f = self.pool.free_slots
        self.pool.free_slots = f[n:]
        return f[:n]

    def release(self, slots):
        if self.allocator is not None:
            self.allocator.free(slots)
        else:
            self.pool.free_slots = torch.cat((self.pool.free_slots, slots))

    def layers(self):
        return self.pool.kv_groups[0]

    def fill(self, slots):
        """Write fresh random bytes into the slots; return them [n, layers, row bytes]."""
        rows = []
        for kv in self.layers():
            b = kv.view(torch.uint8) if kv.dtype != torch.uint8 else kv
            fresh = torch.randint(0, 256, (slots.numel(), *b.shape[1:]), dtype=torch.uint8, generator=self.gen)
            b[slots] = fresh.to(self.device)
            rows.append(fresh.reshape(slots.numel(), math.prod(b.shape[1:])))
        return torch.stack(rows, 1)

    def live(self):
        rows = sorted(self.lens)
        return rows, [self.lens[r] for r in rows]

    # steps
    def extend(self, row, n):
        slots = self.alloc(n)
        L = self.lens.get(row, 0)
        self.pool.req_to_token[row, L : L + n] = slots.to(torch.int32)
        fresh = self.fill(slots)
        self.want[row] = torch.cat((self.want[row], fresh)) if row in self.want else fresh
        self.lens[row] = L + n

    def finish(self, row):
        L = self.lens.pop(row)
        self.want.pop(row)
        self.release(self.pool.req_to_token[row, :L].long())

    def verify(self, rows, N, gen):
        B = len(rows)
        loc = self.alloc(B * N)
        nodes = self.fill(loc).view(B, N, *self.want[rows[0]].shape[1:])
        accepted, accept_len = accepted_paths(B, N, N + 1, gen, "cpu")
        accept_len.clamp_(min=1)
        accepted[:, 0] = 0
        prefix = torch.tensor([self.lens[r] for r in rows])
        m = defrag.commit_accept(self.layers(), self.pool.req_to_token, torch.tensor(rows, device=self.device),
                                 prefix.to(self.device), accepted.to(self.device), accept_len.to(self.device), loc, N)
        freed = m.freed.reshape(-1)
        self.release(freed[freed > 0])
        for b, r in enumerate(rows):
            k = int(accept_len[b])
            self.want[r] = torch.cat((self.want[r], nodes[b, accepted[b, :k].long()]))
            self.lens[r] += k

    def snapshot(self):
        return (self.pool.req_to_token.clone(), self.pool.free().clone(), [kv.clone() for kv in self.layers()])

    def check(self):
        rows, lens = self.live()
        defrag.check_partition(self.pool, rows, lens)
        for r in rows:
            slots = self.pool.req_to_token[r, : self.lens[r]].long()
            got = torch.stack([(kv.view(torch.uint8) if kv.dtype != torch.uint8 else kv)[slots].reshape(slots.numel(), -1).cpu() for kv in self.layers()], 1)
            assert torch.equal(got, self.want[r]), f"row {r} lost KV"


def run_history(sim: PoolSim, data, steps=20):
    gen = sim.gen
    for _ in range(steps):
        rows, lens = sim.live()
        op = data.draw(st.sampled_from(["extend", "extend", "finish", "verify", "verify", "defrag", "defrag_one"]))
        if op == "extend":
            row = data.draw(st.integers(1, sim.rows))
            n = data.draw(st.integers(1, 6))
            if sim.lens.get(row, 0) + n <= sim.ctx and n <= sim.free_count():
                sim.extend(row, n)
        elif op == "finish" and rows:
            sim.finish(data.draw(st.sampled_from(rows)))
        elif op == "verify" and rows:
            N = data.draw(st.integers(1, 5))
            batch = data.draw(st.lists(st.sampled_from(rows), min_size=1, max_size=3, unique=True))
            batch = [r for r in batch if sim.lens[r] + N <= sim.ctx]
            if batch and len(batch) * N <= sim.free_count():
                sim.verify(batch, N, gen)
        elif op in ("defrag", "defrag_one") and rows:
            kw = {"byte_budget": data.draw(st.sampled_from([None, 0, 200, 2000]))}
            if op == "defrag_one":
                kw["requests"] = [data.draw(st.sampled_from(rows))]
            else:
                kw["min_runs"] = data.draw(st.integers(1, 3))
            before = sim.snapshot()
            p = defrag.defragment(sim.pool, rows, lens, **kw)
            if not p.compacted:
                after = sim.snapshot()
                assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
                assert all(same_bytes(a, b) for a, b in zip(before[2], after[2]))
            else:
                runs = defrag.fragmentation(sim.pool.req_to_token, p.compacted, p.lens)
                assert (runs <= 1).all()
            if op == "defrag_one" and p.reason is None:
                assert p.compacted == kw["requests"]
        sim.check()


HISTORY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("device", DEVICES)
@HISTORY_SETTINGS
@given(data=st.data())
def test_defrag_history_tensor_pool(device, data):
    sim = PoolSim("tensor", device, gen=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    run_history(sim, data)


@pytest.mark.parametrize("kind", ["sglang-sort", "sglang-nosort"])
@HISTORY_SETTINGS
@given(data=st.data())
def test_defrag_history_sglang_pool(kind, data):
    sim = PoolSim(kind, "cpu", gen=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    run_history(sim, data)


def test_defrag_refuses_without_room_and_changes_nothing():
    g = torch.Generator().manual_seed(3)
    sim = PoolSim("tensor", "cpu", size=12, gen=g)
    for row in (1, 2, 1, 2, 1, 2):  # interleave two requests over the whole pool
        sim.extend(row, 2)
    rows, lens = sim.live()
    assert defrag.fragmentation(sim.pool.req_to_token, rows, lens).tolist() == [3, 3]
    before = sim.snapshot()
    p = defrag.defragment(sim.pool, rows, lens, requests=[1])
    assert not p.compacted and "no run of 6 contiguous free slots" in p.reason
    after = sim.snapshot()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    sim.finish(2)  # now request 1's own slots plus the freed ones make room
    rows, lens = sim.live()
    p = defrag.defragment(sim.pool, rows, lens, requests=[1])
    assert p.compacted == [1] and p.reason is None
    assert defrag.fragmentation(sim.pool.req_to_token, rows, lens).tolist() == [1]
    sim.check()


def test_defrag_budget_and_pinned():
    g = torch.Generator().manual_seed(4)
    sim = PoolSim("tensor", "cpu", size=64, gen=g)
    for row in (1, 2, 3, 1, 2, 3):
        sim.extend(row, 3)
    rows, lens = sim.live()
    per_slot = 2 * 6 * 2  # 2 layers of [1, 6] bf16
    p = defrag.plan(sim.pool, rows, lens, byte_budget=8 * per_slot)  # each needs all 6 moved
    assert len(p.compacted) == 1 and p.bytes == 6 * per_slot
    assert all("over budget" in why for why in p.skipped.values())
    pinned = sim.pool.req_to_token[2, :1].long()
    p = defrag.plan(sim.pool, rows, lens, byte_budget=None, pinned=pinned)
    assert 2 not in p.compacted and "pinned" in p.skipped[2]
    defrag.apply(sim.pool, p)
    sim.check()
    with pytest.raises(ValueError, match="stale"):
        defrag.apply(sim.pool, p)  # already applied: the slots it expects have moved


# ---- sglang hook ----
# The hook against the real SGLang 0.5.23 classes on CPU (kdtree_ops' CPU reference ops stand
# in for the CUDA kernels), and on a GPU against SGLang's own Triton kernel.

import logging as _logging
import types as _types

import sglang_hook


@pytest.fixture(scope="module")
def sgl():
    """A real TritonAttnBackend over a real MLATokenToKVPool (512 + 64, so layers are MLA)."""
    pytest.importorskip("sglang")
    transformers = pytest.importorskip("transformers")
    tb = pytest.importorskip("sglang.srt.layers.attention.triton_backend")
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    H, layers = 4, 3
    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu", attention_backend="triton"), role="test",
            ranks=SpawnRanks(world_rank=0, dp_rank=None))
    rtp = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    kv = MLATokenToKVPool(size=512, page_size=1, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                          layer_num=layers, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=512, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    mc = _types.SimpleNamespace(
        attention_arch=AttentionArch.MLA, hf_config=transformers.PretrainedConfig(model_type="llama"),
        linear_attn_registry_result=None, get_max_num_attention_heads=lambda: H,
        get_num_kv_heads=lambda tp, dcp=1: 1, v_head_dim=512, swa_v_head_dim=None, context_len=128,
        head_dim=576, is_encoder_decoder=False, is_draft_model=False)
    mr = _types.SimpleNamespace(
        req_to_token_pool=rtp, token_to_kv_pool=kv, token_to_kv_pool_allocator=alloc, sliding_window_size=None,
        page_size=1, kv_index_translator=None, decode_num_tokens_per_req=lambda: 1, model_config=mc,
        is_draft_worker=False, device="cpu", gpu_id=0, spec_algorithm=None, kv_cache_dtype=torch.bfloat16)
    backend = tb.TritonAttnBackend(mr)
    mk_layer = lambda lid, **kw: RadixAttention(H, kw.pop("head_dim", 576), 576**-0.5, 1, lid, v_head_dim=kw.pop("v_head_dim", 512), **kw)
    yield _types.SimpleNamespace(tb=tb, backend=backend, kv=kv, alloc=alloc, H=H, layers=layers, mk_layer=mk_layer,
                                 ForwardMode=ForwardMode)
    sglang_hook.uninstall()
    reset_context()


@pytest.fixture
def hook(sgl, monkeypatch):
    """Install with a spy standing in for SGLang's forward_extend (its Triton kernels cannot run on
    CPU); uninstall before monkeypatch puts the real method back."""
    calls = []

    def spy(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None, aux_tensors=None):
        calls.append(forward_batch.forward_mode)
        return spy.result(q, layer)

    spy.result = lambda q, layer: torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), 7.0, dtype=q.dtype)
    for name in ("KDTREE_PROFILE", "KDTREE_DEFRAG", "KDTREE_LOG_EVERY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sgl.tb.TritonAttnBackend, "forward_extend", spy)
    sglang_hook.uninstall()
    yield _types.SimpleNamespace(calls=calls, spy=spy)
    sglang_hook.uninstall()


def _tree_parents(n, g):
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def _ancestors(parents):
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


def hook_batch(sgl, prefix_lens, N, mask="tree", seed=0):
    """One TARGET_VERIFY step as SGLang lays it out: prefix KV in scattered pool slots, fresh
    slots for the N nodes of each request, ForwardMetadata like init_forward_metadata builds."""
    g = torch.Generator().manual_seed(seed)
    B, H = len(prefix_lens), sgl.H
    sgl.alloc.clear()
    slots = sgl.alloc.alloc(sum(prefix_lens) + B * N)
    slots = slots[torch.randperm(slots.numel(), generator=g)]  # scattered, as after many steps
    prefix_slots, node_slots = slots[: sum(prefix_lens)], slots[sum(prefix_lens):]
    for buf in sgl.kv.kv_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    T = B * N
    visible = [_ancestors(_tree_parents(N, g)) if mask != "chain" else torch.ones(N, N, dtype=torch.bool).tril()
               for _ in prefix_lens]
    custom_mask = None
    if mask != "chain":
        blocks = [torch.cat([torch.ones(N, p, dtype=torch.bool), vis], 1).flatten() for p, vis in zip(prefix_lens, visible)]
        custom_mask = torch.cat(blocks).to(torch.uint8 if mask == "uint8" else torch.bool)
    seq = torch.tensor(prefix_lens)
    fields = {f: None for f in sgl.tb.ForwardMetadata.__dataclass_fields__}
    fields.update(
        max_extend_len=N, qo_indptr=torch.arange(0, (B + 1) * N, N, dtype=torch.int32),
        kv_indptr=torch.cat([torch.zeros(1), seq.cumsum(0)]).to(torch.int32), kv_indices=prefix_slots.to(torch.int64),
        custom_mask=custom_mask,
        mask_indptr=torch.cat([torch.zeros(1), (N * (seq + N)).cumsum(0)]).to(torch.int64))
    md = sgl.tb.ForwardMetadata(**fields)
    sgl.backend.forward_metadata = md
    fb = _types.SimpleNamespace(forward_mode=sgl.ForwardMode.TARGET_VERIFY, out_cache_loc=node_slots,
                                out_cache_loc_is_physical=False, seq_lens_cpu=seq, _attn_output=None)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    k = torch.randn(T, 1, 576, generator=g).to(torch.bfloat16)
    return _types.SimpleNamespace(fb=fb, md=md, q=q, k=k, v=k[..., :512], visible=visible, prefix_slots=prefix_slots,
                                  node_slots=node_slots, prefix_lens=prefix_lens, N=N, T=T)


def hook_reference(sgl, b, layer_id):
    """Float64 softmax over (all prefix keys) + (ancestor nodes), by hand."""
    pool = sgl.kv.kv_buffer[layer_id][:, 0].double()
    outs, start = [], 0
    for r, p in enumerate(b.prefix_lens):
        rows = slice(r * b.N, (r + 1) * b.N)
        keys = torch.cat([pool[b.prefix_slots[start:start + p]], b.k[rows, 0].double()])
        start += p
        s = torch.einsum("nhd,kd->nhk", b.q[rows].double(), keys) * 576**-0.5
        s[:, :, p:] = s[:, :, p:].masked_fill(~b.visible[r][:, None, :], -math.inf)
        outs.append(torch.softmax(s, -1) @ keys[:, :512])
    return torch.cat(outs).reshape(b.T, -1)


def call_hooked(sgl, b, layer, **kw):
    return sgl.tb.TritonAttnBackend.forward_extend(sgl.backend, b.q.view(b.T, -1), b.k, b.v, layer, b.fb, **kw)


def test_hook_install_uninstall(sgl, hook):
    cls = sgl.tb.TritonAttnBackend
    originals = {n: cls.__dict__[n] for n in ("forward_extend", "init_forward_metadata", "init_forward_metadata_out_graph")}
    assert sglang_hook.install("on") and sglang_hook.installed() == "on"
    wrapped = cls.__dict__["forward_extend"]
    assert wrapped is not originals["forward_extend"] and wrapped.__wrapped__ is hook.spy
    assert sglang_hook.install("validate") and cls.__dict__["forward_extend"] is wrapped  # twice: harmless
    assert sglang_hook.installed() == "validate"
    sglang_hook.uninstall()
    sglang_hook.uninstall()
    assert sglang_hook.installed() is None
    assert all(cls.__dict__[n] is f for n, f in originals.items())


def test_hook_off_patches_nothing(sgl, hook, monkeypatch):
    cls = sgl.tb.TritonAttnBackend
    for value in ("off", "", "bogus"):
        monkeypatch.setenv("KDTREE_VERIFY", value)
        sglang_hook.maybe_install_from_env()
        assert sglang_hook.installed() is None and cls.__dict__["forward_extend"] is hook.spy
    assert sglang_hook.install("off") is False and cls.__dict__["forward_extend"] is hook.spy
    monkeypatch.setenv("KDTREE_VERIFY", "on")
    sglang_hook.maybe_install_from_env()
    assert sglang_hook.installed() == "on"


def test_hook_routes_only_verify(sgl, hook):
    sglang_hook.install("on")
    b = hook_batch(sgl, [5, 9], 4)
    layer = sgl.mk_layer(0)
    for mode in (sgl.ForwardMode.EXTEND, sgl.ForwardMode.DECODE, sgl.ForwardMode.DRAFT_EXTEND_V2):
        b.fb.forward_mode = mode
        assert torch.all(call_hooked(sgl, b, layer) == 7)  # SGLang's method, untouched
    assert hook.calls == [sgl.ForwardMode.EXTEND, sgl.ForwardMode.DECODE, sgl.ForwardMode.DRAFT_EXTEND_V2]
    b.fb.forward_mode = sgl.ForwardMode.TARGET_VERIFY
    out = call_hooked(sgl, b, layer)
    assert len(hook.calls) == 3 and not torch.all(out == 7)


@pytest.mark.parametrize("mask", ["tree", "uint8", "chain"])
def test_hook_verify_matches_reference(sgl, hook, mask):
    """Hooked TARGET_VERIFY forward_extend on the real backend and pool = a by-hand float64
    softmax, with the nodes' KV saved into their slots as SGLang saves it."""
    sglang_hook.install("on")
    b = hook_batch(sgl, [0, 13, 37], 6, mask=mask, seed=3)
    for lid in range(sgl.layers):
        out = call_hooked(sgl, b, sgl.mk_layer(lid))
        assert out.shape == (b.T, sgl.H * 512) and out.dtype == torch.bfloat16
        assert rel_err(out, hook_reference(sgl, b, lid)) < 1e-2
        assert torch.equal(sgl.kv.kv_buffer[lid][b.node_slots, 0], b.k[:, 0])
    assert hook.calls == []


def test_hook_converts_mask_once_per_step(sgl, hook, monkeypatch):
    sglang_hook.install("on")
    n = []
    real = kdtree_ops.sglang_mask_to_packed
    monkeypatch.setattr(kdtree_ops, "sglang_mask_to_packed", lambda *a, **kw: n.append(1) or real(*a, **kw))
    b = hook_batch(sgl, [4, 8], 5)
    for lid in range(sgl.layers):
        call_hooked(sgl, b, sgl.mk_layer(lid))
    assert len(n) == 1
    b = hook_batch(sgl, [4, 8], 5, seed=1)  # next step: new metadata
    call_hooked(sgl, b, sgl.mk_layer(0))
    assert len(n) == 2


FALLBACKS = {
    "page size": lambda sgl, layer, kw: setattr(sgl.backend, "page_size", 16),
    "scaled (fp8) KV": lambda sgl, layer, kw: setattr(layer, "k_scale", torch.tensor(1.0)),
    "sliding-window": lambda sgl, layer, kw: setattr(layer, "sliding_window_size", 128),
    "logit cap": lambda sgl, layer, kw: setattr(layer, "logit_cap", 30.0),
    "sinks is set": lambda sgl, layer, kw: kw.update(sinks=torch.zeros(4)),
    "score_mod is set": lambda sgl, layer, kw: kw.update(score_mod=lambda s: s),
    "non-causal": lambda sgl, layer, kw: setattr(layer, "is_cross_attention", True),
    "deterministic": lambda sgl, layer, kw: setattr(sgl.backend, "enable_deterministic", True),
    "not MLA": lambda sgl, layer, kw: setattr(layer, "v_head_dim", 128),
}


@pytest.mark.parametrize("reason", list(FALLBACKS))
def test_hook_fallbacks(sgl, hook, caplog, reason):
    sglang_hook.install("on")
    layer = sgl.mk_layer(0)
    kw = {}
    saved = {a: getattr(sgl.backend, a) for a in ("page_size", "enable_deterministic")}
    FALLBACKS[reason](sgl, layer, kw)
    try:
        b = hook_batch(sgl, [3, 7], 4)
        with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
            for _ in range(2):
                assert torch.all(call_hooked(sgl, b, layer, **kw) == 7)
    finally:
        for a, val in saved.items():
            setattr(sgl.backend, a, val)
    assert len(hook.calls) == 2
    said = [r.getMessage() for r in caplog.records if r.name == "kdtree_ops"]
    assert len(said) == 1 and (reason.split()[0] in said[0] or reason in said[0]), said


def test_hook_fallback_on_kv_dtype(sgl, hook, caplog):
    """KV stored in another dtype than q (e.g. an fp8 pool) is SGLang's."""
    sglang_hook.install("on")
    b = hook_batch(sgl, [3], 4)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        out = sgl.tb.TritonAttnBackend.forward_extend(sgl.backend, b.q.half().view(b.T, -1), b.k.half(), b.v.half(),
                                                      sgl.mk_layer(0), b.fb)
    assert torch.all(out == 7) and "KV pool stores" in caplog.text


def test_hook_error_isolation(sgl, hook, caplog, monkeypatch):
    """An exception inside our path: SGLang's path serves the call, one warning for it."""
    sglang_hook.install("on")

    def boom(*a, **kw):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(kdtree_ops, "verify_attn", boom)
    b = hook_batch(sgl, [3, 7], 4)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        for _ in range(3):
            assert torch.all(call_hooked(sgl, b, sgl.mk_layer(0)) == 7)
    assert len(hook.calls) == 3
    said = [r.getMessage() for r in caplog.records if r.name == "kdtree_ops"]
    assert len(said) == 1 and "kernel exploded" in said[0]


def test_hook_validate_returns_sglang_and_reports_error(sgl, hook, caplog, monkeypatch):
    monkeypatch.setenv("KDTREE_LOG_EVERY", "1")
    monkeypatch.setenv("KDTREE_PROFILE", "1")
    sglang_hook.install("validate")
    b = hook_batch(sgl, [11, 2], 5)
    # SGLang's result: the true attention (what its Triton kernel computes), bf16-rounded
    hook.spy.result = lambda q, layer: hook_reference(sgl, b, layer.layer_id).to(q.dtype)
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        for lid in range(2):
            ref = hook_reference(sgl, b, lid).to(torch.bfloat16)
            assert torch.equal(call_hooked(sgl, b, sgl.mk_layer(lid)), ref)
        sglang_hook._log_summary()
        assert "2 layers compared" in caplog.text and "past tolerance" not in caplog.text
        assert "attn.kdtree" in caplog.text and "attn.sglang" in caplog.text and "mask" in caplog.text
        hook.spy.result = lambda q, layer: (hook_reference(sgl, b, layer.layer_id) * 1.5).to(q.dtype)
        call_hooked(sgl, b, sgl.mk_layer(1))
        sglang_hook._log_summary()
    assert "layer 1 on cpu" in caplog.text and "past tolerance" in caplog.text
    assert len(hook.calls) == 3


def test_hook_step_bookkeeping(sgl, hook, caplog, monkeypatch):
    """init_forward_metadata(_out_graph) count verify steps (not captures) and log a summary
    every KDTREE_LOG_EVERY steps."""
    monkeypatch.setenv("KDTREE_LOG_EVERY", "2")
    cls = sgl.tb.TritonAttnBackend
    seen = []
    monkeypatch.setattr(cls, "init_forward_metadata", lambda self, fb: seen.append("eager"))
    monkeypatch.setattr(cls, "init_forward_metadata_out_graph", lambda self, fb, in_capture=False: seen.append(in_capture))
    sglang_hook.install("on")
    fb = _types.SimpleNamespace(forward_mode=sgl.ForwardMode.TARGET_VERIFY)
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        sgl.backend.init_forward_metadata(fb)
        sgl.backend.init_forward_metadata_out_graph(fb, in_capture=True)  # capture: not a step
        sgl.backend.init_forward_metadata_out_graph(fb)  # a replay
    assert seen == ["eager", True, False]
    assert sglang_hook._STATE.steps == 2 and "verify steps 1-2" in caplog.text
    sglang_hook.uninstall()
    assert cls.__dict__["init_forward_metadata"].__name__ == "<lambda>"


def test_hook_patches_on_later_import(tmp_path, monkeypatch):
    """Installed from sitecustomize before SGLang is imported: patched right after import."""
    (tmp_path / "kdtree_late_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = []
    sglang_hook._when_imported("kdtree_late_mod", lambda m: got.append(m.X))
    assert got == []
    import kdtree_late_mod  # noqa: F401

    assert got == [1]
    monkeypatch.delitem(__import__("sys").modules, "kdtree_late_mod")


def test_hook_ddtree_and_defrag_status(sgl, hook, caplog, monkeypatch):
    assert "not present" in sglang_hook.ddtree_status()  # sglang 0.5.23 has no DDTree
    monkeypatch.setenv("KDTREE_DEFRAG", "1")
    sglang_hook.install("on")
    b = hook_batch(sgl, [3], 4)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        sglang_hook._maybe_defrag(sgl.backend, b.fb)  # the test's server args keep the radix cache
    assert "defrag off" in caplog.text and "radix" in caplog.text


def _sglang_triton_kernel():
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except ImportError:
        return None
    return extend_attention_fwd


@needs_gpu
@pytest.mark.parametrize("mask", ["tree", "chain"])
@pytest.mark.parametrize("graph", [False, True])
def test_hook_gpu_vs_sglang_triton(mask, graph):
    """The hook's core (same mask conversion, same metadata layout) vs SGLang's own Triton
    extend kernel on TARGET_VERIFY batches, several layers, eager and graph-captured; prints
    the speedup. Needs SGLang's kernels importable (../shared/tools/sglang_kernels.sh)."""
    extend_attention_fwd = _sglang_triton_kernel()
    if extend_attention_fwd is None:
        pytest.skip("SGLang's Triton kernels not importable")
    dev, H, N, layers = "cuda", 16, 9 if mask == "chain" else 17, 4
    prefix_lens = [4000, 700, 12000]
    B, T = len(prefix_lens), len(prefix_lens) * N
    g = torch.Generator().manual_seed(5)
    S = sum(prefix_lens) + 1000
    pools = [torch.randn(S, 1, 576, generator=g).to(dev, torch.bfloat16) for _ in range(layers)]
    kv_indices = (torch.randperm(S - 1, generator=g)[: sum(prefix_lens)] + 1).to(dev)
    seq = torch.tensor(prefix_lens)
    kv_indptr = torch.cat([torch.zeros(1), seq.cumsum(0)]).to(dev, torch.int32)
    qo_indptr = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=dev)
    mask_indptr = torch.cat([torch.zeros(1), (N * (seq + N)).cumsum(0)]).to(dev, torch.int64)
    custom_mask = None
    if mask == "tree":
        blocks = [torch.cat([torch.ones(N, p, dtype=torch.bool), _ancestors(_tree_parents(N, g))], 1).flatten()
                  for p in prefix_lens]
        custom_mask = torch.cat(blocks).to(dev, torch.uint8)  # the CUDA-graph buffer's dtype
    q = [torch.randn(T, H, 576, generator=g).to(dev, torch.bfloat16) for _ in range(layers)]
    k = [torch.randn(T, 1, 576, generator=g).to(dev, torch.bfloat16) for _ in range(layers)]
    scale = 576**-0.5
    o_ref = [torch.full((T, H * 512), math.nan, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    o_ours = [torch.full((T, H * 512), math.nan, device=dev, dtype=torch.bfloat16) for _ in range(layers)]

    def sglang_step():
        for i in range(layers):
            extend_attention_fwd(q[i], k[i].contiguous(), k[i][..., :512].contiguous(), o_ref[i].view(T, H, 512),
                                 pools[i], pools[i][..., :512], qo_indptr, kv_indptr, kv_indices, custom_mask, True,
                                 mask_indptr, N, 1.0, 1.0, scale)

    def our_step():
        packed = sglang_hook.packed_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, T, N)
        for i in range(layers):
            sglang_hook.verify_attention(q[i].view(T, -1), pools[i], kv_indptr, kv_indices, qo_indptr, k[i], packed,
                                         scale, o_ours[i])

    def timed(fn):
        if graph:
            fn()  # warm-up: Triton JIT, kernel caches
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                fn()
            run = gr.replay
        else:
            run = fn
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 10

    t_ref, t_ours = timed(sglang_step), timed(our_step)
    for i in range(layers):
        assert rel_err(o_ours[i], o_ref[i]) < 2e-2, f"layer {i}"
    print(f"\nhook vs SGLang Triton ({mask}, {'graph' if graph else 'eager'}, {layers} layers, B={B}, H={H}, N={N}, "
          f"prefixes {prefix_lens}): {t_ref:.3f} ms vs {t_ours:.3f} ms, speedup {t_ref / t_ours:.1f}x")


# ---- main job ----


def test_main_runs_a_checked_round_on_cpu(capsys):
    """`python -m kdtree_ops` at tiny sizes: the self-check and every stage of the DDTree round
    run, are checked and show up in the stage table."""
    sizes = {"batch": 3, "context": 40, "budget": 12, "heads": 2, "layers": 2, "depth": 5, "vocab": 300}
    argv = ["--device", "cpu"] + [a for k, v in sizes.items() for a in (f"--{k}", str(v))]
    assert kdtree_ops.main(argv) == 0
    table = capsys.readouterr().out.split("SGLang path ms")[1]
    for stage in ("draft_topk", "build_tree", "verify_metadata", "kv_write", "verify_attn", "accept_walk",
                  "commit_accept", "defragment"):
        assert any(line.startswith(stage) and " ok: " in line for line in table.splitlines()), stage
    assert "FAIL" not in table and "all checks passed" in table
