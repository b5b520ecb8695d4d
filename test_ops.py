"""Tests for kdtree_ops. CPU tests always run; GPU tests need a CUDA GPU and the built kernels.

Every op is checked the same way: CUDA against the CPU reference on fresh random data at odd
sizes, ``torch.library.opcheck``, CUDA-graph capture + replay with changed inputs, and
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import itertools
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
    ([4096], [9], 1),
    ([2049], [65], 128),
    ([300], [1025], 2),  # largest tree
    ([17] * 256, [3] * 256, 4),  # batch 256
    ([8191, 77], [257, 31], 16),
]


@needs_gpu
@pytest.mark.parametrize("prefix_lens,node_counts,heads", VERIFY_GRID)
def test_verify_attn_cuda_matches_float64(prefix_lens, node_counts, heads):
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
def test_verify_attn_cuda_dtypes_layouts(dtype, index_dtype, causal):
    case = make_verify_case([513, 64], [16, 7], 8, dtype=dtype, index_dtype=index_dtype,
                            causal=causal, kv_3d=index_dtype == torch.int64)
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    assert_verify_close(out, lse, case)


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
def test_verify_attn_cuda_graph():
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
        ("kv_indptr", case["kv_indptr"].long(), "kv_indptr must be"),
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


# ---- kv movement ----
