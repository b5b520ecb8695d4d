"""Shared builders and checks for kdtree_ops' tests, benchmarks and main job.

- error metrics judged per row (:func:`rows_close`) and over a tensor (:func:`rel_err`);
- timing by CUDA-graph replay, CUDA events or the host clock;
- random verify batches (:func:`make_verify_case`) with NaN in every pool slot a case does not
  use and garbage in the mask bits past each request's nodes, so a wrong gather or a stray bit
  shows;
- SGLang 0.5.23's own verify step built from its real classes (:class:`Runner`,
  :func:`verify_step`, EAGLE trees and DFlash chains), and a DDTree round through the DDTree
  PR's functions (:func:`ddtree_round`). SGLang is imported on first use of these only.

On CPU, SGLang's Triton kernels run under ``TRITON_INTERPRET=1`` (set before triton is
imported; the interpreter handles float16 and float32, not bfloat16).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
import types
from typing import Optional, Sequence

import pytest
import torch

import kdtree_ops
import sglang_hook

MLA_QK, MLA_V = kdtree_ops.MLA_QK_DIM, kdtree_ops.MLA_V_DIM
ROW_TOL = {"cpu": 1e-2, "cuda": 3e-2}  # rows_close bounds: bf16 on CUDA, float16 (interpreted SGLang) on CPU


# ---- error metrics ----


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of x against ref in float64 over ref's finite entries. Where
    ref is not finite x must match it (the same infinities, NaN where ref is NaN); otherwise,
    or when x is not finite where ref is, the error is inf, so NaN never passes a ``< tol``."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    fin = torch.isfinite(ref)
    inf = torch.isinf(ref)
    if not torch.equal(torch.isfinite(x), fin) or not torch.equal(x[inf], ref[inf]):
        return math.inf
    if not fin.any():
        return 0.0
    return ((x[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-300)).item()


def rows_close(out: torch.Tensor, ref: torch.Tensor, heads: int, tol: float) -> float:
    """Worst (node, head) row's max |out - ref| over that row's max |ref|: a single wrong row
    cannot hide in a batch-wide norm."""
    o = out.double().cpu().reshape(-1, heads, out.shape[-1] // heads)
    r = ref.double().cpu().reshape_as(o)
    if not torch.isfinite(o).all():
        return math.inf
    worst = ((o - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-6)).max().item()
    assert worst < tol, f"worst row error {worst:.3g} >= {tol}"
    return worst


# ---- timing ----


def median_ms(fn, *, cuda: bool, reps: int = 5, setup=None):
    """(fn's last result, median ms of ``reps`` calls): one untimed warm-up first when reps > 1,
    ``setup()`` untimed before every call; CUDA events on a drained stream, or the host clock."""
    times, out = [], None
    for _ in range(reps + (reps > 1)):
        if setup is not None:
            setup()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return out, statistics.median(times[1:] if reps > 1 else times)


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
    return median_ms(fn, cuda=True, reps=reps)[1]


def cpu_time_ms(fn, reps: int = 5) -> float:
    """Median wall-clock milliseconds of fn() on the host."""
    return median_ms(fn, cuda=False, reps=reps)[1]


# ---- verify batches ----


def random_tree_mask(nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[nodes, nodes] bool ancestor-or-self mask of a random tree (parents before children)."""
    return kdtree_ops.ancestor_mask([-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, nodes)])


PAGE = 64  # slots per page of the paged layouts (FlashMLA's page size)


def prefix_slots(prefix_lens, layout: str, pool, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """(every request's prefix slots, concatenated; the pool's row count) for one layout:

    - ``scattered``: each slot drawn at random from a pool about twice the working set (an
      allocator under heavy turnover, page size 1);
    - ``pages``: each request in whole 64-slot pages, the pages in random order (a paged pool);
    - ``pages_one_swap``: pages, with two neighbouring slots of each request's first page
      swapped (a tile whose edge slots are 63 apart that is no run);
    - ``full_pool``: pages in a pool with no other rows, the first request's first page its last;
    - ``runs``: runs of 1-160 consecutive slots at random places (a fragmented allocator),
      so tiles straddle runs.
    """
    total = sum(prefix_lens)
    if layout == "scattered":
        S = pool or max(2 * total + 16, 64)
        return torch.randperm(S, generator=g)[:total], S
    if layout == "runs":
        S = pool or max(4 * total + 16, 64)
        free = torch.ones(S, dtype=torch.bool)
        out, have = [], 0
        while have < total:
            n = min(int(torch.randint(1, 161, (1,), generator=g)), total - have)
            start = int(torch.randint(0, S - n + 1, (1,), generator=g))
            if free[start : start + n].all():
                free[start : start + n] = False
                out.append(torch.arange(start, start + n))
                have += n
        return torch.cat(out), S
    pages = [-(-n // PAGE) for n in prefix_lens]
    S = pool or PAGE * (sum(pages) if layout == "full_pool" else 2 * sum(pages) + 1)
    order = torch.randperm(S // PAGE, generator=g)[: sum(pages)]
    if layout == "full_pool":  # the first request's first tile ends at the pool's last row
        order[order == S // PAGE - 1] = order[0].clone()
        order[0] = S // PAGE - 1
    out, used = [], 0
    for n, k in zip(prefix_lens, pages):
        slots = (order[used : used + k, None] * PAGE + torch.arange(PAGE)).flatten()[:n]
        if layout == "pages_one_swap" and n >= 12:
            slots[[10, 11]] = slots[[11, 10]]
        out.append(slots)
        used += k
    return (torch.cat(out) if out else torch.zeros(0, dtype=torch.long)), S


def make_verify_case(prefix_lens, node_counts, heads, *, dtype=torch.bfloat16, device="cuda",
                     pool=None, causal=False, index_dtype=torch.int32, kv_3d=False, seed=None, slots="scattered"):
    """Random verify batch: prefix slots laid out as ``slots`` names (prefix_slots) in a pool
    whose other slots hold NaN, random trees, packed masks with garbage in the bits past each
    request's nodes."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    total = sum(prefix_lens)
    T, nmax = sum(node_counts), max(node_counts)
    slots, S = prefix_slots(prefix_lens, slots, pool, g)
    slots = slots.to(device)
    kv_cache = torch.full((S, 576), math.nan, dtype=dtype, device=device)
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
        "tree_mask": None if causal else garbage_past_nodes(kdtree_ops.pack_bits(visible, -(-nmax // 32)), node_counts, g).to(device),
        "sm_scale": 1.0 / math.sqrt(192),
        "visible": visible,
    }


def garbage_past_nodes(words: torch.Tensor, node_counts, g: torch.Generator) -> torch.Tensor:
    """Packed mask rows [T, W] with random bits set past each request's node count: a kernel
    must read only bits j < nodes."""
    W = words.shape[1]
    j = torch.arange(32 * W)
    out, row = words.clone(), 0
    for n in node_counts:
        noise = torch.rand(n, 32 * W, generator=g) < 0.5
        out[row : row + n] |= kdtree_ops.pack_bits(noise & (j >= n), W)
        row += n
    return out


VERIFY_ARGS = ["q", "kv_cache", "kv_indptr", "kv_indices", "qo_indptr", "tree_k", "tree_mask", "sm_scale"]


def verify_args(case):
    return [case[k] for k in VERIFY_ARGS]


def verify_reference(case):
    """float64 reference on the inputs' own device (fast on a GPU)."""
    args = verify_args(case)
    for i in (0, 1, 5):
        args[i] = args[i].double()
    return kdtree_ops.verify_attn_reference(*args)


def assert_verify_close(out, lse, case, tol=1e-2):
    ref_out, ref_lse = verify_reference(case)
    assert out.dtype == case["q"].dtype and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf)
    assert torch.allclose(lse[~inf].double(), ref_lse[~inf], atol=2e-3, rtol=1e-4)


def e4m3_bytes(rows: torch.Tensor, k_scale: float) -> torch.Tensor:
    """``rows`` as SGLang's fp8 pool stores them (k / k_scale rounded to e4m3, as uint8 bytes),
    saturating at e4m3's +-448; NaN rows stay NaN."""
    return (rows.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


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


# ---- DDTree rounds through the PR's functions ----

def skip_unless_triton_runs_on(device):
    """SGLang's Triton kernels take CPU tensors only in the interpreter (chosen before triton
    loads where there is no GPU); a GPU machine runs those cases on CUDA instead."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("SGLang's Triton kernels run on CPU tensors only in the interpreter (TRITON_INTERPRET=1)")


DDTREE_KINDS = ("random", "peaked", "flat", "ties", "zeros")


def ddtree_logits(bs, L, V, kind, g):
    """Drafter logits [bs, L, V]: `ties` and `zeros` make many exactly equal scores (the heap's
    rank-tuple tie-break), `peaked` deep narrow trees, `flat` shallow bushy ones."""
    if kind == "random":
        return torch.randn(bs, L, V, generator=g) * 3
    if kind == "peaked":
        x = torch.randn(bs, L, V, generator=g) * 2
        return x.scatter_add_(2, torch.randint(0, V, (bs, L, 1), generator=g), 12 + 4 * torch.rand(bs, L, 1, generator=g))
    if kind == "flat":
        return torch.randn(bs, L, V, generator=g) * 0.3
    if kind == "ties":
        return torch.randint(0, 3, (bs, L, V), generator=g).float()
    return torch.zeros(bs, L, V)


def ddtree_targets(parents, node_tokens, V, g, follow=0.8):
    """The target's greedy token per node [bs, D]: along a random root-to-leaf walk it matches
    a child's token (each step with probability `follow`), elsewhere it is random."""
    parents, node_tokens = parents.cpu(), node_tokens.cpu()
    bs, D = parents.shape
    target = torch.randint(0, V, (bs, D), generator=g)
    for b in range(bs):
        kids = [[] for _ in range(D)]
        for i, p in enumerate(parents[b].tolist()[1:], 1):
            if p >= 0:
                kids[p].append(i)
        cur = 0
        while kids[cur] and float(torch.rand(1, generator=g)) < follow:
            child = kids[cur][int(torch.randint(0, len(kids[cur]), (1,), generator=g))]
            target[b, cur] = node_tokens[b, child - 1]
            cur = child
    return target


def tree_buffers(bs_max, budget, device):
    """The worker's persistent build outputs (DDTreeWorker.__init__)."""
    D = budget + 1
    return dict(
        _out_node_token_ids=torch.zeros(bs_max, budget, dtype=torch.long, device=device),
        _out_node_depths=torch.zeros(bs_max, budget, dtype=torch.long, device=device),
        _out_parents=torch.full((bs_max, D), -1, dtype=torch.long, device=device),
        _out_visibility=torch.zeros(bs_max, D, D, dtype=torch.bool, device=device))


def ddtree_batch(device, prefix_lens, D, V):
    """A real 0.5.23 decode batch: pools, allocator (prefix slots taken, scattered), Reqs,
    SamplingBatchInfo (greedy), a disabled RadixCache and a ScheduleBatch."""
    skip_unless_triton_runs_on(device)
    import array

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    bs, total = len(prefix_lens), sum(prefix_lens)
    size = total + bs * D + 16
    rtp = ReqToTokenPool(size=bs + 1, max_context_len=max(prefix_lens) + D + 8, device=device, enable_memory_saver=False)
    kv = MLATokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
                          layer_num=1, device=device, enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=size, dtype=torch.bfloat16, device=device, kvcache=kv, need_sort=False)
    alloc.free_pages = alloc.free_pages[torch.randperm(size, generator=torch.Generator().manual_seed(size)).to(device)]
    pre = alloc.alloc(total)
    reqs, at = [], 0
    for b, P in enumerate(prefix_lens):
        rtp.req_to_token[b, :P] = pre[at : at + P].to(rtp.req_to_token.dtype)
        at += P
        req = Req(f"r{b}", "", array.array("i", [1, 2, 3]), SamplingParams(temperature=0))
        # The PR reads these from the Req (its SGLang base kept them there); 0.5.23 has them in req.kv.
        req.kv_committed_len = req.kv_allocated_len = P
        reqs.append(req)
    sampling = SamplingBatchInfo(
        temperatures=torch.ones(bs, 1, device=device), top_ps=torch.ones(bs, device=device),
        top_ks=torch.ones(bs, dtype=torch.int32, device=device), min_ps=torch.zeros(bs, device=device),
        is_all_greedy=True, is_any_greedy=True, need_top_p_sampling=False, need_top_k_sampling=False,
        need_min_p_sampling=False, vocab_size=V)
    cache = RadixCache(CacheInitParams(disable=True, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1))
    seq = torch.tensor(prefix_lens, dtype=torch.int64)
    return ScheduleBatch(reqs=reqs, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, tree_cache=cache,
                         forward_mode=ForwardMode.DECODE, device=device, seq_lens=seq.to(device), seq_lens_cpu=seq.clone(),
                         seq_lens_sum=int(seq.sum()), req_pool_indices=torch.arange(bs, device=device), sampling_info=sampling)


def ddtree_round(pr, calls, batch, logits, verified, budget, target_logits, hidden, bs_max=None, mark=None):
    """One full-tree DDTree round as DDTreeWorker._prepare_for_speculative_decoding and
    forward_batch_generation run it (minus the forwards): tree, verify ids/positions, EAGLE
    format, flat mask, the worker's tree_is_spine line, DDTreeVerifyInput, prepare_for_verify,
    then verify with the KV commit when ``target_logits`` ([bs * D, V]) is given.

    ``mark(i)``, when given, is called at i = 0 (start), 1 (verify input ready), 2 (before
    verify, after prepare_for_verify) and 3 (after verify): the benchmark's stopwatch."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mark = mark or (lambda i: None)
    dev, bs, D = batch.device, logits.shape[0], budget + 1
    bufs = tree_buffers(bs_max or bs + 2, budget, dev)
    worker = object.__new__(pr.worker.DDTreeWorker)  # the mask method reads only max_tree_nodes
    worker.max_tree_nodes = D
    mark(0)
    tree = calls.build(draft_logits=logits, tree_budget=budget, device=dev, **bufs)
    node_token_ids, node_depths, parents, child_maps, visibility, sizes = tree
    ids = torch.zeros(bs, D, dtype=torch.long, device=dev)
    ids[:, 0] = verified
    ids[:, 1:] = node_token_ids
    pos = torch.zeros(bs, D, dtype=torch.long, device=dev)
    pos[:, 0] = batch.seq_lens
    pos[:, 1:] = batch.seq_lens.unsqueeze(1) + node_depths
    retrieve = calls.eagle_format(parents=parents, actual_tree_sizes=sizes, draft_token_num=D, device=dev)
    mask = calls.flat_mask(worker, batch=batch, visibility=visibility, actual_tree_sizes=sizes)
    spine = all(all(len(c) <= 1 for c in cm.values()) for cm in child_maps)
    mark(1)
    vi = pr.info.DDTreeVerifyInput(
        draft_token=ids.reshape(-1), positions=pos.reshape(-1), draft_token_num=D, tree_budget=budget,
        child_maps=child_maps, actual_tree_sizes=sizes, custom_mask=mask, tree_is_spine=spine, topk=2,
        spec_steps=budget, retrive_index=retrieve[0], retrive_next_token=retrieve[1], retrive_next_sibling=retrieve[2])
    vi.prepare_for_verify(batch, 1)
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    out = None
    if target_logits is not None:
        lo = LogitsProcessorOutput(next_token_logits=target_logits.to(dev), hidden_states=hidden)
        mark(2)
        out = calls.verify(vi, batch=batch, logits_output=lo, page_size=1, model_runner=object())  # only tested for None
        mark(3)
    return types.SimpleNamespace(tree=tree, bufs=bufs, retrieve=retrieve, mask=mask, spine=spine, vi=vi, out=out, batch=batch)


def greedy_logits(target: torch.Tensor, V: int) -> torch.Tensor:
    """[bs * D, V] logits whose argmax is the target token of each node ([bs, D])."""
    return torch.nn.functional.one_hot(target.reshape(-1).cpu(), V).float() * 10


def ddtree_pr():
    """The DDTree PR's modules, the PR's own functions (``pr.calls``: originals even while the
    hook is installed) and the names the worker calls (``pr.hooked``: its module's imports, its
    class, the verify input's class)."""
    from sglang.srt.speculative import ddtree_info, ddtree_utils, ddtree_worker, eagle_utils

    import sglang.kernels.ops.speculative.spec_tree as spec_tree

    original = lambda f: getattr(f, "_kdtree_original", f)
    calls = types.SimpleNamespace(
        build=original(ddtree_utils.build_ddtree_tree), eagle_format=original(ddtree_utils.build_eagle_tree_format),
        flat_mask=original(ddtree_worker.DDTreeWorker._build_flat_tree_mask),
        verify=original(ddtree_info.DDTreeVerifyInput.verify))
    hooked = types.SimpleNamespace(
        build=lambda **kw: ddtree_worker.build_ddtree_tree(**kw),
        eagle_format=lambda **kw: ddtree_worker.build_eagle_tree_format(**kw),
        flat_mask=lambda worker, **kw: worker._build_flat_tree_mask(**kw), verify=lambda vi, **kw: vi.verify(**kw))
    return types.SimpleNamespace(utils=ddtree_utils, info=ddtree_info, worker=ddtree_worker, eagle_utils=eagle_utils,
                                 spec_tree=spec_tree, calls=calls, hooked=hooked)


def verify_tree_greedy_on_triton(spec_tree):
    """SGLang's greedy tree verify on its own Triton kernel (its XPU path), for eagle_sample:
    0.5.23's dispatcher has no CPU path without sgl_kernel (a silent no-op there), and on a GPU
    it needs no JIT toolchain."""

    def verify_tree_greedy_func(*, predicts, accept_index, accept_token_num, topk=-1, **arrays):
        spec_tree.verify_tree_greedy_triton(predicts, accept_index, accept_token_num, **arrays)
        return predicts, accept_index, accept_token_num

    return verify_tree_greedy_func


def same(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert a.device == b.device and torch.equal(a, b), what
    elif isinstance(a, (list, tuple, sglang_hook.LazyChildMaps)) or isinstance(b, (list, tuple, sglang_hook.LazyChildMaps)):
        assert list(a) == list(b), what
    else:
        assert a == b, what


def assert_same_round(ours, theirs):
    for name, a, b in zip(("node_token_ids", "node_depths", "parents", "child_maps", "visibility", "sizes"),
                          ours.tree, theirs.tree):
        same(a, b, name)
    for name, a, b in zip(("retrive_index", "retrive_next_token", "retrive_next_sibling"), ours.retrieve, theirs.retrieve):
        same(a, b, name)
    same(ours.mask, theirs.mask, "custom_mask")
    assert ours.spine == theirs.spine
    if theirs.out is None:
        return
    for name, a, b in zip(("next_tokens", "commit_lens", "next_target_hidden", "num_correct_drafts"), ours.out, theirs.out):
        same(a, b, name)
    for name in ("accepted_indices", "accept_index_flat", "accept_length_per_req", "next_tokens", "accepted_tokens"):
        same(getattr(ours.vi, name), getattr(theirs.vi, name), name)
    a, b = ours.batch, theirs.batch
    for name in ("seq_lens", "seq_lens_cpu", "seq_lens_sum", "out_cache_loc", "input_ids"):
        same(getattr(a, name), getattr(b, name), name)
    same(a.req_to_token_pool.req_to_token, b.req_to_token_pool.req_to_token, "req_to_token")
    for name in ("free_pages", "release_pages"):
        same(getattr(a.token_to_kv_pool_allocator, name), getattr(b.token_to_kv_pool_allocator, name), f"allocator.{name}")
    assert [r.kv_allocated_len for r in a.reqs] == [r.kv_allocated_len for r in b.reqs]


# ---- SGLang's own verify step ----


def _sglang():
    """SGLang's classes and modules the testbed builds from, imported on first use (the rest of
    this module needs no SGLang)."""
    import transformers
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.layers.attention import triton_backend
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.kv_loc_plan import KVLocPlan
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative import eagle_utils, spec_utils
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    return types.SimpleNamespace(
        transformers=transformers, spec_tree=spec_tree, AttentionArch=AttentionArch, triton_backend=triton_backend,
        Fp8Config=Fp8Config, RadixAttention=RadixAttention, TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        KVIndexTranslator=KVIndexTranslator, KVLocPlan=KVLocPlan, MHATokenToKVPool=MHATokenToKVPool,
        MLATokenToKVPool=MLATokenToKVPool, ReqToTokenPool=ReqToTokenPool, CaptureHiddenMode=CaptureHiddenMode,
        ForwardBatch=ForwardBatch, ForwardMode=ForwardMode, SpawnRanks=SpawnRanks, publish=publish,
        reset_context=reset_context, ServerArgs=ServerArgs, eagle_utils=eagle_utils, spec_utils=spec_utils,
        DFlashVerifyInput=DFlashVerifyInput, EagleVerifyInput=EagleVerifyInput)




def publish_server(device: str, *, algorithm: str = "EAGLE", num_draft_tokens: int = 4, topk: int = 2,
                   steps: int = 3, **server_args) -> None:
    """Publish the server arguments SGLang's backends read at construction (call
    ``reset_context()`` when done); ``server_args`` go to ``ServerArgs`` as they are."""
    sg = _sglang()
    sg.reset_context()
    spec = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=num_draft_tokens)
    if algorithm == "EAGLE":
        spec.update(speculative_eagle_topk=topk, speculative_num_steps=steps)
    sg.publish(sg.ServerArgs(model_path="dummy", device=device, attention_backend="triton", **spec, **server_args),
            role="test", ranks=sg.SpawnRanks(world_rank=0, dp_rank=None))


class Runner:
    """One model runner's attention state: its KV pool and its TritonAttnBackend.

    A target runner owns the request table and the allocator; a draft runner (``draft_of``)
    shares both, as SGLang's speculative workers do, with a KV pool of its own. ``page_size``
    > 1 is ``--page-size``: SGLang's paged allocator, which hands a request whole pages.
    """

    def __init__(self, *, device: str, dtype: torch.dtype, heads: int, layers: int, num_tokens_per_req: int,
                 pool_size: int = 4096, max_context: int = 1024, max_reqs: int = 8, mla: bool = True,
                 head_dim: int = 128, draft_of: Optional["Runner"] = None, kv_dtype: Optional[torch.dtype] = None,
                 page_size: int = 1):
        sg = _sglang()
        self.device, self.dtype, self.heads, self.layers, self.mla = device, dtype, heads, layers, mla
        self.page_size = page_size
        kv_dtype = kv_dtype or dtype  # an fp8 dtype: SGLang's fp8 pool (uint8 storage), q stays `dtype`
        self.kv_dtype = kv_dtype
        if draft_of is None:
            self.req_to_token_pool = sg.ReqToTokenPool(size=max_reqs, max_context_len=max_context, device=device,
                                                    enable_memory_saver=False)
        else:
            self.req_to_token_pool = draft_of.req_to_token_pool
            pool_size = draft_of.allocator.size
        if mla:
            self.kv_pool = sg.MLATokenToKVPool(size=pool_size, page_size=page_size, dtype=kv_dtype, kv_lora_rank=MLA_V,
                                            qk_rope_head_dim=MLA_QK - MLA_V, layer_num=layers, device=device,
                                            enable_memory_saver=False)
            self.qk_dim, self.v_dim, kv_heads = MLA_QK, MLA_V, 1
        else:
            self.kv_pool = sg.MHATokenToKVPool(size=pool_size, page_size=page_size, dtype=kv_dtype, head_num=heads,
                                            head_dim=head_dim, layer_num=layers, device=device,
                                            enable_memory_saver=False)
            self.qk_dim, self.v_dim, kv_heads = head_dim, head_dim, heads
        self.kv_heads = kv_heads
        if draft_of is not None:
            self.allocator = draft_of.allocator
        elif page_size == 1:
            self.allocator = sg.TokenToKVPoolAllocator(size=pool_size, dtype=kv_dtype, device=device,
                                                       kvcache=self.kv_pool, need_sort=False)
        else:
            self.allocator = sg.PagedTokenToKVPoolAllocator(size=pool_size, page_size=page_size, dtype=kv_dtype,
                                                            device=device, kvcache=self.kv_pool, need_sort=False)
        translator = sg.KVIndexTranslator(req_to_token=self.req_to_token_pool.req_to_token,
                                       token_to_kv_pool_allocator=self.allocator, token_to_kv_pool=self.kv_pool,
                                       page_size=page_size, device=device, is_draft_worker=draft_of is not None)
        model_config = types.SimpleNamespace(
            attention_arch=sg.AttentionArch.MLA if mla else sg.AttentionArch.MHA,
            hf_config=sg.transformers.PretrainedConfig(model_type="llama"), linear_attn_registry_result=None,
            get_max_num_attention_heads=lambda: heads, get_num_kv_heads=lambda tp, dcp=1: kv_heads,
            v_head_dim=self.v_dim, swa_v_head_dim=None, context_len=max_context, head_dim=self.qk_dim,
            is_encoder_decoder=False, is_draft_model=draft_of is not None)
        self.model_runner = types.SimpleNamespace(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.kv_pool,
            token_to_kv_pool_allocator=self.allocator, sliding_window_size=None, page_size=page_size,
            kv_index_translator=translator, decode_num_tokens_per_req=lambda: num_tokens_per_req,
            model_config=model_config, is_draft_worker=draft_of is not None, device=device, gpu_id=0,
            spec_algorithm=None, kv_cache_dtype=kv_dtype)
        self.translator = translator
        self.backend = sg.triton_backend.TritonAttnBackend(self.model_runner)

    def layer(self, layer_id: int, *, fp8_checkpoint: bool = False, kv_scales: Optional[tuple] = None):
        """An attention layer as the model builds it; ``fp8_checkpoint`` gives it the KV-cache
        scales an FP8 checkpoint's quantisation config sets: ``kv_scales`` = (k_scale, v_scale)
        as loaded from the checkpoint (SGLang's loader turns a missing one into 1.0)."""
        sg = _sglang()
        quant = sg.Fp8Config(is_checkpoint_fp8_serialized=True) if fp8_checkpoint or kv_scales else None
        layer = sg.RadixAttention(self.heads, self.qk_dim, self.qk_dim**-0.5, self.kv_heads, layer_id,
                               v_head_dim=self.v_dim, quant_config=quant)
        if kv_scales is not None:
            layer.k_scale.data.fill_(kv_scales[0])
            layer.v_scale.data.fill_(kv_scales[1])
        if layer.quant_method is not None:
            layer.quant_method.process_weights_after_loading(layer)
        return layer

    def fill(self, generator: torch.Generator) -> None:
        """Fresh random KV in every slot of every layer (an fp8 pool's bytes: random values
        rounded to its format, so no NaN)."""
        for bufs in (getattr(self.kv_pool, "kv_buffer", None), getattr(self.kv_pool, "k_buffer", None),
                     getattr(self.kv_pool, "v_buffer", None)):
            for buf in bufs or ():
                buf.copy_(torch.randn(buf.shape, generator=generator).to(self.kv_dtype).view(buf.dtype))


def eagle_tree(runner: Runner, seq_lens: torch.Tensor, *, topk: int, steps: int, num_draft_tokens: int,
               generator: torch.Generator, mask_buffer: Optional[torch.Tensor] = None):
    """An EAGLE verify input as SGLang's draft loop makes it: per step, random draft top-k
    probabilities through SGLang's ``select_top_k_tokens``, then its ``organize_draft_results``
    and ``build_tree_kernel_efficient`` (the flat custom mask, positions, retrieve arrays).
    SGLang's own Triton tree builder stands in for sgl_kernel's CUDA one, which needs a
    compiled extension."""
    sg = _sglang()
    B, dev = seq_lens.numel(), seq_lens.device
    scores, tokens, parents = [], [], []
    score = None
    for i in range(steps):
        rows = B if i == 0 else B * topk
        p = torch.rand(rows, topk, generator=generator).to(dev)
        p = (p / p.sum(-1, keepdim=True)).sort(-1, descending=True).values
        ids = torch.randint(0, 32000, (rows, topk), generator=generator).to(dev)
        if i == 0:
            _, _, score, info = sg.spec_utils._select_top_k_tokens_first(p, ids, None, topk)
        else:
            later = getattr(sg.spec_utils._select_top_k_tokens_later, "_torchdynamo_orig_callable",
                            sg.spec_utils._select_top_k_tokens_later)
            _, _, score, info = later(i, p, ids, None, score, topk)
        scores.append(info[0])
        tokens.append(info[1])
        parents.append(info[2])
    parent_list, top_index, draft_tokens = sg.eagle_utils.organize_draft_results(scores, tokens, parents,
                                                                              num_draft_tokens)
    bonus = torch.randint(0, 32000, (B,), generator=generator).to(dev)
    build = sg.eagle_utils.build_tree_kernel_efficient_func
    sg.eagle_utils.build_tree_kernel_efficient_func = sg.spec_tree.sgl_build_tree_kernel_triton
    try:
        mask, positions, r_index, r_next, r_sibling, draft = sg.eagle_utils.build_tree_kernel_efficient(
            bonus, parent_list, top_index, draft_tokens, seq_lens, int(seq_lens.sum()), topk, steps,
            num_draft_tokens, tree_mask_buf=mask_buffer)
    finally:
        sg.eagle_utils.build_tree_kernel_efficient_func = build
    return sg.EagleVerifyInput(
        draft_token=draft, custom_mask=mask, positions=positions, retrieve_index=r_index,
        retrieve_next_token=r_next, retrieve_next_sibling=r_sibling, retrieve_cum_len=None, spec_steps=steps,
        topk=topk, draft_token_num=num_draft_tokens, capture_hidden_mode=sg.CaptureHiddenMode.FULL,
        seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=seq_lens.cpu())


def dflash_chain(seq_lens: torch.Tensor, num_draft_tokens: int, generator: torch.Generator):
    """A DFlash verify input: a causal chain of draft tokens, no custom mask."""
    sg = _sglang()
    B, dev = seq_lens.numel(), seq_lens.device
    draft = torch.randint(0, 32000, (B * num_draft_tokens,), generator=generator).to(dev)
    positions = (seq_lens[:, None] + torch.arange(num_draft_tokens, device=dev)).reshape(-1)
    return sg.DFlashVerifyInput(draft_token=draft, positions=positions, draft_token_num=num_draft_tokens)


class Step(types.SimpleNamespace):
    """One verify step: the ForwardBatch and what built it."""


def verify_step(target: Runner, prefix_lens: Sequence[int], spec_info, *, generator: torch.Generator,
                rows: Optional[torch.Tensor] = None) -> Step:
    """Lay out a TARGET_VERIFY batch as SGLang's scheduler does: each request's prefix in
    allocator slots scattered over the pool, ``num_tokens_per_req`` fresh slots per request
    for the draft tokens, the request table filled, a KVLocPlan bound, and the ForwardBatch.
    With pages (``target.page_size`` > 1) a request's tokens fill its pages in order, prefix
    then draft tokens, and its pages lie scattered over the pool."""
    sg = _sglang()
    dev = target.device
    B, N = len(prefix_lens), spec_info.draft_token_num
    target.allocator.clear()
    P = target.page_size
    pages_of = [-(-(p + N) // P) for p in prefix_lens]
    total = sum(pages_of) * P
    slots = target.allocator.alloc(total)
    assert slots is not None, f"pool too small for {total} slots"
    if P == 1:
        slots = slots[torch.randperm(total, generator=generator).to(slots.device)]
        prefix_slots, out_loc = slots[: sum(prefix_lens)], slots[sum(prefix_lens):]
    else:
        pages = slots.view(-1, P)[torch.randperm(sum(pages_of), generator=generator).to(slots.device)]
        firsts = itertools.accumulate([0, *pages_of])
        tokens = [pages[a:a + n].reshape(-1) for a, n in zip(firsts, pages_of)]
        prefix_slots = torch.cat([t[:p] for t, p in zip(tokens, prefix_lens)])
        out_loc = torch.cat([t[p:p + N] for t, p in zip(tokens, prefix_lens)])
    rows = torch.arange(1, B + 1, dtype=torch.int64, device=dev) if rows is None else rows
    table = target.req_to_token_pool.req_to_token
    start = 0
    for b, p in enumerate(prefix_lens):
        table[rows[b], :p] = prefix_slots[start:start + p].to(table.dtype)
        table[rows[b], p:p + N] = out_loc[b * N:(b + 1) * N].to(table.dtype)
        start += p
    seq = torch.tensor(list(prefix_lens), dtype=torch.int64, device=dev)
    plan = sg.KVLocPlan(source=target.translator, req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq.cpu(),
                     write_virtual=None, write_slots=out_loc, read_extent=N)
    fb = sg.ForwardBatch(forward_mode=sg.ForwardMode.TARGET_VERIFY, batch_size=B,
                      input_ids=spec_info.draft_token, req_pool_indices=rows, seq_lens=seq, out_cache_loc=out_loc,
                      seq_lens_sum=sum(prefix_lens), seq_lens_cpu=seq.cpu(), spec_info=spec_info, kv_loc_plan=plan,
                      positions=spec_info.positions)
    return Step(fb=fb, prefix_lens=list(prefix_lens), prefix_slots=prefix_slots, out_loc=out_loc, N=N, T=B * N,
                rows=rows)


def layer_inputs(runner: Runner, T: int, generator: torch.Generator):
    """Random q [T, H * qk] and k [T, KV heads, qk], v (a view of k for MLA, as DeepSeek's
    forward passes them), in the runner's dtype and device."""
    q = torch.randn(T, runner.heads * runner.qk_dim, generator=generator).to(runner.dtype).to(runner.device)
    k = torch.randn(T, runner.kv_heads, runner.qk_dim, generator=generator).to(runner.dtype).to(runner.device)
    if runner.mla:
        return q, k, k[..., :MLA_V]
    v = torch.randn(T, runner.kv_heads, runner.v_dim, generator=generator).to(runner.dtype).to(runner.device)
    return q, k, v
