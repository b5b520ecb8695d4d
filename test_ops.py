"""Tests for kdtree_ops. CPU tests always run; GPU tests need a CUDA GPU and the built kernels.

Every op is checked the same way: CUDA against the CPU reference on fresh random data at odd
sizes, and, from one table of sample inputs per op (SAMPLES), registration for CPU, Meta and
CUDA, ``torch.library.opcheck``, CUDA-graph capture + replay with changed inputs and
``torch.compile(fullgraph=True)``. One table of bad inputs (BAD_INPUTS) drives the argument
contract's tests and README.md's table.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging as _logging
import math
import os
import re
import shutil
import subprocess
import sys
import types as _types
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# SGLang's Triton kernels run on CPU in the interpreter; chosen before anything
# (SGLang, the benchmarks' baselines) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bench_ops  # noqa: E402
import defrag  # noqa: E402
import kdtree_ops  # noqa: E402
import sglang_hook  # noqa: E402
import testkit  # noqa: E402
from testkit import (  # noqa: E402
    DDTREE_KINDS, MLA_QK, MLA_V, ROW_TOL, VERIFY_ARGS, assert_same_round, assert_verify_close, ddtree_batch, ddtree_logits,
    ddtree_round, ddtree_targets, greedy_logits, make_verify_case, rel_err, rows_close, same, sglang_flat_mask,
    skip_unless_triton_runs_on, tree_buffers, verify_args, verify_reference)

GPU = kdtree_ops.cuda_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the built kdtree kernels")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]


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


# ---- the contract: one table of sample inputs per op, one table of bad inputs ----
#
# SAMPLES drives the generic tests (registration on CPU, Meta and CUDA; opcheck; CUDA-graph
# replay with changed inputs; torch.compile(fullgraph=True)) of every op; BAD_INPUTS drives the
# argument-contract tests and README.md's table of bad inputs.


class OpSamples(NamedTuple):
    """``make(device, seed)`` -> [(args, kwargs)] of ``torch.ops.kdtree.<name>`` (draft_topk: of
    the function), same shapes and host ints for every seed; ``call(*args, **kwargs)`` is how a
    caller reaches it through the public API; ``tol`` is the CUDA-vs-CPU tolerance (0 = exact)."""

    make: Callable
    call: Callable
    tol: float = 0.0


def merge_samples(device, seed):
    return [(merge_inputs(13, 3, 16, torch.bfloat16, device, seed=seed), {}),
            (merge_inputs(57, 16, 512, torch.float32, device, seed=seed), {})]


def verify_samples(device, seed, out=False):
    """verify_attn's (verify_attn_out's) positional op arguments through max_kv_len, and for
    fp8 pools (e4m3 bytes, as SGLang stores them) on to k_scale, k_scale_value: each k_scale
    form once, a tensor's value changing with the seed (a host float cannot)."""
    shapes = [(([23, 5], [3, 6], 2), {}, None), (([1500, 40], [9, 13], 16), {"pool": 4000}, None),
              (([40, 3], [5, 2], 4), {"causal": True}, None),
              (([31, 4], [5, 3], 3), {}, "tensor [1]"), (([9], [6], 2), {"causal": True}, "tensor []"),
              (([17, 0], [2, 7], 1), {}, "float"), (([12], [3], 2), {}, "none")]
    samples = []
    for (prefix_lens, node_counts, heads), kw, k_scale in shapes:
        case = make_verify_case(prefix_lens, node_counts, heads, device=device, seed=seed, **kw)
        if k_scale is not None:
            value = 0.37 if k_scale == "float" else 1.0 if k_scale == "none" else 0.3 + 0.11 * seed
            case = fp8_pool(case, torch.uint8, value, seed=seed)[0]
        args = verify_args(case)
        if out:
            T = case["q"].shape[0]
            args += [torch.zeros(T, heads, 512, device=device, dtype=torch.bfloat16), torch.zeros(T, heads, device=device)]
        args.append(max(prefix_lens))
        if k_scale is not None:
            tensor = case["k_scale"].reshape(() if k_scale == "tensor []" else (1,))
            args += [tensor, 1.0] if k_scale.startswith("tensor") else [None, case["k_scale_float"]]
        samples.append((tuple(args), {}))
    return samples


def _verify_kw(max_kv_len=-1, k_scale=None, k_scale_value=1.0):
    """The op's trailing arguments as verify_attn's keywords."""
    if k_scale is None and k_scale_value != 1.0:
        k_scale = k_scale_value
    return dict(max_kv_len=None if max_kv_len < 0 else max_kv_len, k_scale=k_scale)


def mask_samples(device, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(7, 45, generator=g) < 0.5
    return [((mask.to(device),), {}), ((mask.to(device, torch.uint8),), {})]


def sglang_mask_samples(device, seed):
    case = make_verify_case([5, 0, 70], [9, 33, 1], 1, device="cpu", seed=seed)
    flat, indptr = sglang_flat_mask(case)
    return [((flat.to(device), indptr.to(device), case["qo_indptr"].to(device), case["kv_indptr"].to(device), 43, 33), {})]


def tree_samples(device, seed, B=3):
    """A DDTree batch: log-probs, tokens, roots, the tree (budget 40), prefix lengths, targets."""
    lp, tok, root = tree_inputs(B, 5, 6, ["ties", "normal"][seed % 2], seed=seed)
    tree, target = walk_targets(kdtree_ops.build_tree(lp, tok, root, 40), seed=seed)
    prefix_lens = torch.randint(0, 20, (B,), generator=torch.Generator().manual_seed(seed))
    to = lambda *ts: tuple(t.to(device) for t in ts)  # noqa: E731
    return to(lp, tok, root), kdtree_ops.Tree(*to(*tree)), *to(prefix_lens, target)


def build_tree_samples(device, seed):
    (lp, tok, root), *_ = tree_samples(device, seed)
    return [((lp, tok, root, 40), {}), ((lp, tok.int(), root, 7), {})]


def verify_metadata_samples(device, seed):
    _, tree, prefix_lens, _ = tree_samples(device, seed)
    return [((tree.depths, tree.parents, prefix_lens, retrieve), {}) for retrieve in (False, True)]


def flat_custom_mask_samples(device, seed):
    _, tree, prefix_lens, _ = tree_samples(device, seed)
    (lp, tok, budget, *_), _ = sglang_tree_samples("cpu", seed)[0]
    sg = kdtree_ops.sglang_build_tree(lp, tok, budget)
    packed = kdtree_ops.pack_tree_mask(sg.visibility.reshape(3 * 25, 25)).view(3, 25, -1)
    return [((tree.mask, prefix_lens, 41 * (60 + 3 * 41) + 5, None), {}),
            ((packed.to(device), prefix_lens, 25 * (60 + 75) + 7, sg.tree_sizes.to(device)), {})]


def accept_walk_samples(device, seed):
    _, tree, _, target = tree_samples(device, seed)
    return [((tree.parents, tree.tokens, target, 5), {})]


def sglang_tree_out(B, budget, device):
    """Zeroed buffers of :class:`kdtree_ops.SGLangTree`'s shapes and dtypes."""
    D = budget + 1
    shapes = ((B, budget), (B, budget), (B, D), (B, D, D), (B,))
    dtypes = (torch.int64, torch.int64, torch.int64, torch.bool, torch.int64)
    return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]


def sglang_tree_samples(device, seed):
    logits = ddtree_logits(3, 5, 70, ["ties", "peaked", "random"][seed % 3], torch.Generator().manual_seed(seed))
    samples = []
    for k, budget, chain in ((5, 24, False), (1, 5, True)):
        lp, tok = (t.contiguous().to(device) for t in kdtree_ops.draft_topk(logits, k))
        out = sglang_tree_out(3, budget, device)
        samples.append(((lp, tok, budget, 0.2, math.log(budget), 1.0, chain, *out), {}))
    return samples


def accept_retrieve_samples(device, seed):
    args, _ = retrieve_case(3, 5, 70, 24, DDTREE_KINDS[seed % len(DDTREE_KINDS)], seed, device)
    return [((*args, 5), {})]


def move_kv_samples(device, seed):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for disjoint in (False, True):
        # separate buffers per layer, as a pool's are (kv_pool's CPU layers are views of one
        # tensor, which torch 2.11's compiled CPU graphs did not write back correctly)
        kv = [t.clone() for t in kv_pool(300, (1, 576), torch.bfloat16, 3, device, g)]
        src, dst = move_pairs(300, 77, overlap=not disjoint, gen=g)
        samples.append(((kv, src.to(device), dst.to(device)), {"disjoint": disjoint}))
    return samples


def draft_topk_samples(device, seed):
    # distinct values, exact in bfloat16: CPU and CUDA top-k break ties differently
    g = torch.Generator().manual_seed(seed)
    logits = torch.stack([torch.randperm(97, generator=g) for _ in range(15)]).view(3, 5, 97).float().sub(48) / 8
    return [((logits.to(device), 7), {}), ((logits.to(device, torch.bfloat16), 7), {})]


def _verify_metadata_call(depths, parents, prefix_lens, retrieve):
    return kdtree_ops.verify_metadata(kdtree_ops.Tree(None, parents, depths, None, None), prefix_lens, retrieve=retrieve)


def _sglang_build_tree_call(lp, tok, budget, depth_bonus, log_budget, stop_margin, chain, *out):
    assert log_budget == math.log(budget)  # what the function passes
    return kdtree_ops.sglang_build_tree(lp, tok, budget, depth_bonus=depth_bonus, stop_margin=stop_margin, chain=chain, out=out)


SAMPLES = {
    "merge_state": OpSamples(merge_samples, kdtree_ops.merge_state, 1e-2),
    "merge_state_": OpSamples(merge_samples, kdtree_ops.merge_state_, 1e-2),
    "verify_attn": OpSamples(verify_samples, lambda *a: kdtree_ops.verify_attn(*a[:8], **_verify_kw(*a[8:])), 1e-2),
    "verify_attn_out": OpSamples(functools.partial(verify_samples, out=True),
                                 lambda *a: kdtree_ops.verify_attn(*a[:8], out=a[8], lse=a[9], **_verify_kw(*a[10:])), 1e-2),
    "pack_tree_mask": OpSamples(mask_samples, kdtree_ops.pack_tree_mask),
    "sglang_mask_to_packed": OpSamples(
        sglang_mask_samples, lambda c, m, q, k, rows, nodes: kdtree_ops.sglang_mask_to_packed(c, m, q, k, num_rows=rows, max_nodes=nodes)),
    "draft_topk": OpSamples(draft_topk_samples, kdtree_ops.draft_topk, 1e-5),
    "build_tree": OpSamples(build_tree_samples, lambda *a: tuple(kdtree_ops.build_tree(*a))),
    "verify_metadata": OpSamples(verify_metadata_samples, _verify_metadata_call),
    "flat_custom_mask": OpSamples(flat_custom_mask_samples, kdtree_ops.flat_custom_mask),
    "accept_walk": OpSamples(accept_walk_samples, lambda par, tok, target, depth: kdtree_ops.accept_walk(
        kdtree_ops.Tree(tok, par, None, None, None), target, depth)),
    "sglang_build_tree_": OpSamples(sglang_tree_samples, _sglang_build_tree_call),
    "accept_retrieve": OpSamples(accept_retrieve_samples, kdtree_ops.accept_retrieve),
    "move_kv": OpSamples(move_kv_samples, kdtree_ops.move_kv),
}
OPS = [name for name in SAMPLES if hasattr(torch.ops.kdtree, name)]  # draft_topk is torch ops only


def test_every_op_has_samples():
    assert set(OPS) == {op.split("::")[1] for op in torch._C._dispatch_get_all_op_names() if op.startswith("kdtree::")}


def _mutated(name, args):
    """The arguments the op writes (its schema's Tensor(a!)), flattened."""
    if name not in OPS:
        return []
    schema = getattr(torch.ops.kdtree, name).default._schema
    written = [a for a, arg in zip(args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]
    return [t for a in written for t in (a if isinstance(a, (list, tuple)) else [a])]


def _tensors(x):
    if isinstance(x, torch.Tensor) or x is None:
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def assert_same_results(got, want, tol):
    got, want = _tensors(got), _tensors(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        if w is None:
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape, g.dtype, w.dtype)
        assert same_bytes(g, w) if tol == 0 else rel_err(g, w) < tol, (i, rel_err(g, w))


def on(device, x):
    """A copy of x (tensors, nested in lists or tuples) on device."""
    if isinstance(x, torch.Tensor):
        return x.to(device, copy=True)
    if isinstance(x, (list, tuple)):
        return type(x)(on(device, v) for v in x)
    return x


def expected(name, args, kwargs):
    """What the public call returns and writes on the CPU, from copies of args."""
    cpu = on("cpu", args)
    result = SAMPLES[name].call(*cpu, **kwargs)
    return result, _mutated(name, cpu)


@pytest.mark.parametrize("name", OPS)
def test_op_registered_for_cpu_meta_and_cuda(name):
    """CPU reference, Meta (the fake impl: outputs of the CPU reference's shapes and dtypes) and,
    where the kernels are built, CUDA."""
    qualname = f"kdtree::{name}"
    for key in ["CPU", "Meta"] + (["CUDA"] if GPU else []):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), key
    op = getattr(torch.ops.kdtree, name).default
    for args, kwargs in SAMPLES[name].make("cpu", 0):
        want = [t for t in _tensors(op(*on("cpu", args), **kwargs)) if t is not None]
        got = [t for t in _tensors(op(*on("meta", args), **kwargs)) if t is not None]
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
        assert all(t.device.type == "meta" for t in got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_op_opcheck(name, device):
    op = getattr(torch.ops.kdtree, name).default
    for args, kwargs in SAMPLES[name].make(device, 0):
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(SAMPLES))
def test_op_compiles_fullgraph(name, device):
    """The public call under torch.compile(fullgraph=True) returns and writes what the CPU
    reference does, eagerly."""
    entry = SAMPLES[name]
    for args, kwargs in entry.make(device, 0):
        want, want_written = expected(name, args, kwargs)
        compiled = torch.compile(lambda *a: entry.call(*a, **kwargs), fullgraph=True)
        got = compiled(*args)
        assert_same_results(got, want, entry.tol)  # draft_topk's compiled kernels round otherwise
        assert_same_results(_mutated(name, args), want_written, entry.tol)
        torch._dynamo.reset()


def _refill(static, fresh):
    for s, f in zip(_tensors(static), _tensors(fresh)):
        if s is not None:
            s.copy_(f)


@needs_gpu
@pytest.mark.parametrize("name", list(SAMPLES))
def test_op_cuda_graph_replay(name):
    """The public call captured once, then replayed on the inputs of other seeds (same shapes):
    returns and writes what the CPU reference does on those inputs."""
    entry = SAMPLES[name]
    for i, (static, kwargs) in enumerate(entry.make("cuda", 0)):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            entry.call(*static, **kwargs)  # warm-up outside capture (lazy init, allocator)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = entry.call(*static, **kwargs)
        for seed in (1, 2):
            fresh, fresh_kwargs = entry.make("cpu", seed)[i]
            assert fresh_kwargs == kwargs
            want, want_written = expected(name, fresh, kwargs)
            _refill(static, fresh)
            graph.replay()
            torch.cuda.synchronize()
            assert_same_results(out, want, entry.tol)
            assert_same_results(_mutated(name, static), want_written, entry.tol)


class BadInput(NamedTuple):
    """``call(device)`` passes one bad argument to ``op`` (a public function); it must raise a
    RuntimeError containing ``error`` on the CPU always and on CUDA. ``unchecked`` is None for a
    host check (no tensor data read: it raises on every device, always); for a value check it
    is what CUDA does without KDTREE_CHECK=1, which makes CUDA raise too."""

    op: str
    what: str
    call: Callable
    error: str
    unchecked: Optional[str] = None


def other_device(device):
    return "meta" if device == "cpu" else "cpu"


def bad_verify(what, change, error, unchecked=None, shape=([10, 4], [3, 2], 2), pool=20):
    def call(device):
        case = make_verify_case(*shape, device=device, pool=pool, seed=0)
        kw = {k: case[k] for k in VERIFY_ARGS}
        kw.update(change(kw, device))
        return kdtree_ops.verify_attn(**kw)

    return BadInput("verify_attn", what, call, error, unchecked)


def bad_call(op, what, make, change, error, unchecked=None):
    """``make(device)`` -> good keyword arguments of ``op``; ``change(kw, device)`` -> the bad ones."""
    def call(device):
        kw = make(device)
        kw.update(change(kw, device))
        return getattr(kdtree_ops, op)(**kw)

    return BadInput(op, what, call, error, unchecked)


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _merge_kw(device):
    return dict(zip(["v_a", "s_a", "v_b", "s_b"], merge_inputs(4, 2, 8, torch.float32, device, seed=0)))


def _sglang_mask_kw(device):
    (c, m, q, k, rows, nodes), _ = sglang_mask_samples(device, 0)[0]
    return dict(custom_mask=c, mask_indptr=m, qo_indptr=q, kv_indptr=k, num_rows=rows, max_nodes=nodes)


def _build_tree_kw(device):
    (lp, tok, root), *_ = tree_samples(device, 0)
    return dict(topk_logprobs=lp, topk_tokens=tok, root_tokens=root, budget=8)


def _verify_metadata_kw(device):
    _, tree, prefix_lens, _ = tree_samples(device, 0)
    return dict(tree=tree, prefix_lens=prefix_lens, custom_mask_capacity=1000)


def _flat_mask_kw(device):
    _, tree, prefix_lens, _ = tree_samples(device, 0)
    return dict(mask=tree.mask, prefix_lens=prefix_lens, capacity=1000, num_nodes=tree.num_nodes)


def _accept_walk_kw(device):
    _, tree, _, target = tree_samples(device, 0)
    return dict(tree=tree, target_tokens=target, max_depth=5)


def _sglang_tree_kw(device):
    (lp, tok, budget, *_), _ = sglang_tree_samples(device, 0)[0]
    return dict(topk_logprobs=lp, topk_tokens=tok, budget=budget)


def _retrieve_kw(device):
    (nxt, sib, cand, target, depth), _ = accept_retrieve_samples(device, 0)[0]
    return dict(next_token=nxt, next_sibling=sib, candidates=cand, target_tokens=target, max_depth=depth)


def _move_kw(device):
    kv = kv_pool(10, (8,), torch.bfloat16, 2, device)
    return dict(kv_layers=kv, src_slots=torch.tensor([1, 2], device=device), dst_slots=torch.tensor([3, 4], device=device))


def _draft_kw(device):
    return dict(logits=torch.randn(3, 5, 97, device=device), k=7)


def _fp8_kv(kw, **change):
    """The case's pool as e4m3 bytes (SGLang's fp8 pool), and ``change``."""
    return dict(kv_cache=testkit.e4m3_bytes(kw["kv_cache"], 1.0), **change)


NAN_ROWS = "the kernel flags the error on the device and writes NaN rows"
K_SCALE_RULE = "k_scale must be finite and positive (a normal float32, >= 2^-126)"
MASK_GUARD = "the row reads nothing and gets no bits; the kernel flags the error on the device"
BAD_INPUTS = [
    BadInput("merge_state", "v_a float64", lambda d: kdtree_ops.merge_state(*[t.double() if t.dim() == 3 else t for t in _merge_kw(d).values()]),
             "v_a must be float32, bfloat16 or float16, got torch.float64"),
    bad_call("merge_state", "s_a float64", _merge_kw, lambda kw, d: dict(s_a=kw["s_a"].double()), "s_a must be float32"),
    bad_call("merge_state", "v_b of another shape", _merge_kw, lambda kw, d: dict(v_b=kw["v_b"][:, :1]), "v_b must have shape (4, 2, 8)"),
    bad_call("merge_state", "s_b of another shape", _merge_kw, lambda kw, d: dict(s_b=kw["s_b"][:, :1]), "s_b must have shape (4, 2)"),
    bad_call("merge_state", "v_b on another device", _merge_kw, lambda kw, d: dict(v_b=kw["v_b"].to(other_device(d))), "v_b must be on"),
    bad_verify("q float32", lambda kw, d: dict(q=kw["q"].float()), "q must be bfloat16 or float16, got torch.float32"),
    bad_verify("q float64", lambda kw, d: dict(q=kw["q"].double()), "q must be bfloat16 or float16, got torch.float64"),
    bad_verify("q [T, H, 512]", lambda kw, d: dict(q=kw["q"][..., :512]), "q must be [T, H >= 1, 576]"),
    bad_verify("kv_cache float16", lambda kw, d: dict(kv_cache=kw["kv_cache"].half()),
               "kv_cache must be torch.bfloat16 like q, or float8_e4m3fn / uint8 (e4m3 bytes), got torch.float16"),
    bad_verify("kv_cache float8_e5m2", lambda kw, d: dict(kv_cache=kw["kv_cache"].to(torch.float8_e5m2)),
               "kv_cache must be torch.bfloat16 like q, or float8_e4m3fn / uint8 (e4m3 bytes), got torch.float8_e5m2"),
    bad_verify("k_scale tensor with a bfloat16 kv_cache", lambda kw, d: dict(k_scale=torch.ones(1, device=d)),
               "k_scale applies to an fp8 kv_cache only (kv_cache is torch.bfloat16)"),
    bad_verify("k_scale = 1.0 with a bfloat16 kv_cache", lambda kw, d: dict(k_scale=1.0),
               "k_scale applies to an fp8 kv_cache only (kv_cache is torch.bfloat16)"),
    bad_verify("k_scale float16 [2]", lambda kw, d: _fp8_kv(kw, k_scale=torch.ones(2, device=d, dtype=torch.float16)),
               "k_scale must be a float32 tensor of one element, got torch.float16 (2,)"),
    bad_verify("k_scale float32 [1, 1]", lambda kw, d: _fp8_kv(kw, k_scale=torch.ones(1, 1, device=d)),
               "k_scale must be a float32 tensor of one element, got torch.float32 (1, 1)"),
    bad_verify("k_scale float64 []", lambda kw, d: _fp8_kv(kw, k_scale=torch.tensor(0.5, device=d, dtype=torch.float64)),
               "k_scale must be a float32 tensor of one element, got torch.float64 ()"),
    bad_verify("k_scale on another device", lambda kw, d: _fp8_kv(kw, k_scale=torch.ones(1, device=other_device(d))), "k_scale must be on"),
    bad_verify("k_scale a string", lambda kw, d: _fp8_kv(kw, k_scale="0.5"),
               "k_scale must be None, a float or a float32 tensor of one element, got str"),
    bad_verify("k_scale = inf", lambda kw, d: _fp8_kv(kw, k_scale=math.inf), f"{K_SCALE_RULE}, got inf"),
    bad_verify("k_scale = nan", lambda kw, d: _fp8_kv(kw, k_scale=math.nan), f"{K_SCALE_RULE}, got nan"),
    bad_verify("k_scale = 0", lambda kw, d: _fp8_kv(kw, k_scale=0.0), f"{K_SCALE_RULE}, got 0.0"),
    bad_verify("k_scale = -0.5", lambda kw, d: _fp8_kv(kw, k_scale=-0.5), f"{K_SCALE_RULE}, got -0.5"),
    bad_verify("k_scale = 1e-40 (a float32 subnormal)", lambda kw, d: _fp8_kv(kw, k_scale=1e-40), f"{K_SCALE_RULE}, got 1e-40"),
    bad_verify("kv_cache on another device", lambda kw, d: dict(kv_cache=kw["kv_cache"].to(other_device(d))), "kv_cache must be on"),
    bad_verify("tree_k with fewer rows than q", lambda kw, d: dict(tree_k=kw["tree_k"][:2]), "tree_k must have 5 rows like q"),
    bad_verify("kv_indptr int16", lambda kw, d: dict(kv_indptr=kw["kv_indptr"].short()), "kv_indptr must be 1-D int32 or int64"),
    bad_verify("qo_indptr float32", lambda kw, d: dict(qo_indptr=kw["qo_indptr"].float()), "qo_indptr must be 1-D int32 or int64"),
    bad_verify("kv_indices float32", lambda kw, d: dict(kv_indices=kw["kv_indices"].float()), "kv_indices must be 1-D int32 or int64"),
    bad_verify("empty kv_indptr and qo_indptr", lambda kw, d: dict(kv_indptr=kw["kv_indptr"][:0], qo_indptr=kw["qo_indptr"][:0]),
               "kv_indptr must have batch + 1 >= 1 entries"),
    bad_verify("qo_indptr shorter than kv_indptr", lambda kw, d: dict(qo_indptr=kw["qo_indptr"][:2]), "qo_indptr must have batch + 1 = 3 entries"),
    bad_verify("tree_mask with fewer rows than q", lambda kw, d: dict(tree_mask=kw["tree_mask"][:1]), "tree_mask must be int32 [5, ceil(max_nodes/32)]"),
    bad_verify("out float32", lambda kw, d: dict(out=torch.empty(5, 2, 512, device=d)), "out must be torch.bfloat16 like q"),
    bad_verify("lse bfloat16", lambda kw, d: dict(lse=torch.empty(5, 2, device=d, dtype=torch.bfloat16)), "lse must be float32"),
    bad_verify("max_kv_len = -5", lambda kw, d: dict(max_kv_len=-5), "max_kv_len must be >= 0 (an int64), got -5"),
    bad_verify("kv_indices = -1", lambda kw, d: dict(kv_indices=_set(kw["kv_indices"], 3, -1)),
               "kv_indices must lie in [0, 20) (rows of kv_cache), got kv_indices[3] = -1", NAN_ROWS),
    bad_verify("kv_indices = S (rows of kv_cache)", lambda kw, d: dict(kv_indices=_set(kw["kv_indices"], 3, 20)),
               "kv_indices must lie in [0, 20) (rows of kv_cache), got kv_indices[3] = 20", NAN_ROWS),
    bad_verify("kv_indptr decreasing", lambda kw, d: dict(kv_indptr=_set(kw["kv_indptr"], 2, 9)),
               "kv_indptr must never decrease, got kv_indptr[2] = 9 < kv_indptr[1] = 10", NAN_ROWS),
    bad_verify("kv_indptr not starting at 0", lambda kw, d: dict(kv_indptr=_set(kw["kv_indptr"], 0, 1)),
               "kv_indptr must start at 0, got kv_indptr[0] = 1", NAN_ROWS),
    bad_verify("kv_indptr[-1] > len(kv_indices)", lambda kw, d: dict(kv_indptr=_set(kw["kv_indptr"], 2, 15)),
               "kv_indptr[-1] must be at most 14 (len(kv_indices)), got 15", NAN_ROWS),
    bad_verify("qo_indptr[-1] < T (rows of q)", lambda kw, d: dict(qo_indptr=_set(kw["qo_indptr"], 2, 4)),
               "qo_indptr[-1] must be 5 (rows of q), got 4", NAN_ROWS),
    bad_verify("k_scale tensor holding inf", lambda kw, d: _fp8_kv(kw, k_scale=torch.full((1,), math.inf, device=d)),
               f"{K_SCALE_RULE}, got inf", NAN_ROWS),
    bad_verify("k_scale tensor holding 0", lambda kw, d: _fp8_kv(kw, k_scale=torch.zeros(1, device=d)),
               f"{K_SCALE_RULE}, got 0.0", NAN_ROWS),
    bad_verify("tree_mask narrower than a request's nodes", lambda kw, d: dict(tree_mask=kw["tree_mask"][:, :1]),
               "tree_mask must have at least 2 words per row (a request has 33 nodes), got 1",
               NAN_ROWS, shape=([4], [33], 1), pool=64),
    bad_call("pack_tree_mask", "mask float32", lambda d: dict(mask=torch.rand(3, 40, device=d)), lambda kw, d: {}, "mask must be bool or uint8 [T, N]"),
    bad_call("pack_tree_mask", "mask 1-D", lambda d: dict(mask=torch.rand(40, device=d) < 0.5), lambda kw, d: {}, "mask must be bool or uint8 [T, N]"),
    bad_call("sglang_mask_to_packed", "custom_mask float32", _sglang_mask_kw, lambda kw, d: dict(custom_mask=kw["custom_mask"].float()),
             "custom_mask must be 1-D bool or uint8"),
    bad_call("sglang_mask_to_packed", "mask_indptr float32", _sglang_mask_kw, lambda kw, d: dict(mask_indptr=kw["mask_indptr"].float()),
             "mask_indptr must be 1-D int32 or int64"),
    bad_call("sglang_mask_to_packed", "kv_indptr shorter than qo_indptr", _sglang_mask_kw, lambda kw, d: dict(kv_indptr=kw["kv_indptr"][:3]),
             "kv_indptr must have batch + 1 = 4 >= 1 entries like qo_indptr, got 3"),
    bad_call("sglang_mask_to_packed", "kv_indptr on another device", _sglang_mask_kw,
             lambda kw, d: dict(kv_indptr=kw["kv_indptr"].to(other_device(d))), "kv_indptr must be on"),
    bad_call("sglang_mask_to_packed", "max_nodes = 0", _sglang_mask_kw, lambda kw, d: dict(max_nodes=0), "max_nodes must be >= 1 (an int64), got 0"),
    bad_call("sglang_mask_to_packed", "num_rows = -1", _sglang_mask_kw, lambda kw, d: dict(num_rows=-1), "num_rows must be >= 0 (an int64), got -1"),
    bad_call("sglang_mask_to_packed", "max_nodes below a request's nodes", _sglang_mask_kw, lambda kw, d: dict(max_nodes=9),
             "max_nodes must be at least every request's node count, got 9 but request 1 has 33",
             MASK_GUARD),
    bad_call("sglang_mask_to_packed", "num_rows below qo_indptr[-1]", _sglang_mask_kw, lambda kw, d: dict(num_rows=40),
             "qo_indptr[-1] must be at most 40 (num_rows), got 43", "rows past num_rows are dropped"),
    bad_call("sglang_mask_to_packed", "custom_mask shorter than its blocks", _sglang_mask_kw,
             lambda kw, d: dict(custom_mask=kw["custom_mask"][:-1]), "custom_mask must hold request 2's",
             MASK_GUARD),
    bad_call("draft_topk", "k = 0", _draft_kw, lambda kw, d: dict(k=0), "k must be in [1, 97], got 0"),
    bad_call("draft_topk", "k > V", _draft_kw, lambda kw, d: dict(k=98), "k must be in [1, 97], got 98"),
    bad_call("draft_topk", "k = 2^63", _draft_kw, lambda kw, d: dict(k=2**63), "k must be in [1, 97]"),
    bad_call("draft_topk", "logits 2-D", _draft_kw, lambda kw, d: dict(logits=kw["logits"][0]), "logits must be float32, bfloat16 or float16 [B, L, V]"),
    bad_call("draft_topk", "logits int64", _draft_kw, lambda kw, d: dict(logits=kw["logits"].long()), "logits must be float32, bfloat16 or float16 [B, L, V]"),
    bad_call("build_tree", "topk_logprobs float64", _build_tree_kw, lambda kw, d: dict(topk_logprobs=kw["topk_logprobs"].double()),
             "topk_logprobs must be float32"),
    bad_call("build_tree", "topk_tokens of another shape", _build_tree_kw, lambda kw, d: dict(topk_tokens=kw["topk_tokens"][:, :, :2]),
             "topk_tokens must have shape (3, 5, 6) like topk_logprobs"),
    bad_call("build_tree", "root_tokens int32", _build_tree_kw, lambda kw, d: dict(root_tokens=kw["root_tokens"].int()), "root_tokens must be int64"),
    bad_call("build_tree", "budget = 1025", _build_tree_kw, lambda kw, d: dict(budget=1025), "budget must be in [1, 1024], got 1025"),
    bad_call("build_tree", "budget = 2^63", _build_tree_kw, lambda kw, d: dict(budget=2**63), f"budget must be in [1, 1024], got {2**63}"),
    bad_call("build_tree", "topk_logprobs not contiguous", _build_tree_kw,
             lambda kw, d: dict(topk_logprobs=kw["topk_logprobs"].transpose(1, 2).contiguous().transpose(1, 2)), "topk_logprobs must be contiguous"),
    bad_call("build_tree", "topk_tokens on another device", _build_tree_kw,
             lambda kw, d: dict(topk_tokens=kw["topk_tokens"].to(other_device(d))), "topk_tokens must be on"),
    bad_call("build_tree", "topk_logprobs NaN", _build_tree_kw, lambda kw, d: dict(topk_logprobs=_set(kw["topk_logprobs"], (1, 2, 3), math.nan)),
             "topk_logprobs must not be NaN, got topk_logprobs[1, 2, 3] = nan", "a tree, NaN comparing as the kernel's order makes it"),
    bad_call("build_tree", "topk_logprobs not sorted descending", _build_tree_kw,
             lambda kw, d: dict(topk_logprobs=kw["topk_logprobs"].flip(-1).contiguous()), "topk_logprobs must be sorted descending along dim 2",
             "the heap's tree for the ranks in the order given"),
    bad_call("verify_metadata", "prefix_lens of another shape", _verify_metadata_kw, lambda kw, d: dict(prefix_lens=kw["prefix_lens"][:2]),
             "prefix_lens must have shape (3,)"),
    bad_call("verify_metadata", "prefix_lens float32", _verify_metadata_kw, lambda kw, d: dict(prefix_lens=kw["prefix_lens"].float()),
             "prefix_lens must be int32 or int64"),
    bad_call("verify_metadata", "custom_mask_capacity = -1", _verify_metadata_kw, lambda kw, d: dict(custom_mask_capacity=-1),
             "capacity must be >= 0 (an int64), got -1"),
    bad_call("verify_metadata", "custom_mask_capacity = 2^63", _verify_metadata_kw, lambda kw, d: dict(custom_mask_capacity=2**63),
             f"capacity must be >= 0 (an int64), got {2**63}"),
    bad_call("verify_metadata", "prefix_lens negative", _verify_metadata_kw, lambda kw, d: dict(prefix_lens=_set(kw["prefix_lens"], 1, -3)),
             "prefix_lens must be >= 0 (token counts), got prefix_lens[1] = -3", "negative positions; the flat mask reads it as 0"),
    bad_call("flat_custom_mask", "mask with another word count", _flat_mask_kw, lambda kw, d: dict(mask=kw["mask"][:, :, :1].contiguous()),
             "mask must have 2 words per row (dim 2), got 1"),
    bad_call("flat_custom_mask", "num_nodes of another shape", _flat_mask_kw, lambda kw, d: dict(num_nodes=kw["num_nodes"][:1]),
             "num_nodes must have shape (3,)"),
    bad_call("flat_custom_mask", "prefix_lens negative", _flat_mask_kw, lambda kw, d: dict(prefix_lens=_set(kw["prefix_lens"], 0, -1)),
             "prefix_lens must be >= 0 (token counts), got prefix_lens[0] = -1", "read as 0"),
    bad_call("accept_walk", "target_tokens of another shape", _accept_walk_kw, lambda kw, d: dict(target_tokens=kw["target_tokens"][:, :3]),
             "target_tokens must have shape (3, 41)"),
    bad_call("accept_walk", "tree.tokens int32", _accept_walk_kw, lambda kw, d: dict(tree=kw["tree"]._replace(tokens=kw["tree"].tokens.int())),
             "tokens must be torch.int64"),
    bad_call("accept_walk", "max_depth = -1", _accept_walk_kw, lambda kw, d: dict(max_depth=-1), "max_depth must be in [0, 2147483646], got -1"),
    bad_call("accept_walk", "max_depth = 2^63", _accept_walk_kw, lambda kw, d: dict(max_depth=2**63), "max_depth must be in [0, 2147483646]"),
    bad_call("sglang_build_tree", "topk_tokens int32", _sglang_tree_kw, lambda kw, d: dict(topk_tokens=kw["topk_tokens"].int()),
             "topk_tokens must be int64"),
    bad_call("sglang_build_tree", "chain with budget != L", _sglang_tree_kw, lambda kw, d: dict(chain=True), "chain needs budget == L, got budget 24, L 5"),
    bad_call("sglang_build_tree", "budget = 2^63", _sglang_tree_kw, lambda kw, d: dict(budget=2**63), "budget must be in [1, 1024]"),
    bad_call("sglang_build_tree", "out of another shape", _sglang_tree_kw,
             lambda kw, d: dict(out=sglang_tree_out(3, 23, d)), "node_tokens must have shape (3, 24)"),
    bad_call("accept_retrieve", "next_sibling int32", _retrieve_kw, lambda kw, d: dict(next_sibling=kw["next_sibling"].int()),
             "next_sibling must be torch.int64"),
    bad_call("accept_retrieve", "candidates of another shape", _retrieve_kw, lambda kw, d: dict(candidates=kw["candidates"][:, :3]),
             "candidates must have shape (3, 25)"),
    bad_call("accept_retrieve", "max_depth = -1", _retrieve_kw, lambda kw, d: dict(max_depth=-1), "max_depth must be in [0, 12287], got -1"),
    bad_call("move_kv", "src_slots float32", _move_kw, lambda kw, d: dict(src_slots=kw["src_slots"].float(), dst_slots=kw["dst_slots"].float()),
             "src_slots must be int32 or int64"),
    bad_call("move_kv", "dst_slots int32 beside int64 src_slots", _move_kw, lambda kw, d: dict(dst_slots=kw["dst_slots"].int()),
             "dst_slots must be torch.int64 like src_slots"),
    bad_call("move_kv", "dst_slots with fewer entries", _move_kw, lambda kw, d: dict(dst_slots=kw["dst_slots"][:1]), "dst_slots must have 2 entries"),
    bad_call("move_kv", "a layer with other slots", _move_kw, lambda kw, d: dict(kv_layers=kw["kv_layers"] + [torch.zeros(11, 8, dtype=torch.bfloat16, device=d)]),
             "kv_layers[2] must have 10 slots"),
    bad_call("move_kv", "a layer with other row bytes", _move_kw, lambda kw, d: dict(kv_layers=kw["kv_layers"] + [torch.zeros(10, 4, dtype=torch.bfloat16, device=d)]),
             "kv_layers[2] must have rows of 16 bytes"),
    bad_call("move_kv", "a layer with strided rows", _move_kw, lambda kw, d: dict(kv_layers=[torch.zeros(10, 8, 2, dtype=torch.bfloat16, device=d)[..., 0]]),
             "contiguous rows"),
    bad_call("move_kv", "a layer on another device", _move_kw, lambda kw, d: dict(kv_layers=[kw["kv_layers"][0].to(other_device(d))]),
             "kv_layers[0] must be"),
    bad_call("move_kv", "src_slots = S", _move_kw, lambda kw, d: dict(src_slots=_set(kw["src_slots"], 1, 10)),
             "src_slots/dst_slots must lie in [0, 10)", "the pair is skipped; the device guard is flagged"),
    bad_call("move_kv", "dst_slots repeated", _move_kw, lambda kw, d: dict(dst_slots=_set(kw["dst_slots"], 1, 3)),
             "dst_slots must be distinct", "one of the pairs' rows lands"),
    bad_call("move_kv", "disjoint=True with a slot both source and destination", _move_kw,
             lambda kw, d: dict(dst_slots=_set(kw["dst_slots"], 1, 1), disjoint=True), "disjoint=True needs", "undefined row contents"),
]
BAD_IDS = [f"{b.op}: {b.what}" for b in BAD_INPUTS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", BAD_INPUTS, ids=BAD_IDS)
def test_bad_input_raises(bad, device, monkeypatch):
    """Host checks raise everywhere; value checks on the CPU always, on CUDA with KDTREE_CHECK=1."""
    monkeypatch.delenv("KDTREE_CHECK", raising=False)
    if device == "cuda" and bad.unchecked is not None:
        monkeypatch.setenv("KDTREE_CHECK", "1")
    with pytest.raises(RuntimeError, match=re.escape(bad.error)):
        bad.call(device)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_attn_wrapper_leaves_argument_checks_to_the_op(device, monkeypatch):
    """An eager verify_attn call checks its arguments once, in the op (the CPU impl's Python
    checks, the CUDA impl's C++ ones), not again in the wrapper before it; a refused argument
    then gets the Python checks' message on every device (test_bad_input_raises: which)."""
    monkeypatch.delenv("KDTREE_CHECK", raising=False)
    calls = []
    checks = kdtree_ops._check_verify_args
    monkeypatch.setattr(kdtree_ops, "_check_verify_args", lambda *a, **kw: calls.append(1) or checks(*a, **kw))
    case = make_verify_case([40, 7], [3, 2], 2, device=device)
    kdtree_ops.verify_attn(*verify_args(case))
    assert len(calls) == (1 if device == "cpu" else 0)
    calls.clear()
    with pytest.raises(RuntimeError, match=re.escape("kdtree: lse must be float32")):
        kdtree_ops.verify_attn(*verify_args(case), lse=torch.empty(5, 2, device=device, dtype=torch.bfloat16))
    assert len(calls) == (2 if device == "cpu" else 1)


def bad_input_table() -> str:
    """README.md's table of bad inputs, from BAD_INPUTS."""
    rows = ["| op | bad input | error (CPU always; CUDA as the last column says) | CUDA without `KDTREE_CHECK=1` |", "|---|---|---|---|"]
    for b in BAD_INPUTS:
        cuda = "raises" if b.unchecked is None else f"{b.unchecked} (raises with `KDTREE_CHECK=1`)"
        rows.append(f"| `{b.op}` | {b.what} | `kdtree: {b.error}` | {cuda} |")
    return "\n".join(rows) + "\n"


def test_readme_lists_the_bad_inputs():
    readme = (Path(__file__).parent / "README.md").read_text()
    assert bad_input_table() in readme, "README.md's bad-input table is stale: paste bad_input_table()"


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


@pytest.fixture
def tiny_build(tmp_path, monkeypatch):
    """kdtree_ops.build over a one-kernel source folder: the cache logic at compile times of
    seconds."""
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        pytest.skip("needs nvcc")
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cu").write_text("__global__ void tiny_kernel(int* x) { *x = 1; }\n")
    monkeypatch.setattr(kdtree_ops, "SRC_DIR", src)
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    return lambda: kdtree_ops.build(arch=["9.0"])


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "record"])
def test_build_cache_heals_a_damaged_library(tiny_build, caplog, damage):
    """A library that does not match its BUILT record (size and sha256) is rebuilt, with one
    line saying why, never loaded."""
    lib = tiny_build()
    good = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        lib.write_bytes(bytes(len(good)))
    elif damage == "empty":
        lib.write_bytes(b"")
    else:
        (lib.parent / "BUILT").write_text("not json\n")
    assert kdtree_ops._built_problem(lib.parent) is not None
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        assert tiny_build() == lib
    assert kdtree_ops._built_problem(lib.parent) is None and lib.stat().st_size == len(good)
    assert "rebuilding the kernels" in caplog.text


def test_build_ignores_a_dead_builders_folder(tiny_build):
    """A killed builder leaves its private folder (and maybe running compilers) behind; the
    next builder compiles in its own folder and moves only its own library into place."""
    key_dir = tiny_build().parent
    for f in ("BUILT", kdtree_ops._LIB_NAME):
        (key_dir / f).unlink()
    dead = key_dir / "tmp-deadbuilder"
    dead.mkdir()
    (dead / kdtree_ops._LIB_NAME).write_bytes(b"half-written")
    (dead / "build.ninja").write_text("garbage")
    lib = tiny_build()
    assert kdtree_ops._built_problem(lib.parent) is None and (dead / "build.ninja").read_text() == "garbage"


def test_build_lock_wait_is_bounded(tiny_build, tmp_path, monkeypatch):
    """A stopped lock holder blocks nobody forever: the waiter says whom it waits for and gives
    up after KDTREE_BUILD_WAIT seconds with an error naming the holder."""
    key_dir = tiny_build().parent
    (key_dir / "BUILT").unlink()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "f.seek(0); f.truncate(); f.write(f'pid {os.getpid()} test holder'); f.flush()\n"
         "print('locked', flush=True); time.sleep(60)", str(key_dir / "lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setenv("KDTREE_BUILD_WAIT", "0.5")
        with pytest.raises(RuntimeError, match=f"pid {holder.pid} test holder.*KDTREE_BUILD_WAIT"):
            tiny_build()
    finally:
        holder.kill()
        holder.wait()
    assert kdtree_ops._built_problem(tiny_build().parent) is None  # the lock is free again


def test_env_settings_reject_bad_values(monkeypatch, caplog):
    """One parser for every KDTREE_* setting: bad values warn and keep the default."""
    cases = [("KDTREE_LOG_EVERY", "0", dict(minimum=1), 100), ("KDTREE_VALIDATE_TOL", "nan", dict(minimum=0.0, kind=float), 0.02),
             ("KDTREE_DEFRAG_BUDGET_MB", "-1", dict(minimum=0), 256), ("KDTREE_DEFRAG_EVERY", "x", dict(minimum=1), 16),
             ("KDTREE_LOG_EVERY", "7", dict(minimum=1), 7)]
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        for name, raw, kw, want in cases:
            monkeypatch.setenv(name, raw)
            default = 100 if name == "KDTREE_LOG_EVERY" else want
            assert kdtree_ops.env_number(name, default, **kw) == want, (name, raw)
        for raw, want in [("1", True), ("ON", True), ("yes", True), ("0", False), ("off", False), ("", False), ("maybe", False)]:
            monkeypatch.setenv("KDTREE_PROFILE", raw)
            assert kdtree_ops.env_flag("KDTREE_PROFILE") is want, raw
    assert caplog.text.count("using") == 5  # nan, 0, -1, x, maybe


def test_hook_reads_bad_settings_as_defaults(monkeypatch, caplog):
    """What the hook itself reads: a negative defrag budget, a NaN tolerance and zero periods
    each warn once and keep the default."""
    bad = {"KDTREE_DEFRAG_BUDGET_MB": "-1", "KDTREE_VALIDATE_TOL": "nan", "KDTREE_LOG_EVERY": "0", "KDTREE_DEFRAG_EVERY": "0"}
    monkeypatch.setattr(kdtree_ops, "_ENV_WARNED", set())  # each (name, value) warns once per process
    for name, raw in bad.items():
        monkeypatch.setenv(name, raw)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        state = sglang_hook._State("on")
    assert (state.defrag_budget, state.validator.tol, state.log_every, state.defrag_every) == (256 << 20, 0.02, 100, 16)
    for name, raw in bad.items():
        assert f"{name}={raw!r}" in caplog.text


# ---- merge_state ----

MERGE_SHAPES = [(1, 1, 8), (113, 3, 512), (239, 16, 64), (7, 5, 3), (33, 128, 512)]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def merge_inputs(T, H, D, dtype, device, empty_frac=0.1, seed=None):
    g = torch.Generator().manual_seed(torch.seed() % 2**31 if seed is None else seed)
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
    v, s = kdtree_ops._merge_state_math(v_a, s_a, v_b, s_b)  # the CPU op's math, here in float64
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_merge_state_non_finite(device, inplace):
    """NaN or +inf lse in either partial: that row is NaN (never a silently dropped partial);
    -inf is an empty partial whose values are never read; NaN values of a live partial
    propagate. Identical on CPU and CUDA."""
    v_a, s_a, v_b, s_b = merge_inputs(6, 1, 8, torch.float32, device, empty_frac=0.0)
    s_a[0, 0] = math.nan
    s_b[1, 0] = math.inf
    s_a[2, 0], v_a[2, 0] = -math.inf, math.nan
    v_b[3, 0, 0] = math.nan
    s_a[4, 0] = s_b[4, 0] = -math.inf
    v_a[4, 0] = v_b[4, 0] = math.nan
    want_vb2, want_sb2 = v_b[2, 0].clone(), s_b[2, 0].clone()
    if inplace:
        kdtree_ops.merge_state_(v_a, s_a, v_b, s_b)
        v, s = v_a, s_a
    else:
        v, s = kdtree_ops.merge_state(v_a, s_a, v_b, s_b)
    assert torch.isnan(v[:2]).all() and torch.isnan(s[:2]).all()
    assert torch.allclose(v[2, 0], want_vb2) and s[2, 0] == want_sb2
    assert torch.isnan(v[3, 0, 0]) and torch.isfinite(v[3, 0, 1:]).all() and torch.isfinite(s[3, 0])
    assert torch.all(v[4, 0] == 0) and s[4, 0] == -math.inf
    assert torch.isfinite(v[5]).all() and torch.isfinite(s[5]).all()


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


# ---- verify attention ----


def test_verify_attn_reference_matches_dense_attention():
    """The per-request reference equals one dense masked softmax over [prefix | tree] keys."""
    case = make_verify_case([7, 0, 12], [3, 4, 1], 2, dtype=torch.float64, device="cpu")
    out, lse = kdtree_ops.verify_attn_reference(*verify_args(case))
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
    out, lse = kdtree_ops.verify_attn_reference(*verify_args(case))
    assert lse[0, 0] == -math.inf and torch.all(out[0] == 0) and torch.isfinite(lse[1]).all()


FP8_STORAGES = [torch.uint8, torch.float8_e4m3fn]  # uint8: e4m3 bytes, as SGLang stores fp8 pools
FP8_IDS = ["uint8", "float8_e4m3fn"]
E4M3_CODES = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)  # all but NaN


def e4m3_values(pool: torch.Tensor) -> torch.Tensor:
    """float64 values of e4m3 (float8_e4m3fn) bytes, decoded by hand: bias 7, subnormals
    m * 2^-9, no infinities, NaN only at 0x7f / 0xff."""
    b = pool.view(torch.uint8).long()
    e, m = (b >> 3) & 15, (b & 7).double()
    magnitude = torch.where(e == 0, m * 2.0**-9, (8 + m) * torch.exp2(e.double() - 10))
    return torch.where((b & 127) == 127, math.nan, torch.where(b >= 128, -magnitude, magnitude))


def dequantized(pool: torch.Tensor, k_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows an fp8 pool stands for: e4m3 * k_scale, exact in float64, else rounded to
    float32 first (as the CPU reference computes them) and then to ``dtype``."""
    values = e4m3_values(pool) * k_scale.double()
    return values if dtype == torch.float64 else values.float().to(dtype)


def fp8_pool(case, storage, k_scale: float, *, source="float", seed=None):
    """``case`` with an e4m3 pool in ``storage`` and ``k_scale`` (a float32 [1] tensor in
    "k_scale", the float in "k_scale_float"): the case's rows / k_scale rounded to e4m3 (source
    "float", as SGLang stores k / k_scale) or random non-NaN bytes ("bytes"); unused slots
    hold NaN either way. Also returns the reference case: the same with the pool's exact
    values (float64), which the CUDA kernels compute with (see verify_attn: float16 math on
    the e4m3 values, k_scale in float32)."""
    kv = case["kv_cache"]
    rows = kv.reshape(kv.shape[0], kdtree_ops.MLA_QK_DIM)
    if source == "float":
        codes = testkit.e4m3_bytes(rows, k_scale)
    else:
        g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
        codes = E4M3_CODES[torch.randint(0, len(E4M3_CODES), rows.shape, generator=g)].to(kv.device)
        unused = torch.ones(rows.shape[0], dtype=torch.bool, device=kv.device)
        unused[case["kv_indices"].long()] = False
        codes[unused] = 0x7F
    pool = codes.view(storage).view(kv.shape)
    case = dict(case, kv_cache=pool, k_scale=torch.tensor([k_scale], device=kv.device), k_scale_float=k_scale)
    return case, dict(case, kv_cache=dequantized(pool, case["k_scale"], torch.float64))


# Pools the CUDA verify tests run over: (storage, source, k_scale) of fp8_pool, or q's own dtype.
POOLS = {
    "q_dtype": None,
    "float8_e4m3fn": (torch.float8_e4m3fn, "float", 0.37),
    "uint8": (torch.uint8, "float", 0.37),
    "uint8_random_bytes": (torch.uint8, "bytes", 1 / 90),
}


def with_pool(case, pool):
    """(case, verify_attn's k_scale keyword, the reference case) for one of POOLS."""
    if POOLS[pool] is None:
        return case, {}, case
    storage, source, k_scale = POOLS[pool]
    case, ref = fp8_pool(case, storage, k_scale, source=source)
    return case, {"k_scale": case["k_scale"]}, ref


@pytest.mark.parametrize("kv_3d", [False, True])
@pytest.mark.parametrize("source", ["float", "bytes"])
@pytest.mark.parametrize("storage", FP8_STORAGES, ids=FP8_IDS)
def test_verify_attn_reference_fp8_is_the_dequantized_pool(storage, source, kv_3d):
    """verify_attn on the CPU over an fp8 pool is the reference over a float32 pool of the
    hand-decoded e4m3 values times k_scale, bit for bit, whichever form k_scale takes (tree_k
    unscaled); with a power-of-two k_scale the dequantized rows are exact in bf16, and
    verify_attn over that bf16 pool gives the same bits."""
    case, _ = fp8_pool(make_verify_case([13, 0, 29], [3, 5, 1], 3, device="cpu", kv_3d=kv_3d), storage, 0.37, source=source)
    scale, args = case["k_scale"], verify_args(case)
    want = kdtree_ops.verify_attn_reference(*verify_args(dict(case, kv_cache=dequantized(case["kv_cache"], scale, torch.float32))))
    for k_scale in (0.37, scale, scale.reshape(())):
        out, lse = kdtree_ops.verify_attn(*args, k_scale=k_scale)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), k_scale
    four = torch.tensor([4.0])
    bf16 = dict(case, kv_cache=dequantized(case["kv_cache"], four, torch.bfloat16))
    for from_fp8, from_bf16 in zip(kdtree_ops.verify_attn(*args, k_scale=four), kdtree_ops.verify_attn(*verify_args(bf16))):
        assert torch.equal(from_fp8, from_bf16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["verify_attn", "verify_attn_out"])
@pytest.mark.parametrize("widen", ["", "1"], ids=["default", "widened"])
def test_verify_attn_opcheck_float8_e4m3fn_pool(name, device, widen, monkeypatch):
    """SAMPLES' fp8 samples (e4m3 bytes, every k_scale form) with a float8_e4m3fn pool instead,
    also with the widened route forced (KDTREE_VERIFY_FP8_WIDEN=1; it serves the Hopper kernel's
    requests). Without opcheck's test_schema: it compares inputs by allclose, which float8 lacks."""
    default_verify_kernels(monkeypatch)
    if widen:
        monkeypatch.setenv("KDTREE_VERIFY_FP8_WIDEN", widen)
    op = getattr(torch.ops.kdtree, name).default
    fp8 = [args for args, _ in SAMPLES[name].make(device, 0) if args[1].dtype == torch.uint8]
    assert len(fp8) == 4
    for args in fp8:
        args = (*args[:1], args[1].view(torch.float8_e4m3fn), *args[2:])
        torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


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
    ([45, 3, 200] * 100, [1] * 300, 13),  # 300 one-node requests: sm_90's staged 16-row CTA over fp8 pools
]

# The kernels verify_attn chooses from on an H100/H200 (sm_90), and their schedules (equal splits
# of each request, or the balanced one: BalancedWork); on any other GPU the first three settings
# run the portable kernel with the row tile the shape picks.
VERIFY_KERNEL_ENV = {
    # 64-row tiles keep the seesaw kernel on the small fp8 requests it would hand to the
    # portable kernel's 16-row CTA (test_verify_attn_cuda_sm90_kernel_choice); fp8 pools stay on
    # the kernel's own widening, also where the widened route is the default (fp8widen runs it).
    "seesaw": {"KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "0", "KDTREE_VERIFY_FP8_WIDEN": "0"},
    # the seesaw kernel on the balanced schedule (BalancedWork), even for one request
    "balanced": {"KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "1", "KDTREE_VERIFY_FP8_WIDEN": "0"},
    "wgmma": {"KDTREE_VERIFY_SEESAW": "0"},
    # over an fp8 pool the opt-in keys-as-M kernel (verify_attn_sm90_fp8.cu); else the seesaw one
    "fp8keys": {"KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "0", "KDTREE_VERIFY_FP8_KERNEL": "1"},
    "fp8keys_balanced": {"KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "1", "KDTREE_VERIFY_FP8_KERNEL": "1"},
    # over an fp8 pool the widened route wherever it can run (rows widened once into an f16
    # workspace, then the seesaw kernel); else the seesaw kernel
    "fp8widen": {"KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "0", "KDTREE_VERIFY_FP8_WIDEN": "1"},
    "fp8widen_balanced": {"KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "1", "KDTREE_VERIFY_FP8_WIDEN": "1"},
    "portable": {"KDTREE_VERIFY_WGMMA": "0", "KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "0"},
    "portable48": {"KDTREE_VERIFY_WGMMA": "0", "KDTREE_VERIFY_ROWS": "48", "KDTREE_VERIFY_BALANCE": "0"},
    "portable16": {"KDTREE_VERIFY_WGMMA": "0", "KDTREE_VERIFY_ROWS": "16", "KDTREE_VERIFY_BALANCE": "0"},
    "portable_balanced": {"KDTREE_VERIFY_WGMMA": "0", "KDTREE_VERIFY_ROWS": "64", "KDTREE_VERIFY_BALANCE": "1"},
    "portable48_balanced": {"KDTREE_VERIFY_WGMMA": "0", "KDTREE_VERIFY_ROWS": "48", "KDTREE_VERIFY_BALANCE": "1"},
    "portable16_balanced": {"KDTREE_VERIFY_WGMMA": "0", "KDTREE_VERIFY_ROWS": "16", "KDTREE_VERIFY_BALANCE": "1"},
}


def default_verify_kernels(monkeypatch):
    """Unsets every variable that steers verify_attn's choice of kernel, schedule and route."""
    for name in ("KDTREE_VERIFY_SEESAW", "KDTREE_VERIFY_WGMMA", "KDTREE_VERIFY_ROWS", "KDTREE_VERIFY_BALANCE",
                 "KDTREE_VERIFY_FP8_KERNEL", "KDTREE_VERIFY_FP8_WIDEN", "KDTREE_VERIFY_TMA"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=list(VERIFY_KERNEL_ENV))
def verify_kernel(request, monkeypatch):
    """Runs the test once per kernel (the choice is read at every call, so also at capture)."""
    default_verify_kernels(monkeypatch)
    for name, value in VERIFY_KERNEL_ENV[request.param].items():
        monkeypatch.setenv(name, value)
    return request.param


@needs_gpu
@pytest.mark.parametrize("prefix_lens,node_counts,heads", VERIFY_GRID)
@pytest.mark.parametrize("pool", list(POOLS))
def test_verify_attn_cuda_matches_float64(verify_kernel, prefix_lens, node_counts, heads, pool):
    case, kw, ref = with_pool(make_verify_case(prefix_lens, node_counts, heads), pool)
    out, lse = kdtree_ops.verify_attn(*verify_args(case), **kw)
    assert_verify_close(out, lse, ref)
    # the split count follows the hint, and k_scale may be a host float; the result must not change
    kw = {"k_scale": case["k_scale_float"]} if kw else {}
    out2, lse2 = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=max(prefix_lens), **kw)
    assert_verify_close(out2, lse2, ref)


@needs_gpu
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("causal", [False, True])
def test_verify_attn_cuda_dtypes_layouts(verify_kernel, dtype, index_dtype, causal, pool):
    case, kw, ref = with_pool(make_verify_case([513, 64], [16, 7], 8, dtype=dtype, index_dtype=index_dtype,
                                               causal=causal, kv_3d=index_dtype == torch.int64), pool)
    out, lse = kdtree_ops.verify_attn(*verify_args(case), **kw)
    assert_verify_close(out, lse, ref)


@needs_gpu
@pytest.mark.parametrize("storage", FP8_STORAGES, ids=FP8_IDS)
def test_verify_attn_cuda_fp8_tiny_and_large_rows(verify_kernel, storage):
    """k_scale != 1 over rows of 2^-9 to 2^8 (in e4m3 units; tiny rows are mostly e4m3
    subnormals): request 0 sees only tiny rows (and tiny tree latents), request 1 only large
    ones, request 2 both; every (node, head) row within bf16's tolerance on its own scale."""
    case = make_verify_case([600, 450, 900], [7, 3, 12], 4)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    kvp, slots, k_scale = case["kv_indptr"].tolist(), case["kv_indices"].long().cpu(), 0.0731
    log2 = torch.zeros(case["kv_cache"].shape[0])
    for (lo, hi), a, b in zip([(-9, -5), (3, 8), (-9, 8)], kvp, kvp[1:]):
        log2[slots[a:b]] = lo + (hi - lo) * torch.rand(b - a, generator=g)
    case["kv_cache"] = case["kv_cache"] * (torch.exp2(log2) * k_scale)[:, None].to(case["kv_cache"])
    case["tree_k"][:7] *= 2**-7 * k_scale
    case, ref = fp8_pool(case, storage, k_scale)
    used = case["kv_cache"].view(torch.uint8)[case["kv_indices"].long()]
    assert {*range(0x01, 0x08), *range(0x81, 0x88)} <= set(used.unique().tolist())
    out, lse = kdtree_ops.verify_attn(*verify_args(case), k_scale=case["k_scale"])
    assert_verify_close(out, lse, ref)
    rows_close(out.flatten(1), verify_reference(ref)[0].flatten(1), 4, ROW_TOL["cuda"])


@needs_gpu
@pytest.mark.parametrize("storage", FP8_STORAGES, ids=FP8_IDS)
@pytest.mark.parametrize("shape,pool", [
    (([1500, 0, 77], [9, 5, 17], 16), 4000),
    (([45, 3, 200] * 100, [1] * 300, 13), 60000),  # 300 one-node requests: sm_90's staged 16-row CTA
])
def test_verify_attn_cuda_fp8_graph_replay(verify_kernel, storage, shape, pool):
    """Captured once over an fp8 pool with a k_scale tensor; every replay gets other rows,
    slots and trees, and another k_scale value, which the kernel reads on the device."""
    sm_scale, scales = 1.0 / math.sqrt(192), iter([0.37, 1.9, 0.013])

    def fresh():
        case, _ = fp8_pool(make_verify_case(*shape, pool=pool), storage, next(scales))
        return [case[k] for k in VERIFY_ARGS[:-1]] + [case["k_scale"]]

    def check(inputs, out):
        case = dict(zip(VERIFY_ARGS, [*inputs[:-1], sm_scale]))
        assert_verify_close(out[0], out[1], dict(case, kv_cache=dequantized(inputs[1], inputs[-1], torch.float64)))

    graph_replay(lambda *a: kdtree_ops.verify_attn(*a[:-1], sm_scale, max_kv_len=2048, k_scale=a[-1]), fresh, check)


@needs_gpu
@pytest.mark.parametrize("storage", FP8_STORAGES, ids=FP8_IDS)
def test_verify_attn_cuda_fp8_compiles(verify_kernel, storage):
    """torch.compile(fullgraph=True) over an fp8 pool, k_scale a tensor and a host float."""
    case, ref = fp8_pool(make_verify_case([700, 33], [9, 17], 8), storage, 0.37)
    for k_scale in (case["k_scale"], case["k_scale_float"]):
        compiled = torch.compile(lambda *a: kdtree_ops.verify_attn(*a[:-1], max_kv_len=700, k_scale=a[-1]), fullgraph=True)
        out, lse = compiled(*verify_args(case), k_scale)
        assert_verify_close(out, lse, ref)
        torch._dynamo.reset()


@needs_gpu
def test_verify_attn_cuda_fp8_rows_must_be_aligned():
    """CUDA reads fp8 rows 16 bytes at a time: a pool whose rows are not 16-byte aligned is
    refused (the CPU reference needs no alignment)."""
    case, _ = fp8_pool(make_verify_case([30], [5], 2), torch.uint8, 0.37)
    wide = torch.zeros(case["kv_cache"].shape[0], 576 + 8, dtype=torch.uint8, device="cuda")
    wide[:, 8:] = case["kv_cache"]
    with pytest.raises(RuntimeError, match="kv_cache rows must be 16-byte aligned"):
        kdtree_ops.verify_attn(*verify_args(dict(case, kv_cache=wide[:, 8:])), k_scale=case["k_scale"])


@needs_gpu
@pytest.mark.parametrize("sm_scale", [-0.07, 0.0])
def test_verify_attn_cuda_nonpositive_scale(verify_kernel, sm_scale):
    """Scales the seesaw kernel does not take run on another kernel, with the same result."""
    case = dict(make_verify_case([700, 30], [9, 17], 8), sm_scale=sm_scale)
    out, lse = kdtree_ops.verify_attn(*verify_args(case))
    assert_verify_close(out, lse, case)


@needs_gpu
@pytest.mark.parametrize("pool", ["q_dtype", "uint8"])
@pytest.mark.parametrize("heads,node_counts,want", [
    (16, [9], "48"),  # 144 rows: 64-row tiles cover 192
    (16, [9] * 3, "48"),
    (16, [3] * 2, "48"),  # 48 rows
    (16, [8], "64"),  # 128 rows: 64-row tiles pad nothing
    (128, [1] * 2, "64"),
    (16, [257], "64"),  # 4112 rows: 64-row tiles cover 4160, 48-row ones 4128
    (10, [10], "64"),  # 100 rows: 48-row tiles would pad more (144)
    (16, [9, 9, 8], "64"),  # T not a multiple of the batch: request sizes unknown to the host
    (16, [1] * 5, "16"),  # 16 rows
    (8, [2] * 3, "16"),
    (5, [3], "16"),  # 15 rows
    (17, [1] * 2, "48"),  # 17 rows: 64-row tiles cover 64, 48-row ones 48
    (16, [1, 1, 2], "64"),  # unequal trees
])
def test_verify_attn_cuda_portable_row_tile_choice(heads, node_counts, want, pool, monkeypatch):
    """Unforced, the portable kernel serves a shape exactly as the row tile the rule picks:
    16-row tiles for requests of at most 16 rows, else 48-row tiles where 64-row ones pad a
    fifth or more and 48-row ones pad less; 64-row tiles run the ping-pong CTA over both
    pools. Which CTA ran is read off the launched kernel's name (16- and 48-row CTAs compute
    a row in the same order, so outputs alone cannot tell them apart)."""
    case, kw, ref = with_pool(make_verify_case([1000] * len(node_counts), node_counts, heads), pool)
    for name in ("KDTREE_VERIFY_BALANCE", "KDTREE_VERIFY_SEESAW"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KDTREE_VERIFY_WGMMA", "0")
    cta = {"16": "16", "48": "48", "64": "64 ping-pong"}
    served, ctas = {}, {}
    for rows in ("", "16", "48", "64"):
        monkeypatch.setenv("KDTREE_VERIFY_ROWS", rows)
        served[rows], kernels = verify_attn_served(case, max_kv_len=1000, **kw)
        # whether a 16-row CTA stages an fp8 pool's bytes depends on the GPU's SM count
        # (test_verify_attn_cuda_sm90_kernel_choice pins it on sm_90)
        ctas[rows] = {k.removesuffix(" staged") for k in kernels}
    assert ctas[""] == {cta[want]} and all(ctas[r] == {cta[r]} for r in ("16", "48", "64")), ctas
    assert all(torch.equal(a, b) for a, b in zip(served[""], served[want]))
    assert_verify_close(*served[""], ref)


def launched_kernels(fn):
    """fn()'s result and the names of the CUDA kernels it launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, [e.name for e in prof.events()]


def verify_attn_served(case, **kw):
    """verify_attn's (out, lse) on the case and which verify kernels served it: "seesaw", "fp8"
    (the Hopper kernel that keeps an fp8 pool's rows as e4m3), or the portable CTA's rows ("16
    staged": the 16-row CTA that stages an fp8 pool's next tile as bytes; "64 ping-pong": the
    64-row CTA whose halves run half a tile apart)."""
    result, names = launched_kernels(lambda: kdtree_ops.verify_attn(*verify_args(case), **kw))
    served = {rows + (" staged" if staged == "true" else "") + (" ping-pong" if ping == "true" else "")
              for n in names for rows, staged, ping in re.findall(r"Cta<(\d+), \d+, \d+, (true|false), (true|false)>", n)}
    served |= {"seesaw" for n in names if "seesaw" in n}
    served |= {"fp8" for n in names if "verify_attn_fp8_kernel" in n}
    return result, served


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Hopper kernels serve sm_90 only")
@pytest.mark.parametrize("heads,node_counts,pool,rows,want", [
    (16, [1] * 3, "uint8", "", "16"),  # 16 rows over an fp8 pool: the portable 16-row CTA
    (8, [2] * 2, "float8_e4m3fn", "", "16"),
    (5, [3], "uint8", "", "16"),
    # more row tiles than two 16-row CTAs per SM hold: the 16-row CTA that stages bytes (three per SM)
    (13, [1] * 300, "uint8", "", "16 staged"),
    (4, [3] * 300, "float8_e4m3fn", "", "16 staged"),
    (16, [1] * 3, "q_dtype", "", "seesaw"),  # a bf16 pool stays on the seesaw kernel
    (17, [1] * 2, "uint8", "", "seesaw"),  # 17 rows
    (16, [1, 1, 2], "uint8", "", "seesaw"),  # unequal trees: request sizes unknown to the host
    (16, [1] * 3, "uint8", "64", "seesaw"),  # forced 64-row tiles keep the Hopper kernel
    (16, [1] * 3, "uint8", "48", "seesaw"),
])
def test_verify_attn_cuda_sm90_kernel_choice(heads, node_counts, pool, rows, want, monkeypatch):
    """Unforced on an H100/H200, the seesaw kernel serves every request but those of at most
    16 rows over an fp8 pool, which the portable kernel's 16-row CTA serves; the variant that
    stages the next tile's bytes (three fit an SM where two of the other do) where the grid
    has more CTAs than two per SM."""
    for name in ("KDTREE_VERIFY_SEESAW", "KDTREE_VERIFY_WGMMA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KDTREE_VERIFY_ROWS", rows)
    case, kw, ref = with_pool(make_verify_case([1000] * len(node_counts), node_counts, heads), pool)
    (out, lse), served = verify_attn_served(case, max_kv_len=1000, **kw)
    assert served == {want}
    assert_verify_close(out, lse, ref)


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Hopper kernels serve sm_90 only")
@pytest.mark.parametrize("heads,node_counts,pool,balance,want", [
    (17, [1] * 2, "uint8", "", "fp8"),  # 17 rows over an fp8 pool: the keys-as-M kernel
    (16, [9], "float8_e4m3fn", "", "fp8"),
    (16, [1, 3, 2], "uint8", "1", "fp8"),  # unequal trees on the balanced schedule
    (16, [1] * 3, "uint8", "", "16"),  # requests of at most 16 rows stay on the portable 16-row CTA
    (16, [9], "q_dtype", "", "seesaw"),  # a bf16 pool: the seesaw kernel
])
def test_verify_attn_cuda_fp8_kernel_opt_in(heads, node_counts, pool, balance, want, monkeypatch):
    """KDTREE_VERIFY_FP8_KERNEL=1 puts fp8 pools on the keys-as-M kernel (48-row CTAs) wherever
    the seesaw kernel would serve them, and changes nothing else."""
    for name in ("KDTREE_VERIFY_SEESAW", "KDTREE_VERIFY_WGMMA", "KDTREE_VERIFY_ROWS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KDTREE_VERIFY_FP8_KERNEL", "1")
    monkeypatch.setenv("KDTREE_VERIFY_BALANCE", balance)
    case, kw, ref = with_pool(make_verify_case([700, 1500, 90][:len(node_counts)], node_counts, heads), pool)
    (out, lse), served = verify_attn_served(case, max_kv_len=1500, **kw)
    assert served == {want}
    assert_verify_close(out, lse, ref)


INDPTR_DTYPES = list(itertools.product([torch.int32, torch.int64], repeat=2))  # (kv_indptr, qo_indptr)


def with_indptr_dtypes(case, kv_dtype, qo_dtype):
    return dict(case, kv_indptr=case["kv_indptr"].to(kv_dtype), qo_indptr=case["qo_indptr"].to(qo_dtype))


def test_verify_attn_reference_int64_indptr():
    """The CPU reference reads int64 indptrs (either or both) as it reads int32 ones."""
    case = make_verify_case([7, 0, 12], [3, 4, 1], 2, device="cpu")
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
@pytest.mark.parametrize("pool", ["q_dtype", "uint8"])
def test_verify_attn_cuda_long_context_and_big_pool(pool):
    """256k-token prefix with slots spread over a pool past 4 GB (64-bit offsets), of bf16
    rows or of e4m3 bytes (then checked on the used rows alone: dequantizing 5 GiB of bytes
    in float64 would not fit)."""
    fp8 = pool == "uint8"
    S = (5 << 30) // (576 if fp8 else 1152)  # 5 GiB of latent rows
    case = make_verify_case([262144], [9], 16, pool=S)
    case["kv_indices"][-100:] = torch.arange(S - 100, S, device="cuda", dtype=torch.int32)
    case["kv_cache"][S - 100 :] = torch.randn(100, 576, device="cuda", dtype=torch.bfloat16)
    kw, ref = {}, case
    if fp8:
        slots = case["kv_indices"].long()
        rows = case.pop("kv_cache")[slots]
        pool8 = torch.full((S, 576), 0x7F, dtype=torch.uint8, device="cuda")
        pool8[slots] = testkit.e4m3_bytes(rows, 0.37)
        scale = torch.tensor([0.37], device="cuda")
        kw, case = {"k_scale": scale}, dict(case, kv_cache=pool8)
        ref = dict(case, kv_cache=dequantized(pool8[slots], scale, torch.float64),
                   kv_indices=torch.arange(len(slots), device="cuda", dtype=torch.int32))
    out, lse = kdtree_ops.verify_attn(*verify_args(case), **kw)
    assert_verify_close(out, lse, ref)
    del case, ref
    torch.cuda.empty_cache()


@needs_gpu
@pytest.mark.parametrize("pool", ["q_dtype", "uint8"])
@pytest.mark.parametrize("heads,nodes", [(16, 1), (8, 8)])  # one 16-row tile; one 64-row tile
def test_verify_attn_cuda_one_row_tile_many_splits(verify_kernel, pool, heads, nodes):
    """A single request of one row tile over a long prefix is cut into as many splits as the
    GPU has CTA slots (132-264 on an H200, past the 64 of old), then merged exactly."""
    case, kw, ref = with_pool(make_verify_case([70001], [nodes], heads), pool)
    (out, lse), names = launched_kernels(lambda: kdtree_ops.verify_attn(*verify_args(case), max_kv_len=70001, **kw))
    assert any("merge_splits" in n for n in names), names
    assert_verify_close(out, lse, ref)


SLOT_LAYOUTS = ["pages", "pages_one_swap", "full_pool", "runs"]


@needs_gpu
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pool", ["q_dtype", "uint8"])
def test_verify_attn_cuda_slot_layouts(verify_kernel, layout, dtype, index_dtype, pool):
    """Prefixes in consecutive slots (whole pages, a page with one pair swapped, pages up to the
    pool's last row, runs of random length that tiles straddle), which the seesaw kernel loads
    in tensor-map boxes where a 64-key tile's slots run consecutively; one-row-tile splits and
    tree tiles among them; 16-bit and fp8 pools."""
    case, kw, ref = with_pool(make_verify_case([4000, 64, 129, 1, 700], [9, 4, 1, 16, 3], 16, dtype=dtype,
                                               index_dtype=index_dtype, slots=layout), pool)
    out, lse = kdtree_ops.verify_attn(*verify_args(case), **kw)
    assert_verify_close(out, lse, ref)
    out2, lse2 = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=4000, **kw)
    assert_verify_close(out2, lse2, ref)


@needs_gpu
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
@pytest.mark.parametrize("pool", ["q_dtype", "uint8"])
def test_verify_attn_cuda_boxes_change_no_bits(layout, pool, monkeypatch):
    """Boxed and per-slot loads put the same values in the same place: the outputs are equal
    bit for bit with the boxes on and off (KDTREE_VERIFY_TMA=0), over 16-bit and fp8 pools."""
    for name in ("KDTREE_VERIFY_SEESAW", "KDTREE_VERIFY_WGMMA", "KDTREE_VERIFY_ROWS", "KDTREE_VERIFY_TMA"):
        monkeypatch.delenv(name, raising=False)
    case, kw, ref = with_pool(make_verify_case([12000, 300, 64], [9, 1, 5], 16, slots=layout), pool)
    out, lse = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=12000, **kw)
    monkeypatch.setenv("KDTREE_VERIFY_TMA", "0")
    out0, lse0 = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=12000, **kw)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    assert_verify_close(out, lse, ref)


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Hopper kernels serve sm_90 only")
@pytest.mark.parametrize("pool,tma,prefix,hint,want", [
    ("q_dtype", "", 3000, None, "0, true"),  # a 16-bit pool: the instance with the boxed producer
    ("q_dtype", "", 12000, 12000, "0, true"),  # 3 row tiles x 44 splits of 273 keys: 2+ tile pairs a CTA
    ("q_dtype", "", 4096, 4096, "0, false"),  # the hint caps splits at 32 of 128 keys: one pair, no boxes
    ("q_dtype", "0", 3000, None, "0, false"),  # KDTREE_VERIFY_TMA=0: per-slot copies only
    ("uint8", "", 3000, None, "1, true"),  # an fp8 pool: boxes of e4m3 bytes
    ("uint8", "0", 3000, None, "1, false"),
])
def test_verify_attn_cuda_sm90_boxable_instance(pool, tma, prefix, hint, want, monkeypatch):
    """Which seesaw instance serves a call, read off the kernel's template arguments (Pool: 0 a
    16-bit pool, 1 an fp8 one; Boxable; Balanced false, one request): boxes only where the hint
    gives each CTA at least two 64-key tile pairs."""
    default_verify_kernels(monkeypatch)
    if tma:
        monkeypatch.setenv("KDTREE_VERIFY_TMA", tma)
    case, kw, ref = with_pool(make_verify_case([prefix], [9], 16, slots="pages"), pool)
    if hint:
        kw["max_kv_len"] = hint
    (out, lse), names = launched_kernels(lambda: kdtree_ops.verify_attn(*verify_args(case), **kw))
    assert [n for n in names if "seesaw_kernel<" in n and re.search(rf"Pool\W*{want}, false>", n)], names
    assert_verify_close(out, lse, ref)


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Hopper kernels serve sm_90 only")
@pytest.mark.parametrize("balance", ["0", "1"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("storage", FP8_STORAGES, ids=FP8_IDS)
def test_verify_attn_cuda_fp8_widened_same_bits(balance, index_dtype, causal, storage, monkeypatch):
    """The widened route (KDTREE_VERIFY_FP8_WIDEN=1) widens an fp8 pool's rows once into an f16
    workspace (the widening kernel serves the call, then the seesaw instance for a widened pool:
    Pool 2), and the kernel then computes from the same f16 values what its fp8 path
    (KDTREE_VERIFY_FP8_WIDEN=0) computes from the rows it widens itself: the same bits, at odd
    lengths over both schedules."""
    default_verify_kernels(monkeypatch)
    monkeypatch.setenv("KDTREE_VERIFY_FP8_WIDEN", "0")
    monkeypatch.setenv("KDTREE_VERIFY_ROWS", "64")
    monkeypatch.setenv("KDTREE_VERIFY_BALANCE", balance)
    case, ref = fp8_pool(make_verify_case([1500, 0, 77, 2049], [9, 5, 17, 3], 16, index_dtype=index_dtype,
                                          causal=causal, slots="pages"), storage, 0.37)
    call = lambda: kdtree_ops.verify_attn(*verify_args(case), k_scale=case["k_scale"])  # noqa: E731
    (out, lse), names = launched_kernels(call)
    assert not [n for n in names if "widen_fp8_pool_kernel" in n], names
    monkeypatch.setenv("KDTREE_VERIFY_FP8_WIDEN", "1")
    (out_w, lse_w), names = launched_kernels(call)
    assert [n for n in names if "widen_fp8_pool_kernel" in n], names
    assert [n for n in names if "seesaw_kernel<" in n and re.search(r"Pool\W*2, ", n)], names
    assert torch.equal(out, out_w) and torch.equal(lse, lse_w)
    assert_verify_close(out_w, lse_w, ref)


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Hopper kernels serve sm_90 only")
@pytest.mark.parametrize("heads,node_counts,pool,want", [
    (16, [33], "uint8", True),  # 528 rows: 9 row tiles a request
    (16, [33, 33, 33], "float8_e4m3fn", True),
    (128, [1], "uint8", False),  # 2 row tiles a request
    (16, [32], "uint8", False),  # 512 rows: 8
    (16, [9, 57], "uint8", True),  # T a multiple of B: the host counts 33 nodes a request
    (16, [9, 56], "uint8", False),  # otherwise all rows: 65 x 16 in 17 tiles, under 9 a request
    (16, [33], "q_dtype", False),  # a 16-bit pool has nothing to widen
])
def test_verify_attn_cuda_fp8_widened_by_default(heads, node_counts, pool, want, monkeypatch):
    """Without KDTREE_VERIFY_FP8_WIDEN an fp8 pool takes the widened route from 9 row tiles a
    request on: read off the kernels that served the call."""
    default_verify_kernels(monkeypatch)
    case, kw, ref = with_pool(make_verify_case([3000] * len(node_counts), node_counts, heads), pool)
    (out, lse), names = launched_kernels(lambda: kdtree_ops.verify_attn(*verify_args(case), **kw))
    assert bool([n for n in names if "widen_fp8_pool_kernel" in n]) == want, names
    assert_verify_close(out, lse, ref)


@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability() != (9, 0), reason="the Hopper kernels serve sm_90 only")
def test_verify_guard_fp8_widened_slot_out_of_range(monkeypatch):
    """A prefix slot outside an fp8 pool, met by the widening (KDTREE_VERIFY_FP8_WIDEN=1): its
    request's rows come out NaN, the others as without the route, and the slot guard raised."""
    default_verify_kernels(monkeypatch)
    monkeypatch.setenv("KDTREE_VERIFY_ROWS", "64")
    monkeypatch.setenv("KDTREE_VERIFY_FP8_WIDEN", "1")
    case, _ = fp8_pool(make_verify_case([1500, 700, 2100], [9, 5, 13], 16), torch.uint8, 0.37)
    good = case["kv_indices"].clone()
    case["kv_indices"][1500 + 333] = case["kv_cache"].shape[0]
    kdtree_ops.guard_errors()
    (out, lse), names = launched_kernels(lambda: kdtree_ops.verify_attn(*verify_args(case), k_scale=case["k_scale"]))
    assert [n for n in names if "widen_fp8_pool_kernel" in n], names
    poisoned_requests(out, lse, case["qo_indptr"], {1})
    assert kdtree_ops.guard_errors() == [GUARD_SLOT]
    case["kv_indices"] = good
    monkeypatch.setenv("KDTREE_VERIFY_FP8_WIDEN", "0")
    out0, lse0 = kdtree_ops.verify_attn(*verify_args(case), k_scale=case["k_scale"])
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[9:14] = False
    assert torch.equal(out[keep], out0[keep]) and torch.equal(lse[keep], lse0[keep])


@needs_gpu
@pytest.mark.parametrize("kernel", ["seesaw", "portable"])
@pytest.mark.parametrize("prefix_lens,node_counts,heads,balance,want", [
    ([5000] * 8, [9] * 8, 16, "", True),  # 24 row tiles never split evenly over 132 SMs
    ([70001, 300, 5, 12000, 0], [9, 1, 33, 9, 2], 16, "", True),  # unequal requests: shares meet several row tiles
    ([3] * 40, [1] * 40, 16, "", True),  # fewer 128-key chunks (40) than CTAs: empty shares
    ([3000, 700], [1, 17], 16, "1", True),  # more row tiles than T / B nodes give: the last plane takes them
    ([800] * 66, [1] * 66, 128, "", False),  # 132 row tiles of equal requests fill the SMs: equal splits
    ([70001], [9], 16, "", False),  # one request: its equal splits are balanced already
    ([5000] * 8, [9] * 8, 16, "0", False),
    ([70001], [9], 16, "1", True),
])
def test_verify_attn_cuda_balanced_schedule(kernel, prefix_lens, node_counts, heads, balance, want, monkeypatch):
    """Which schedule serves a call (KDTREE_VERIFY_BALANCE), read off the Balanced argument of
    the attention kernel and of the merge, and that either gives the reference's output; on the
    seesaw kernel (sm_90) and the portable one."""
    if kernel == "seesaw" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the seesaw kernel serves sm_90 only")
    for name in ("KDTREE_VERIFY_SEESAW", "KDTREE_VERIFY_WGMMA", "KDTREE_VERIFY_ROWS", "KDTREE_VERIFY_BALANCE"):
        monkeypatch.delenv(name, raising=False)
    if kernel == "portable":
        monkeypatch.setenv("KDTREE_VERIFY_WGMMA", "0")
    if balance:
        monkeypatch.setenv("KDTREE_VERIFY_BALANCE", balance)
    case = make_verify_case(prefix_lens, node_counts, heads, slots="pages")
    (out, lse), names = launched_kernels(lambda: kdtree_ops.verify_attn(*verify_args(case)))
    merges = {n.split("merge_splits_kernel<")[1].split(">")[0].split(", ")[1] for n in names if "merge_splits_kernel<" in n}
    assert merges <= {"true", "false"} and ("true" in merges) == want, names
    # the last template argument (Cta<...> nests one level)
    attention = {m for n in names for m in re.findall(r"verify_attn(?:_seesaw)?_kernel<(?:[^<>]|<[^<>]*>)*, (true|false)>", n)}
    assert attention == {"true" if want else "false"}, names
    assert_verify_close(out, lse, case)


@needs_gpu
@pytest.mark.parametrize("kernel", ["seesaw", "portable"])
def test_verify_attn_cuda_balanced_whole_units_write_the_output(kernel, monkeypatch):
    """Balanced, with more row tiles a request (130) than SMs allow two CTAs a plane: each
    plane's CTA takes its units whole and writes the output, and no merge is launched."""
    if kernel == "seesaw" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the seesaw kernel serves sm_90 only")
    if torch.cuda.get_device_properties(0).multi_processor_count >= 260:
        pytest.skip("two CTAs a plane fit this GPU")
    for name in ("KDTREE_VERIFY_SEESAW", "KDTREE_VERIFY_WGMMA"):
        monkeypatch.delenv(name, raising=False)
    if kernel == "portable":
        monkeypatch.setenv("KDTREE_VERIFY_WGMMA", "0")
    monkeypatch.setenv("KDTREE_VERIFY_BALANCE", "1")
    monkeypatch.setenv("KDTREE_VERIFY_ROWS", "64")
    case = make_verify_case([700, 131], [65, 65], 128, slots="pages")
    (out, lse), names = launched_kernels(lambda: kdtree_ops.verify_attn(*verify_args(case)))
    assert not [n for n in names if "merge_splits_kernel<" in n], names
    attention = {m for n in names for m in re.findall(r"verify_attn(?:_seesaw)?_kernel<(?:[^<>]|<[^<>]*>)*, (true|false)>", n)}
    assert attention == {"true"}, names
    assert_verify_close(out, lse, case)


@needs_gpu
def test_verify_attn_cuda_graph_replay_moves_lengths(verify_kernel):
    """A captured batch replayed with its prefix lengths redistributed (same total, same trees):
    the balanced schedule finds its segments on the device at every replay."""
    nodes, heads, total = [9, 4, 9, 1], 16, 9000

    def fresh():
        cuts = sorted((torch.randperm(total - 1)[: len(nodes) - 1] + 1).tolist())
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
        c = make_verify_case(lens, nodes, heads, pool=12000, slots="pages")
        return [c[k] for k in VERIFY_ARGS[:-1]]

    def check(inputs, out):
        case = dict(zip(VERIFY_ARGS, [*inputs, 1.0 / math.sqrt(192)]))
        assert_verify_close(out[0], out[1], case)

    graph_replay(lambda *a: kdtree_ops.verify_attn(*a, 1.0 / math.sqrt(192)), fresh, check)


@needs_gpu
@pytest.mark.parametrize("layout", ["pages", "runs"])
@pytest.mark.parametrize("fp8", [False, True], ids=["q_dtype", "uint8"])
def test_verify_attn_cuda_slot_layouts_graph_replay(verify_kernel, layout, fp8):
    """A captured call replayed over new slots of another layout draw: the boxes follow the
    slots on the device, not the ones seen at capture; over an fp8 pool k_scale (a tensor)
    changes at every replay too."""
    shape, sm_scale, scales = ([3000, 77, 640], [9, 2, 16], 16), 1.0 / math.sqrt(192), iter([0.37, 1.9, 0.013])
    n_args = len(VERIFY_ARGS) - 1

    def fresh():
        c = make_verify_case(*shape, pool=20000, slots=layout)
        if fp8:
            c, _ = fp8_pool(c, torch.uint8, next(scales))
        return [c[k] for k in VERIFY_ARGS[:-1]] + ([c["k_scale"]] if fp8 else [])

    def check(inputs, out):
        case = dict(zip(VERIFY_ARGS, [*inputs[:n_args], sm_scale]))
        if fp8:
            case["kv_cache"] = dequantized(inputs[1], inputs[-1], torch.float64)
        assert_verify_close(out[0], out[1], case)

    def call(*a):
        return kdtree_ops.verify_attn(*a[:n_args], sm_scale, max_kv_len=3000, **({"k_scale": a[-1]} if fp8 else {}))

    graph_replay(call, fresh, check)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("widths", ["64/32/32", "32/64/32", "64/64/64"])  # mask_indptr/qo_indptr/kv_indptr bits
def test_sglang_mask_to_packed(device, widths):
    """Any mix of int32 and int64 indptrs, as SGLang hands them (its CUDA-graph buffers: int64
    qo_indptr and mask_indptr beside an int32 kv_indptr)."""
    case = make_verify_case([5, 0, 70], [9, 33, 1], 1, device="cpu")
    flat, indptr = sglang_flat_mask(case)
    dt = [torch.int64 if w == "64" else torch.int32 for w in widths.split("/")]
    args = [flat.to(device), indptr.to(device, dt[0]), case["qo_indptr"].to(device, dt[1]),
            case["kv_indptr"].to(device, dt[2])]
    exact = kdtree_ops.pack_bits(case["visible"], 2)  # the case's own mask has garbage past each request's nodes
    packed = kdtree_ops.sglang_mask_to_packed(*args, num_rows=43, max_nodes=33)
    assert torch.equal(packed.cpu(), exact)
    assert torch.equal(kdtree_ops.sglang_mask_to_packed(*args).cpu(), exact)
    assert torch.equal(kdtree_ops.sglang_mask_to_packed(args[0].to(torch.uint8), *args[1:]).cpu(), exact)
    torch.library.opcheck(torch.ops.kdtree.sglang_mask_to_packed.default, [*args, 43, 33])


@pytest.mark.parametrize("device", DEVICES)
def test_pack_tree_mask(device):
    mask = torch.rand(13, 70) < 0.5
    packed = kdtree_ops.pack_tree_mask(mask.to(device)).cpu()
    assert packed.shape == (13, 3) and packed.dtype == torch.int32
    assert torch.equal(kdtree_ops.unpack_bits(packed, 70), mask)


# ---- tree ops ----


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
        bits = torch.tensor([[(r >> j) & 1 for j in range(32 * W)] for r in rows], dtype=torch.bool)
        assert torch.equal(kdtree_ops.unpack_bits(tree.mask[b].cpu(), 32 * W), bits)


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


def heap_tree(args, budget):
    """The reference heap build without the contract's value checks: "wild" (unsorted) log-probs
    are outside the contract, yet the CUDA build must replay the heap on them exactly."""
    return kdtree_ops.Tree(*kdtree_ops._build_tree_reference(*[a.cpu() for a in args], budget))


@needs_gpu
def test_build_tree_cuda_matches_reference():
    trees = 0
    for i, (B, L, K, budget, kind, tok_dtype) in enumerate(random_tree_configs(160, seed=1234)):
        args = tree_inputs(B, L, K, kind, device="cuda", tok_dtype=tok_dtype, seed=i)
        got = kdtree_ops.build_tree(*args, budget)
        want = heap_tree(args, budget)
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
    want = heap_tree(args, budget)
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


# ---- kv movement ----


# (row shape, dtype): MLA latent rows, fp8-as-bytes, odd row sizes for every vector width
MOVE_LAYOUTS = [
    ((576,), torch.bfloat16),
    ((1, 576), torch.bfloat16),
    ((576,), torch.uint8),
    ((1, 576), torch.float8_e4m3fn),  # an fp8 pool's rows as SGLang's get_key_buffer views them
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
def test_move_kv_same_buffer_twice(device):
    """A buffer listed twice is moved once (all reads still before any write); buffers that
    share memory otherwise are refused by name."""
    kv = torch.arange(8, dtype=torch.float32, device=device)[:, None].repeat(1, 4)
    want = kv.clone()
    src = torch.tensor([1, 2], device=device)
    dst = torch.tensor([2, 1], device=device)  # a swap: moving twice would undo it
    kdtree_ops.move_kv([kv, kv], src, dst)
    want[[2, 1]] = want[[1, 2]]
    assert torch.equal(kv, want)
    base = torch.randn(40, device=device)
    with pytest.raises(RuntimeError, match=r"kv_layers\[1\] shares memory with kv_layers\[0\]"):
        kdtree_ops.move_kv([base[:32].view(8, 4), base[2:34].view(8, 4)], src, dst)


@pytest.mark.parametrize("device", DEVICES)
def test_move_kv_check_mode_skips_padding(device, monkeypatch):
    """Padding pairs never count: not as out of range, not as a repeated destination (the
    errors themselves are BAD_INPUTS rows)."""
    monkeypatch.setenv("KDTREE_CHECK", "1")
    kv = kv_pool(10, (8,), torch.bfloat16, 2, device)
    want = move_kv_naive(kv, torch.tensor([1, -1, 5]), torch.tensor([-1, 3, 3]))
    kdtree_ops.move_kv(kv, torch.tensor([1, -1, 5], device=device), torch.tensor([-1, 3, 3], device=device))
    assert all(same_bytes(a, b) for a, b in zip(kv, want))


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


def accept_pool(kind, S, device, g):
    """Per-layer KV buffers of S slots: plain bf16 tensors, or SGLang's fp8 MLA pool as its
    kv_buffer (uint8, what defrag and the hook move) or as get_key_buffer's e4m3 views."""
    if kind == "bf16":
        return kv_pool(S, (1, 24), torch.bfloat16, 3, device, g)
    mp = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    pool = mp.MLATokenToKVPool(size=S - 1, page_size=1, dtype=torch.float8_e4m3fn, kv_lora_rank=16, qk_rope_head_dim=8,
                               layer_num=3, device=device, enable_memory_saver=False)
    for buf in pool.kv_buffer:
        assert buf.dtype == torch.uint8 and buf.shape[0] == S
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    if kind == "sglang-fp8":
        return pool.kv_buffer
    return [pool.get_key_buffer(i) for i in range(3)]


@pytest.mark.parametrize("pool", ["bf16", "sglang-fp8", "sglang-fp8-view"])
@pytest.mark.parametrize("device", DEVICES)
def test_commit_accept_compacts_windows(device, pool):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, N, width, S, ctx = 5, 9, 7, 120, 64
    kv = accept_pool(pool, S, device, g)
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
        kv_dtype = torch.float8_e4m3fn if kind.endswith("-fp8") else torch.bfloat16  # fp8: uint8 storage
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
            kv = mp.MLATokenToKVPool(size=size, page_size=1, dtype=kv_dtype, kv_lora_rank=4, qk_rope_head_dim=2,
                                     layer_num=layers, device=device, enable_memory_saver=False)
            self.allocator = tok.TokenToKVPoolAllocator(size=size, dtype=kv_dtype, device=device, kvcache=kv,
                                                        need_sort=kind != "sglang-nosort")
            if kind.startswith("sglang-shared"):  # a one-layer MLA draft (DeepSeek's MTP/EAGLE) on the same table
                draft = mp.MLATokenToKVPool(size=size, page_size=1, dtype=kv_dtype, kv_lora_rank=4, qk_rope_head_dim=2,
                                            layer_num=1, device=device, enable_memory_saver=False)
                self.pool = sglang_hook._SharedTablePool(rtp, self.allocator, [kv, draft])
            else:
                self.pool = defrag.SGLangPool(rtp, self.allocator)
        self.device = device
        self.lens: dict[int, int] = {}
        self.want: dict[int, torch.Tensor] = {}  # row -> [len, layers, row bytes] uint8
        assert all((kv.dtype == torch.uint8) == (kv_dtype == torch.float8_e4m3fn) for kv in self.layers())

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
        """Every KV buffer the table indexes (target and, for sglang-shared, the draft)."""
        return [kv for group in self.pool.kv_groups for kv in group]

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
        op = data.draw(st.sampled_from(["extend", "extend", "finish", "verify", "verify", "defrag", "defrag_one",
                                        "stale", "duplicate"]))
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
        elif op == "stale" and rows:
            p = defrag.plan(sim.pool, rows, lens, requests=[data.draw(st.sampled_from(rows))], byte_budget=None)
            row = data.draw(st.sampled_from(rows))
            if sim.lens[row] < sim.ctx and sim.free_count() and data.draw(st.booleans()):
                sim.extend(row, 1)  # any allocation in between
            else:
                sim.finish(row)  # a request ends, its slots freed
            before = sim.snapshot()
            if p.compacted:
                with pytest.raises(ValueError, match="stale"):
                    defrag.apply(sim.pool, p)
            else:  # a plan that moves nothing (the request was already one run) stays a no-op
                defrag.apply(sim.pool, p)
            after = sim.snapshot()
            assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
            assert all(same_bytes(a, b) for a, b in zip(before[2], after[2]))
        elif op == "duplicate" and rows:
            row = data.draw(st.sampled_from(rows))
            p = defrag.defragment(sim.pool, rows, lens, requests=[row, row], byte_budget=None)
            assert p.compacted in ([], [row])
        sim.check()


HISTORY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("device", DEVICES)
@HISTORY_SETTINGS
@given(data=st.data())
def test_defrag_history_tensor_pool(device, data):
    sim = PoolSim("tensor", device, gen=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    run_history(sim, data)


@pytest.mark.parametrize("kind", ["sglang-sort", "sglang-nosort", "sglang-shared", "sglang-shared-fp8"])
@HISTORY_SETTINGS
@given(data=st.data())
def test_defrag_history_sglang_pool(kind, data):
    """Random histories on SGLang 0.5.23's pools and allocator, with stale plans, duplicate
    requests and (sglang-shared) a draft pool on the same req_to_token, checked after every step;
    -fp8: both are SGLang's fp8 MLA pools (e4m3 bytes in uint8 buffers), moved as bytes."""
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


@pytest.mark.parametrize("kind", ["tensor", "sglang-sort", "sglang-nosort"])
def test_defrag_refuses_a_stale_plan(kind):
    """A plan made before a request finished (its slots freed) or before any allocation is
    refused by apply, which then changes nothing: no slot freed twice, none leaked."""
    g = torch.Generator().manual_seed(5)
    sim = PoolSim(kind, "cpu", size=40, gen=g)
    for row in (1, 2, 3, 1, 2, 3):
        sim.extend(row, 3)
    rows, lens = sim.live()
    p = defrag.plan(sim.pool, rows, lens, requests=[1], byte_budget=None)
    assert p.compacted == [1]
    sim.finish(1)  # the planned request ends before the plan is applied
    before = sim.snapshot()
    with pytest.raises(ValueError, match="stale"):
        defrag.apply(sim.pool, p)
    after = sim.snapshot()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    sim.check()
    rows, lens = sim.live()
    p = defrag.plan(sim.pool, rows, lens, requests=[2], byte_budget=None)
    sim.extend(3, 1)  # any allocation in between also makes it stale
    with pytest.raises(ValueError, match="stale"):
        defrag.apply(sim.pool, p)
    sim.check()


def test_defrag_duplicate_requests_and_rows():
    """A row named twice in ``requests`` is planned once (bytes counted once); a row listed
    twice among the live requests is refused by name."""
    g = torch.Generator().manual_seed(6)
    sim = PoolSim("tensor", "cpu", size=48, gen=g)
    for row in (1, 2, 1, 2):
        sim.extend(row, 4)
    rows, lens = sim.live()
    once = defrag.plan(sim.pool, rows, lens, requests=[1], byte_budget=None)
    twice = defrag.plan(sim.pool, rows, lens, requests=[1, 1], byte_budget=None)
    assert twice.compacted == [1] and twice.bytes == once.bytes and not twice.skipped
    defrag.apply(sim.pool, twice)
    sim.check()
    with pytest.raises(ValueError, match="row 2 appears more than once"):
        defrag.plan(sim.pool, rows + [2], lens + [lens[1]])


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

# ---- SGLang hook, driven through SGLang's own code ----
# Every case builds its batch with SGLang 0.5.23's real classes (testkit.py): pools,
# allocator, KV index translator, TritonAttnBackend and its metadata paths, EAGLE trees from
# SGLang's tree builder, DFlash chains. The result is compared with SGLang's own
# forward_extend on the same state; on CPU its Triton kernels run in the interpreter (float16:
# the interpreter has no bfloat16).


HOOK_KINDS = {  # verify input -> (speculative algorithm, EAGLE topk)
    "eagle_tree": ("EAGLE", 2),
    "eagle_chain": ("EAGLE", 1),
    "dflash": ("DFLASH", 1),
}


@pytest.fixture
def sgl(monkeypatch):
    """The SGLang testbed with the hook uninstalled around each test; the real forward_extend
    and metadata methods are restored after."""
    pytest.importorskip("sglang")
    pytest.importorskip("transformers")
    tbd = testkit
    for name in ("KDTREE_PROFILE", "KDTREE_DEFRAG", "KDTREE_LOG_EVERY", "KDTREE_VERIFY"):
        monkeypatch.delenv(name, raising=False)
    sglang_hook.uninstall()
    yield tbd
    sglang_hook.uninstall()
    from sglang.srt.runtime_context import reset_context

    reset_context()


def hook_server(tbd, device, kind="eagle_tree", *, N=6, steps=3, heads=4, layers=2, dtype=None, server_args=None,
                **runner_kw):
    skip_unless_triton_runs_on(device)
    algorithm, topk = HOOK_KINDS[kind]
    steps = N - 1 if topk == 1 else steps  # an EAGLE chain has one draft token per step
    tbd.publish_server(device, algorithm=algorithm, num_draft_tokens=N, topk=topk, steps=steps, **(server_args or {}))
    dtype = dtype or (torch.float16 if device == "cpu" else torch.bfloat16)
    runner = tbd.Runner(device=device, dtype=dtype, heads=heads, layers=layers, num_tokens_per_req=N,
                        pool_size=runner_kw.pop("pool_size", 1024), max_context=runner_kw.pop("max_context", 256),
                        **runner_kw)
    return _types.SimpleNamespace(tbd=tbd, runner=runner, kind=kind, N=N, topk=topk, steps=steps, device=device)


def hook_spec(srv, prefix_lens, g, mask_buffer=None):
    seq = torch.tensor(prefix_lens, device=srv.device)
    if srv.kind == "dflash":
        return srv.tbd.dflash_chain(seq, srv.N, g)
    return srv.tbd.eagle_tree(srv.runner, seq, topk=srv.topk, steps=srv.steps, num_draft_tokens=srv.N,
                              generator=g, mask_buffer=mask_buffer)


def sglang_forward(backend, *args, **kwargs):
    """SGLang's own forward_extend (the original under the hook's wrapper)."""
    cls = type(backend)
    fn = cls.forward_extend
    return getattr(fn, "__wrapped__", fn)(backend, *args, **kwargs)


def check_served_layers(srv, step, layers, tol):
    """Each layer: the hooked call, then SGLang's own on the same metadata; outputs agree row
    by row and the nodes' KV is saved where SGLang saves it."""
    r, g = srv.runner, torch.Generator().manual_seed(len(step.prefix_lens) * 7 + step.T)
    for layer in layers:
        q, k, v = srv.tbd.layer_inputs(r, step.T, g)
        ours = r.backend.forward_extend(q, k, v, layer, step.fb).clone()
        assert torch.equal(r.kv_pool.kv_buffer[layer.layer_id][step.out_loc], k)
        ref = sglang_forward(r.backend, q, k, v, layer, step.fb)
        rows_close(ours, ref, r.heads, tol)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["eager", "graph_buffers"])
@pytest.mark.parametrize("kind", list(HOOK_KINDS))
def test_hook_serves_sglang_metadata(sgl, device, kind, path, page_size):
    """TARGET_VERIFY metadata from SGLang's own init_forward_metadata, or from its CUDA-graph
    path (persistent buffers: int64 qo_indptr and mask_indptr, a uint8 mask buffer) for a
    first batch and a changed second one: kdtree_ops serves every layer call (no fallback),
    with SGLang's result and KV write. With --page-size above 1 SGLang's MLA pool keeps one
    row per token slot and its Triton backend still passes token slots (its kernel's page
    arithmetic lands on the same rows), so those calls are served alike."""
    srv = hook_server(sgl, device, kind, page_size=page_size)
    r = srv.runner
    assert r.kv_pool.kv_buffer[0].shape[:2] == (1024 + page_size, 1)
    g = torch.Generator().manual_seed(11)
    r.fill(g)
    sglang_hook.install("on")
    st = sglang_hook._STATE
    layers = [r.layer(i) for i in range(r.layers)]
    # a captured graph serves one batch size: the replayed batch keeps it
    batches = [[5, 33, 0], [17, 2, 61, 9] if path == "eager" else [17, 61, 2]]
    if path == "graph_buffers":
        r.backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * srv.N)
    for i, prefix_lens in enumerate(batches):
        step = sgl.verify_step(r, prefix_lens, hook_spec(srv, prefix_lens, g), generator=g)
        if path == "eager":
            r.backend.init_forward_metadata(step.fb)
        else:
            r.backend.init_forward_metadata_out_graph(step.fb, in_capture=i == 0)
        md = r.backend.forward_metadata
        assert torch.equal(md.kv_indices[: sum(prefix_lens)].cpu(), step.prefix_slots.cpu())  # slots, not pages
        if path == "graph_buffers":
            assert md.qo_indptr.dtype == torch.int64 and md.kv_indices.dtype == torch.int64
            assert md.custom_mask is None if kind == "dflash" else md.custom_mask.dtype == torch.uint8
        check_served_layers(srv, step, layers, ROW_TOL[device])
    assert (st.ours, st.fallbacks) == (len(batches) * len(layers), 0)
    assert st.warned == set()


@pytest.mark.parametrize("device", DEVICES)
def test_hook_serves_fp8_checkpoint_layers(sgl, device):
    """An FP8 checkpoint's attention layers carry k_scale = v_scale = 1.0 (SGLang's Fp8Config
    KV-cache method) over a bf16/fp16 pool: served, identical to SGLang's path."""
    srv = hook_server(sgl, device)
    r = srv.runner
    g = torch.Generator().manual_seed(2)
    r.fill(g)
    layers = [r.layer(i, fp8_checkpoint=True) for i in range(r.layers)]
    assert all(layer.k_scale is not None and layer.k_scale_float == 1.0 for layer in layers)
    sglang_hook.install("on")
    step = sgl.verify_step(r, [9, 40], hook_spec(srv, [9, 40], g), generator=g)
    r.backend.init_forward_metadata(step.fb)
    check_served_layers(srv, step, layers, ROW_TOL[device])
    assert (sglang_hook._STATE.ours, sglang_hook._STATE.fallbacks) == (len(layers), 0)


FP8_LAYER_SCALES = [None, 1.0, 0.37, 2.5]  # per layer: no scales (1.0), a checkpoint's 1.0, scales != 1


def fp8_layers(r):
    """One layer per FP8_LAYER_SCALES entry, its k_scale = v_scale loaded as a checkpoint would."""
    return [r.layer(i, kv_scales=None if s is None else (s, s)) for i, s in enumerate(FP8_LAYER_SCALES[: r.layers])]


def fp8_attention(r, step, layer, q, k, rows=None):
    """SGLang's verify attention over an fp8 pool in float64, from its own state: each prefix
    row read through the pool's get_key_buffer (e4m3) times the layer's k descale (its
    k_scale_float when it has both scales, as forward_extend passes its kernel), the step's
    own k for the nodes, SGLang's flat custom mask (prefix + nodes per row) or a causal chain."""
    md, N, H = r.backend.forward_metadata, step.N, r.heads
    scale = layer.k_scale_float if layer.k_scale is not None and layer.v_scale is not None else 1.0
    kv = r.kv_pool.get_key_buffer(layer.layer_id).reshape(-1, MLA_QK)
    table = r.req_to_token_pool.req_to_token
    qd, kd = q.double().reshape(-1, H, MLA_QK), k.double().reshape(-1, MLA_QK)
    out = torch.empty(qd.shape[0], H, MLA_V, dtype=torch.float64, device=q.device)
    rows = step.rows if rows is None else rows
    for b, P in enumerate(step.prefix_lens):
        slots = table[rows[b], :P].long()
        keys = torch.cat((kv[slots].double() * scale, kd[b * N:(b + 1) * N]))
        if md.custom_mask is None:
            seen = torch.ones(N, P + N, dtype=torch.bool, device=q.device)
            seen[:, P:] = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
        else:
            m0 = int(md.mask_indptr[b])
            seen = md.custom_mask[m0:m0 + N * (P + N)].view(N, P + N).bool()
        scores = torch.einsum("nhd,kd->nhk", qd[b * N:(b + 1) * N], keys) * layer.scaling
        probs = scores.masked_fill(~seen[:, None, :], -math.inf).softmax(-1)
        out[b * N:(b + 1) * N] = torch.einsum("nhk,kd->nhd", probs, keys[:, :MLA_V])
    return out.reshape(-1, H * MLA_V)


def fp8_saved(layer, k):
    """The bytes SGLang's MLA forward_extend saves for the step's k in an fp8 pool."""
    scaled = k if layer.k_scale is None else k.clone().div_(layer.k_scale.to(k.device))
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(HOOK_KINDS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_hook_serves_fp8_pool(sgl, device, kind, page_size):
    """SGLang's fp8 MLA pool (MLATokenToKVPool with dtype float8_e4m3fn, uint8 storage),
    layers without scales, with a checkpoint's 1.0 and with k_scale = v_scale != 1: kdtree_ops
    serves every layer call (no fallback), saves exactly the bytes SGLang's own path saves
    (k / k_scale rounded to e4m3), and its output is the attention over the dequantized prefix
    rows (e4m3 * k_scale) and the step's own unscaled k."""
    srv = hook_server(sgl, device, kind, layers=len(FP8_LAYER_SCALES), kv_dtype=torch.float8_e4m3fn,
                      page_size=page_size)
    r = srv.runner
    assert r.kv_pool.kv_buffer[0].dtype == torch.uint8
    g = torch.Generator().manual_seed(21)
    r.fill(g)
    layers = fp8_layers(r)
    sglang_hook.install("on")
    st = sglang_hook._STATE
    for prefix_lens in ([9, 40, 0], [70, 3]):
        step = sgl.verify_step(r, prefix_lens, hook_spec(srv, prefix_lens, g), generator=g)
        r.backend.init_forward_metadata(step.fb)
        for layer in layers:
            q, k, v = sgl.layer_inputs(r, step.T, g)
            ours = r.backend.forward_extend(q, k, v, layer, step.fb).clone()
            saved = r.kv_pool.kv_buffer[layer.layer_id][step.out_loc].clone()
            assert torch.equal(saved, fp8_saved(layer, k))
            rows_close(ours, fp8_attention(r, step, layer, q, k), r.heads, ROW_TOL[device])
            sglang_forward(r.backend, q, k, v, layer, step.fb)  # SGLang's own save, on the same slots
            assert torch.equal(r.kv_pool.kv_buffer[layer.layer_id][step.out_loc], saved)
    assert (st.ours, st.fallbacks) == (2 * len(layers), 0)
    assert st.warned == set()


@pytest.mark.parametrize("device", DEVICES)
def test_hook_fp8_graph_buffers_cut_to_context(sgl, device, monkeypatch):
    """Over an fp8 pool, SGLang's CUDA-graph metadata hands the layer its whole index buffer
    (max tokens x context length entries, here past what the widened route's 1 GiB workspace
    holds). The hook gives verify_attn the batch's share of it, at most a context length a
    request, so on an H100/H200 a request of 9 row tiles takes the widened route there too."""
    default_verify_kernels(monkeypatch)
    ctx, N, heads = 65536, 9, 64  # 64 heads x 9 nodes: 9 row tiles of 64 a request
    srv = hook_server(sgl, device, "dflash", N=N, heads=heads, layers=1, kv_dtype=torch.float8_e4m3fn,
                      max_context=ctx, pool_size=4096)
    r = srv.runner
    g = torch.Generator().manual_seed(5)
    r.fill(g)
    layer = r.layer(0, kv_scales=(0.37, 0.37))
    r.backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2 * N)
    sglang_hook.install("on")
    given = []
    verify_attn = kdtree_ops.verify_attn
    monkeypatch.setattr(kdtree_ops, "verify_attn", lambda *a, **kw: given.append(a[3].numel()) or verify_attn(*a, **kw))
    step = sgl.verify_step(r, [1000, 333], hook_spec(srv, [1000, 333], g), generator=g)
    r.backend.init_forward_metadata_out_graph(step.fb, in_capture=True)
    whole = r.backend.forward_metadata.kv_indices.numel()
    assert whole == 2 * N * ctx and (whole + step.T) * MLA_QK * 2 > 1 << 30
    q, k, v = sgl.layer_inputs(r, step.T, g)
    call = lambda: r.backend.forward_extend(q, k, v, layer, step.fb).clone()
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        ours, names = launched_kernels(call)
        assert [n for n in names if "widen_fp8_pool_kernel" in n], names
    else:
        ours = call()
    assert given == [2 * ctx]
    rows_close(ours, fp8_attention(r, step, layer, q, k), r.heads, ROW_TOL[device])
    assert (sglang_hook._STATE.ours, sglang_hook._STATE.fallbacks) == (1, 0)


def test_hook_validate_compares_sglang_fp8_path(sgl, caplog, monkeypatch):
    """validate on an fp8 pool with k_scale != 1: the call returns SGLang's own fp8 result, and
    the error it records for the layer is max |ours - SGLang's fp8 Triton result| (ours: the
    attention over dequantized rows, kdtree_ops.verify_attn with the layer's k_scale)."""
    monkeypatch.setenv("KDTREE_LOG_EVERY", "1000")
    srv = hook_server(sgl, "cpu", kv_dtype=torch.float8_e4m3fn)
    r = srv.runner
    g = torch.Generator().manual_seed(13)
    r.fill(g)
    layer = r.layer(1, kv_scales=(0.37, 0.37))
    sglang_hook.install("validate")
    st = sglang_hook._STATE
    step = sgl.verify_step(r, [33, 5], hook_spec(srv, [33, 5], g), generator=g)
    r.backend.init_forward_metadata(step.fb)
    q, k, v = sgl.layer_inputs(r, step.T, g)
    got = r.backend.forward_extend(q, k, v, layer, step.fb)
    assert torch.equal(r.kv_pool.kv_buffer[1][step.out_loc], fp8_saved(layer, k))
    ref = sglang_forward(r.backend, q, k, v, layer, step.fb)
    assert torch.equal(got, ref)  # SGLang's result is what validate returns
    md = r.backend.forward_metadata
    packed = kdtree_ops.sglang_mask_to_packed(md.custom_mask, md.mask_indptr, md.qo_indptr, md.kv_indptr,
                                              num_rows=step.T, max_nodes=md.max_extend_len)
    ours, _ = kdtree_ops.verify_attn(q.view(step.T, r.heads, MLA_QK), r.kv_pool.get_key_buffer(1), md.kv_indptr,
                                     md.kv_indices, md.qo_indptr, k.view(step.T, MLA_QK), packed, layer.scaling,
                                     k_scale=0.37)
    rows_close(ours.view_as(ref), fp8_attention(r, step, layer, q, k), r.heads, ROW_TOL["cpu"])
    err, ref_max = st.validator.stats[torch.device("cpu")][1].tolist()
    assert err == (ours.view_as(ref).float() - ref.float()).abs().max().item() and err > 0
    assert ref_max == ref.float().abs().max().item()
    assert (st.ours, st.fallbacks) == (1, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_hook_dflash_draft_and_target_in_one_step(sgl, device, caplog):
    """DFlash: the draft model runs TARGET_VERIFY through its own Triton backend (non-MLA,
    sharing the request table and allocator). Its calls go to SGLang silently and are not
    counted; the target's MLA layers are served; the step is counted once."""
    sglang_hook.install("on")  # as from sitecustomize: before SGLang builds its backends
    srv = hook_server(sgl, device, "dflash")
    target = srv.runner
    draft = sgl.Runner(device=device, dtype=target.dtype, heads=4, layers=2, num_tokens_per_req=srv.N, mla=False,
                       head_dim=64, draft_of=target)
    g = torch.Generator().manual_seed(4)
    target.fill(g)
    draft.fill(g)
    st = sglang_hook._STATE
    assert target.backend in st.backends and draft.backend in st.backends  # both pools, for defrag
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        prefix_lens = [21, 6]
        step = sgl.verify_step(target, prefix_lens, hook_spec(srv, prefix_lens, g), generator=g)
        draft.backend.init_forward_metadata(step.fb)
        for i in range(draft.layers):
            q, k, v = sgl.layer_inputs(draft, step.T, g)
            out = draft.backend.forward_extend(q, k, v, draft.layer(i), step.fb)
            assert torch.equal(out, sglang_forward(draft.backend, q, k, v, draft.layer(i), step.fb))
        target.backend.init_forward_metadata(step.fb)
        check_served_layers(srv, step, [target.layer(i) for i in range(target.layers)], ROW_TOL[device])
    assert (st.ours, st.fallbacks, st.steps) == (target.layers, 0, 1)
    assert not [rec for rec in caplog.records if rec.name == "kdtree_ops" and rec.levelno >= _logging.WARNING]


@pytest.fixture
def spy(sgl, monkeypatch):
    """SGLang's forward_extend replaced by a spy (for cases whose SGLang path would not run
    here, e.g. page size 16): it records calls and returns 7s."""
    calls = []

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None):
        calls.append(forward_batch.forward_mode)
        return torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), 7.0, dtype=q.dtype, device=q.device)

    from sglang.srt.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend.TritonAttnBackend, "forward_extend", forward_extend)
    return _types.SimpleNamespace(calls=calls, fn=forward_extend)


def spy_step(sgl, spy, prefix_lens=(3, 7), **server_kw):
    srv = hook_server(sgl, "cpu", **server_kw)
    g = torch.Generator().manual_seed(1)
    srv.runner.fill(g)
    step = sgl.verify_step(srv.runner, list(prefix_lens), hook_spec(srv, list(prefix_lens), g), generator=g)
    srv.runner.backend.init_forward_metadata(step.fb)
    q, k, v = sgl.layer_inputs(srv.runner, step.T, g)
    return _types.SimpleNamespace(srv=srv, step=step, q=q, k=k, v=v, backend=srv.runner.backend)


def call_spied(b, layer, **kw):
    return b.backend.forward_extend(b.q, b.k, b.v, layer, b.step.fb, **kw)


def test_hook_install_uninstall(sgl, spy):
    from sglang.srt.layers.attention import triton_backend

    cls = triton_backend.TritonAttnBackend
    names = ("forward_extend", "__init__", "init_forward_metadata", "init_forward_metadata_out_graph")
    originals = {n: cls.__dict__[n] for n in names}
    assert sglang_hook.install("on") and sglang_hook.installed() == "on"
    wrapped = cls.__dict__["forward_extend"]
    assert wrapped is not originals["forward_extend"] and wrapped.__wrapped__ is spy.fn
    assert sglang_hook.install("validate") and cls.__dict__["forward_extend"] is wrapped  # twice: harmless
    assert sglang_hook.installed() == "validate"
    sglang_hook.uninstall()
    sglang_hook.uninstall()
    assert sglang_hook.installed() is None
    assert all(cls.__dict__[n] is f for n, f in originals.items())


def test_hook_off_patches_nothing(sgl, spy, monkeypatch):
    from sglang.srt.layers.attention import triton_backend

    cls = triton_backend.TritonAttnBackend
    for value in ("off", "", "bogus"):
        monkeypatch.setenv("KDTREE_VERIFY", value)
        sglang_hook.maybe_install_from_env()
        assert sglang_hook.installed() is None and cls.__dict__["forward_extend"] is spy.fn
    assert sglang_hook.install("off") is False and cls.__dict__["forward_extend"] is spy.fn
    monkeypatch.setenv("KDTREE_VERIFY", "on")
    sglang_hook.maybe_install_from_env()
    assert sglang_hook.installed() == "on"


def test_hook_routes_only_verify(sgl, spy):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    b = spy_step(sgl, spy)
    sglang_hook.install("on")
    layer = b.srv.runner.layer(0)
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2):
        b.step.fb.forward_mode = mode
        assert torch.all(call_spied(b, layer) == 7)  # SGLang's method, untouched
    assert spy.calls == [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2]
    b.step.fb.forward_mode = ForwardMode.TARGET_VERIFY
    assert not torch.all(call_spied(b, layer) == 7) and len(spy.calls) == 3
    assert (sglang_hook._STATE.ours, sglang_hook._STATE.fallbacks) == (1, 0)


def test_hook_converts_mask_once_per_step(sgl, monkeypatch):
    """What every layer of a step shares (the mask conversion, the longest prefix) is worked
    out by the step's first layer call only."""
    srv = hook_server(sgl, "cpu", layers=3)
    g = torch.Generator().manual_seed(3)
    srv.runner.fill(g)
    sglang_hook.install("on")
    n, bounds = [], []
    real, bound = kdtree_ops.sglang_mask_to_packed, sglang_hook._prefix_bound
    monkeypatch.setattr(kdtree_ops, "sglang_mask_to_packed", lambda *a, **kw: n.append(1) or real(*a, **kw))
    monkeypatch.setattr(sglang_hook, "_prefix_bound", lambda *a, **kw: bounds.append(1) or bound(*a, **kw))
    for prefix_lens in ([4, 8], [9, 1, 3]):
        step = sgl.verify_step(srv.runner, prefix_lens, hook_spec(srv, prefix_lens, g), generator=g)
        srv.runner.backend.init_forward_metadata(step.fb)
        check_served_layers(srv, step, [srv.runner.layer(i) for i in range(3)], ROW_TOL["cpu"])
    assert len(n) == 2 and len(bounds) == 2


def _kv_scales(k_scale, v_scale):
    """Give the layer the scales an FP8 checkpoint's loader would (SGLang's kv_cache method)."""

    def set_scales(sgl, b, layer, kw):
        layer.k_scale, layer.v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
        layer.k_scale_float, layer.v_scale_float = k_scale, v_scale

    return set_scales


FALLBACKS = {  # reason words the warning must contain -> how to make the call need SGLang's path
    "k_scale=0.5": _kv_scales(0.5, 0.5),
    "fp8 e5m2 KV cache": lambda sgl, b, layer, kw: None,
    "k_scale 0.5 != v_scale 0.25 on an fp8 KV cache": _kv_scales(0.5, 0.25),
    "fp8 KV cache scale 1e-40": _kv_scales(1e-40, 1e-40),
    "sliding-window": lambda sgl, b, layer, kw: setattr(layer, "sliding_window_size", 128),
    "logit cap": lambda sgl, b, layer, kw: setattr(layer, "logit_cap", 30.0),
    "sinks is set": lambda sgl, b, layer, kw: kw.update(sinks=torch.zeros(4)),
    "score_mod is set": lambda sgl, b, layer, kw: kw.update(score_mod=lambda s: s),
    "non-causal": lambda sgl, b, layer, kw: setattr(layer, "is_cross_attention", True),
    "deterministic": lambda sgl, b, layer, kw: setattr(b.backend, "enable_deterministic", True),
}
FALLBACK_POOLS = {  # reason -> the KV dtype of SGLang's pool for that case (else q's)
    "fp8 e5m2 KV cache": torch.float8_e5m2,
    "k_scale 0.5 != v_scale 0.25 on an fp8 KV cache": torch.float8_e4m3fn,
    "fp8 KV cache scale 1e-40": torch.float8_e4m3fn,
}


@pytest.mark.parametrize("reason", list(FALLBACKS))
def test_hook_fallbacks(sgl, spy, caplog, reason):
    """Calls kdtree_ops cannot serve exactly as SGLang would go to SGLang's path, counted, with
    one warning per reason naming it."""
    b = spy_step(sgl, spy, kv_dtype=FALLBACK_POOLS.get(reason))
    sglang_hook.install("on")
    layer = b.srv.runner.layer(0)
    kw = {}
    FALLBACKS[reason](sgl, b, layer, kw)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        for _ in range(2):
            assert torch.all(call_spied(b, layer, **kw) == 7)
    assert len(spy.calls) == 2 and (sglang_hook._STATE.ours, sglang_hook._STATE.fallbacks) == (0, 2)
    said = [r.getMessage() for r in caplog.records if r.name == "kdtree_ops"]
    assert len(said) == 1 and reason in said[0], said


@pytest.mark.parametrize("who", ["draft runner", "non-MLA target", "non-MLA layer"])
def test_hook_passes_other_models_silently(sgl, spy, caplog, who):
    """TARGET_VERIFY calls that are not the target model's MLA attention (a DFlash draft, a
    dense target, a layer of another shape) are SGLang's: no warning, not counted."""
    b = spy_step(sgl, spy)
    sglang_hook.install("on")
    layer = b.srv.runner.layer(0)
    if who == "draft runner":
        b.backend.is_draft_runner = True
    elif who == "non-MLA target":
        b.backend.use_mla = False
    else:
        layer.v_head_dim = 128
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        assert torch.all(call_spied(b, layer) == 7)
        b.backend.init_forward_metadata(b.step.fb)
    assert len(spy.calls) == 1
    st = sglang_hook._STATE
    assert (st.ours, st.fallbacks) == (0, 0) and (st.steps == 0 or who == "non-MLA layer")
    assert not [r for r in caplog.records if r.name == "kdtree_ops" and r.levelno >= _logging.WARNING]


def test_hook_error_isolation(sgl, spy, caplog, monkeypatch):
    """An exception inside our path: SGLang's path serves the call, one warning for it."""
    b = spy_step(sgl, spy)
    sglang_hook.install("on")

    def boom(*a, **kw):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(kdtree_ops, "verify_attn", boom)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        for _ in range(3):
            assert torch.all(call_spied(b, b.srv.runner.layer(0)) == 7)
    assert len(spy.calls) == 3 and sglang_hook._STATE.fallbacks == 3
    said = [r.getMessage() for r in caplog.records if r.name == "kdtree_ops"]
    assert len(said) == 1 and "kernel exploded" in said[0]


def test_hook_validate_returns_sglang_and_reports_error(sgl, caplog, monkeypatch):
    monkeypatch.setenv("KDTREE_LOG_EVERY", "1")
    monkeypatch.setenv("KDTREE_PROFILE", "1")
    srv = hook_server(sgl, "cpu")
    r = srv.runner
    g = torch.Generator().manual_seed(8)
    r.fill(g)
    cls = type(r.backend)
    real, skew = cls.forward_extend, {"factor": 1.0}

    def skewed(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None, aux_tensors=None):
        return real(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, score_mod, aux_tensors) * skew["factor"]

    monkeypatch.setattr(cls, "forward_extend", skewed)
    sglang_hook.install("validate")
    step = sgl.verify_step(r, [11, 2], hook_spec(srv, [11, 2], g), generator=g)
    r.backend.init_forward_metadata(step.fb)
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        for lid in range(2):
            q, k, v = sgl.layer_inputs(r, step.T, g)
            ref = sglang_forward(r.backend, q, k, v, r.layer(lid), step.fb)
            assert torch.equal(r.backend.forward_extend(q, k, v, r.layer(lid), step.fb), ref)  # SGLang's result
        sglang_hook._log_summary()
        assert "2 layers compared" in caplog.text and "past tolerance" not in caplog.text
        assert "attn.kdtree" in caplog.text and "attn.sglang" in caplog.text and "mask" in caplog.text
        skew["factor"] = 1.5  # SGLang's path now disagrees
        q, k, v = sgl.layer_inputs(r, step.T, g)
        r.backend.forward_extend(q, k, v, r.layer(1), step.fb)
        sglang_hook._log_summary()
    assert "layer 1 on cpu" in caplog.text and "past tolerance" in caplog.text


def test_hook_step_bookkeeping(sgl, caplog, monkeypatch):
    """SGLang's init_forward_metadata(_out_graph) count target verify steps (not captures) and
    log a summary every KDTREE_LOG_EVERY steps."""
    monkeypatch.setenv("KDTREE_LOG_EVERY", "2")
    srv = hook_server(sgl, "cpu")
    r = srv.runner
    g = torch.Generator().manual_seed(6)
    sglang_hook.install("on")
    r.backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * srv.N)
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        for call in ("eager", "capture", "replay"):
            step = sgl.verify_step(r, [5, 3], hook_spec(srv, [5, 3], g), generator=g)
            if call == "eager":
                r.backend.init_forward_metadata(step.fb)
            else:
                r.backend.init_forward_metadata_out_graph(step.fb, in_capture=call == "capture")
    assert sglang_hook._STATE.steps == 2 and "verify steps 1-2" in caplog.text


def test_hook_patches_on_later_import(tmp_path, monkeypatch):
    """Installed from sitecustomize before SGLang is imported: patched right after import."""
    (tmp_path / "kdtree_late_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = []
    sglang_hook._when_imported("kdtree_late_mod", lambda m: got.append(m.X))
    assert got == []
    import kdtree_late_mod  # noqa: F401

    assert got == [1]
    monkeypatch.delitem(sys.modules, "kdtree_late_mod")


def test_hook_ddtree_and_defrag_status(sgl, caplog, monkeypatch):
    monkeypatch.setenv("KDTREE_DEFRAG", "1")
    srv = hook_server(sgl, "cpu")
    sglang_hook.install("on")
    ddtree_present = importlib.util.find_spec("sglang.srt.speculative.ddtree_info") is not None
    if ddtree_present:  # the PR's overlay: imported, so hooked
        import sglang.srt.speculative.ddtree_worker  # noqa: F401
    assert ("DDTreeVerifyInput.verify" in sglang_hook._STATE.ddtree.hooked) == ddtree_present
    g = torch.Generator().manual_seed(2)
    step = sgl.verify_step(srv.runner, [3], hook_spec(srv, [3], g), generator=g)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        sglang_hook._maybe_defrag(srv.runner.backend, step.fb)  # the test's server args keep the radix cache
    assert "defrag off" in caplog.text and "radix" in caplog.text


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["kv-q-dtype", "kv-fp8"])
@pytest.mark.parametrize("draft_seen", [True, False])
def test_hook_defrag_moves_target_and_draft_kv(sgl, monkeypatch, caplog, draft_seen, kv_dtype):
    """KDTREE_DEFRAG=1 with a DFlash target and draft sharing the request table: defrag
    rewrites the table and moves the KV of both pools, so every request reads the same bytes
    from each; when the draft's backend was not seen, defrag stays off and says why. With
    ``--kv-cache-dtype fp8_e4m3`` both of SGLang's pools hold e4m3 bytes in uint8 buffers."""
    monkeypatch.setenv("KDTREE_DEFRAG", "1")
    monkeypatch.setenv("KDTREE_DEFRAG_EVERY", "1")
    if draft_seen:
        sglang_hook.install("on")
    srv = hook_server(sgl, "cpu", "dflash", server_args=dict(disable_radix_cache=True, disable_overlap_schedule=True),
                      kv_dtype=kv_dtype)
    target = srv.runner
    draft = sgl.Runner(device="cpu", dtype=target.dtype, heads=2, layers=2, num_tokens_per_req=srv.N, mla=False,
                       head_dim=32, draft_of=target, kv_dtype=kv_dtype)
    buffers = target.kv_pool.kv_buffer + draft.kv_pool.k_buffer + draft.kv_pool.v_buffer
    assert all((buf.dtype == torch.uint8) == (kv_dtype is not None) for buf in buffers)
    sglang_hook.install("on")
    g = torch.Generator().manual_seed(9)
    target.fill(g)
    draft.fill(g)
    prefix_lens = [40, 25, 60]
    step = sgl.verify_step(target, prefix_lens, hook_spec(srv, prefix_lens, g), generator=g)
    table = target.req_to_token_pool.req_to_token

    def read_all():
        out = []
        for b, (row, n) in enumerate(zip(step.rows.tolist(), prefix_lens)):
            slots = table[row, :n].long()
            out.append([buf[slots].clone() for buf in buffers])
        return out

    before, runs_before = read_all(), defrag.fragmentation(table, step.rows, prefix_lens)
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        target.backend.init_forward_metadata(step.fb)
    runs_after = defrag.fragmentation(table, step.rows, prefix_lens)
    for got, want in zip(read_all(), before):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    if draft_seen:
        assert "defrag at verify step 1" in caplog.text and "over 2 pools" in caplog.text
        assert (runs_after < runs_before).all() and (runs_after == 1).any()
    else:
        assert "draft model's KV pool" in caplog.text and torch.equal(runs_after, runs_before)


def test_import_touches_no_cuda(tmp_path):
    """`import kdtree_ops` (the sitecustomize line, hook on) starts no CUDA work: no device
    query, no CUDA init, no build. Run where a GPU is claimed present and every CUDA entry point
    kdtree_ops could reach at import raises."""
    script = """
import torch, sys
def boom(*a, **k):
    raise SystemExit("CUDA touched at import: " + repr(a))
torch.cuda.is_available = lambda: True
for name in ("get_device_capability", "get_device_properties", "init", "current_device", "set_device",
             "device_count", "get_device_name", "synchronize"):
    setattr(torch.cuda, name, boom)
import importlib.util
import kdtree_ops, sglang_hook
assert not torch.cuda.is_initialized()
expected = "on" if importlib.util.find_spec("sglang") else None  # the hook waits for SGLang
assert sglang_hook.installed() == expected, sglang_hook.installed()
print("clean")
"""
    env = dict(os.environ, KDTREE_VERIFY="on", KDTREE_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), timeout=300)
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr
    assert not (tmp_path / "cache").exists()


@needs_gpu
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", list(HOOK_KINDS))
@pytest.mark.parametrize("page_size", [1, 64])
def test_hook_cuda_graph_capture_and_replay(sgl, kind, pool, page_size):
    """SGLang's CUDA-graph verify path on the GPU: metadata from init_forward_metadata_out_graph
    (capture, then a replay with a changed batch), the layers captured in a CUDA graph through
    the hooked forward_extend, replayed: kdtree_ops served every captured call and the replayed
    output equals SGLang's own path on the new batch. On SGLang's fp8 pool (layers without
    scales, with 1.0 and with 0.37, each baked into the graph as SGLang bakes it) the replay
    saves SGLang's bytes and its output is the attention over the dequantized rows: SGLang's
    own fp8 Triton kernel rounds q and the softmax weights to e4m3, so it is no reference.
    Page size 64: every full 64-key tile of a prefix is one page, the case the Hopper kernel
    loads as tensor-map boxes."""
    fp8 = pool == "fp8"
    srv = hook_server(sgl, "cuda", kind, N=9, layers=3, heads=16, pool_size=1 << 16, max_context=8192,
                      kv_dtype=torch.float8_e4m3fn if fp8 else None, page_size=page_size)
    r = srv.runner
    g = torch.Generator().manual_seed(12)
    r.fill(g)
    sglang_hook.install("on")
    B = 3
    r.backend.init_cuda_graph_state(max_bs=B, max_num_tokens=B * srv.N)
    layers = fp8_layers(r) if fp8 else [r.layer(i) for i in range(r.layers)]

    def batch(prefix_lens):
        step = sgl.verify_step(r, prefix_lens, hook_spec(srv, prefix_lens, g), generator=g)
        return step, [sgl.layer_inputs(r, step.T, g) for _ in layers]

    step, inputs = batch([3000, 17, 777])
    r.backend.init_forward_metadata_out_graph(step.fb, in_capture=True)
    static = [(q.clone(), k.clone()) for q, k, _ in inputs]
    static = [(q, k, k[..., :512]) for q, k in static]  # v is k's first 512 dims, as DeepSeek passes it
    outs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: Triton JIT, allocator
        for (q, k, v), layer in zip(static, layers):
            r.backend.forward_extend(q, k, v, layer, step.fb)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (q, k, v), layer in zip(static, layers):
            outs.append(r.backend.forward_extend(q, k, v, layer, step.fb))
    assert (sglang_hook._STATE.ours, sglang_hook._STATE.fallbacks) == (2 * len(layers), 0)
    step2, inputs2 = batch([1500, 4000, 33])  # the same T: the graph's batch size
    step.fb.req_pool_indices.copy_(step2.fb.req_pool_indices)
    step.fb.seq_lens.copy_(step2.fb.seq_lens)
    step.fb.out_cache_loc.copy_(step2.fb.out_cache_loc)
    step.fb.spec_info = step2.fb.spec_info
    step.fb.kv_loc_plan = step2.fb.kv_loc_plan
    r.backend.init_forward_metadata_out_graph(step.fb, in_capture=False)
    for (q, k, v), new in zip(static, inputs2):
        q.copy_(new[0])
        k.copy_(new[1])
    graph.replay()
    torch.cuda.synchronize()
    r.backend.init_forward_metadata(step2.fb)
    for (q, k, v), layer, out in zip(static, layers, outs):
        if fp8:
            assert torch.equal(r.kv_pool.kv_buffer[layer.layer_id][step2.out_loc], fp8_saved(layer, k))
            rows_close(out, fp8_attention(r, step2, layer, q, k), r.heads, ROW_TOL["cuda"])
        else:
            rows_close(out, sglang_forward(r.backend, q, k, v, layer, step2.fb), r.heads, ROW_TOL["cuda"])


# ---- DDTree through the hook (SGLang PR #29907) ----
# The PR's own functions (its overlay on SGLang 0.5.23) against the same calls through the hook,
# on real 0.5.23 pools, Reqs, ScheduleBatch, SamplingBatchInfo and LogitsProcessorOutput.
# kdtree_ops serves them with its CPU reference ops on CPU and its kernels on a GPU; SGLang's
# Triton kernels on that path run interpreted on CPU (TRITON_INTERPRET, top of this file).


@pytest.fixture(scope="module")
def pr():
    """The DDTree PR's modules and functions (testkit.ddtree_pr); the runtime context
    eagle_sample reads."""
    pytest.importorskip("sglang")
    for module in ("ddtree_utils", "ddtree_info", "ddtree_worker"):
        pytest.importorskip(f"sglang.srt.speculative.{module}")
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    sglang_hook.uninstall()
    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu", attention_backend="triton"), role="test",
            ranks=SpawnRanks(world_rank=0, dp_rank=None))
    yield testkit.ddtree_pr()
    sglang_hook.uninstall()
    reset_context()


@pytest.fixture
def ddtree_hook(pr, monkeypatch):
    """install(mode) -> the hook's DDTree counters; SGLang's greedy tree verify on its Triton
    kernel (testkit.verify_tree_greedy_on_triton)."""
    sglang_hook.uninstall()
    for name in ("SGLANG_DDTREE_MAX_TOPK", "SGLANG_DDTREE_DEPTH_BONUS", "SGLANG_DDTREE_RANK_PROBE", "KDTREE_LOG_EVERY"):
        monkeypatch.delenv(name, raising=False)

    monkeypatch.setattr(pr.eagle_utils, "verify_tree_greedy_func", testkit.verify_tree_greedy_on_triton(pr.spec_tree))

    def install(mode="on"):
        assert sglang_hook.install(mode)
        return sglang_hook._STATE.ddtree

    yield install
    sglang_hook.uninstall()


# (bs, L, V, budget, kind): full trees up to 512 nodes, B == L (the PR's chain shortcut), B < L.
DDTREE_ROUNDS = [
    (1, 3, 41, 7, "random"), (3, 5, 97, 5, "peaked"), (2, 7, 64, 40, "ties"), (5, 4, 200, 100, "flat"),
    (7, 15, 300, 64, "random"), (4, 9, 53, 256, "peaked"), (2, 15, 1000, 512, "random"), (3, 6, 37, 3, "random"),
    (6, 11, 128, 129, "zeros"), (1, 15, 500, 512, "peaked"), (5, 13, 77, 33, "ties"), (2, 3, 5, 200, "flat"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs,L,V,budget,kind", DDTREE_ROUNDS)
def test_ddtree_round_through_hook_matches_pr(pr, ddtree_hook, device, bs, L, V, budget, kind):
    """Tree, EAGLE format, flat mask, acceptance and KV commit: node for node, slot for slot,
    the PR's; and kdtree_ops served every call."""
    counters = ddtree_hook("on")
    g = torch.Generator().manual_seed(bs * 1000 + L * 10 + budget)
    logits = ddtree_logits(bs, L, V, kind, g).to(device)
    verified = torch.randint(0, V, (bs,), generator=g).to(device)
    prefix = torch.randint(0, 40, (bs,), generator=g).tolist()
    theirs_batch, ours_batch = ddtree_batch(device, prefix, budget + 1, V), ddtree_batch(device, prefix, budget + 1, V)
    probe = ddtree_round(pr, pr.calls, ddtree_batch(device, prefix, budget + 1, V), logits, verified, budget, None, None)
    target = ddtree_targets(probe.tree[2], probe.tree[0], V, g)
    hidden = torch.randn(bs * (budget + 1), 12, generator=g).to(device)
    theirs = ddtree_round(pr, pr.calls, theirs_batch, logits, verified, budget, greedy_logits(target, V), hidden)
    ours = ddtree_round(pr, pr.hooked, ours_batch, logits, verified, budget, greedy_logits(target, V), hidden)
    assert_same_round(ours, theirs)
    assert ours.tree[0].data_ptr() == ours.bufs["_out_node_token_ids"].data_ptr()  # views of the worker's buffers
    assert ours.tree[4].data_ptr() == ours.bufs["_out_visibility"].data_ptr()
    assert isinstance(ours.tree[3], sglang_hook.LazyChildMaps)
    assert counters.ours == dict.fromkeys(sglang_hook.DDTREE_CALLS, 1)
    assert counters.sglang == dict.fromkeys(sglang_hook.DDTREE_CALLS, 0)
    accepted = [len(a) for a in theirs.vi.accepted_indices]
    assert max(accepted) > 1 or budget <= 5  # the targets do follow the trees


@pytest.mark.parametrize("device", DEVICES)
def test_ddtree_build_matches_pr_many(pr, ddtree_hook, monkeypatch, device):
    """The tree build alone on many drafts (odd sizes, ties, the env knobs), with the worker's
    buffers, too-small buffers (the PR allocates then) and none."""
    counters = ddtree_hook("on")
    g = torch.Generator().manual_seed(77)
    calls = 0
    for i in range(90):
        bs, L = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(3, 16, (1,), generator=g))
        V = int(torch.randint(2, 400, (1,), generator=g))
        budget = [L, max(1, L - 2), int(torch.randint(L + 1, 64, (1,), generator=g)),
                  int(torch.randint(64, 513, (1,), generator=g))][i % 4]
        kind = DDTREE_KINDS[i % len(DDTREE_KINDS)]
        if i % 9 == 4:
            monkeypatch.setenv("SGLANG_DDTREE_DEPTH_BONUS", ["-0.3", "0", "1.5"][i % 3])
        if i % 11 == 5:
            monkeypatch.setenv("SGLANG_DDTREE_MAX_TOPK", ["1", "3", "40"][i % 3])
        logits = ddtree_logits(bs, L, V, kind, g).to(device)
        bufs = [tree_buffers(bs + 1, budget, device), tree_buffers(max(bs - 1, 0), budget, device), {}][i % 3]
        bufs2 = {k: v.clone() for k, v in bufs.items()}
        theirs = pr.calls.build(logits, budget, torch.device(device), **bufs)
        ours = pr.utils.build_ddtree_tree(logits, budget, torch.device(device), **bufs2)
        for name, a, b in zip(("tokens", "depths", "parents", "child_maps", "visibility", "sizes"), ours, theirs):
            same(a, b, (i, bs, L, V, budget, kind, name))
        calls += 1
        monkeypatch.delenv("SGLANG_DDTREE_DEPTH_BONUS", raising=False)
        monkeypatch.delenv("SGLANG_DDTREE_MAX_TOPK", raising=False)
    assert counters.ours["build_ddtree_tree"] == calls and counters.sglang["build_ddtree_tree"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_ddtree_spine_mode_mask_and_verify_match_pr(pr, ddtree_hook, caplog, device):
    """Spine mode (budget <= L): the worker builds a chain itself (untouched); its mask and
    verify still go through the hook."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    counters = ddtree_hook("on")
    bs, D, V = 3, 8, 50
    g = torch.Generator().manual_seed(3)
    prefix = [5, 0, 17]
    draft = torch.randint(0, V, (bs, D), generator=g).to(device)
    target = draft.roll(-1, 1).cpu()
    target[1, 3] = (target[1, 3] + 1) % V  # request 1 stops after 3 drafts
    target[2, 0] = (target[2, 0] + 1) % V  # request 2 rejects the first
    hidden = torch.randn(bs * D, 6, generator=g).to(device)
    results = []
    for calls in (pr.calls, pr.hooked):
        batch = ddtree_batch(device, prefix, D, V)
        node = torch.arange(D, device=device)  # DDTreeWorker's chain LCRS, visibility and sizes
        retrieve = (torch.arange(bs, device=device)[:, None] * D + node,
                    torch.where(node < D - 1, node + 1, -1).expand(bs, D).contiguous(),
                    torch.full((bs, D), -1, dtype=torch.long, device=device))
        sizes = torch.full((bs,), D, dtype=torch.long, device=device)
        vis = torch.tril(torch.ones(D, D, dtype=torch.bool, device=device)).expand(bs, D, D).contiguous()
        worker = object.__new__(pr.worker.DDTreeWorker)
        worker.max_tree_nodes = D
        mask = calls.flat_mask(worker, batch=batch, visibility=vis, actual_tree_sizes=sizes)
        vi = pr.info.DDTreeVerifyInput(
            draft_token=draft.reshape(-1), positions=torch.zeros(bs * D, dtype=torch.long, device=device), draft_token_num=D,
            tree_budget=D - 1, child_maps=[{} for _ in range(bs)], actual_tree_sizes=sizes, custom_mask=mask,
            tree_is_spine=True, topk=1, spec_steps=D - 1, retrive_index=retrieve[0], retrive_next_token=retrieve[1],
            retrive_next_sibling=retrieve[2])
        vi.prepare_for_verify(batch, 1)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        lo = LogitsProcessorOutput(next_token_logits=torch.nn.functional.one_hot(target.reshape(-1), V).float().to(device),
                                   hidden_states=hidden)
        out = calls.verify(vi, batch=batch, logits_output=lo, page_size=1, model_runner=object())
        results.append(_types.SimpleNamespace(tree=(), retrieve=(), mask=mask, spine=True, vi=vi, out=out, batch=batch))
    assert_same_round(results[1], results[0])
    assert results[0].vi.accepted_indices == [list(range(D)), [0, 1, 2, 3], [0]]
    assert counters.ours["_build_flat_tree_mask"] == counters.ours["verify"] == 1
    with caplog.at_level(_logging.INFO, logger="kdtree_ops"):
        sglang_hook._log_summary()  # the periodic line, as a verify step would trigger it
    assert "DDTree calls so far" in caplog.text and "verify 1 on kdtree_ops / 0 on the PR's code" in caplog.text


def test_ddtree_validate_returns_pr_result_and_counts_mismatches(pr, ddtree_hook, monkeypatch, caplog):
    counters = ddtree_hook("validate")
    bs, L, V, budget = 3, 6, 80, 30
    g = torch.Generator().manual_seed(11)
    logits, verified = ddtree_logits(bs, L, V, "ties", g), torch.randint(0, V, (bs,), generator=g)
    prefix = [4, 9, 1]
    probe = ddtree_round(pr, pr.calls, ddtree_batch("cpu", prefix, budget + 1, V), logits, verified, budget, None, None)
    target = ddtree_targets(probe.tree[2], probe.tree[0], V, g)
    hidden = torch.randn(bs * (budget + 1), 4, generator=g)
    theirs = ddtree_round(pr, pr.calls, ddtree_batch("cpu", prefix, budget + 1, V), logits, verified, budget, greedy_logits(target, V), hidden)
    ours = ddtree_round(pr, pr.hooked, ddtree_batch("cpu", prefix, budget + 1, V), logits, verified, budget, greedy_logits(target, V), hidden)
    assert_same_round(ours, theirs)
    assert isinstance(ours.tree[3], list)  # the PR's own result came back
    assert counters.compared == counters.sglang == dict.fromkeys(sglang_hook.DDTREE_CALLS, 1)
    assert counters.mismatches == counters.ours == dict.fromkeys(sglang_hook.DDTREE_CALLS, 0)

    real = kdtree_ops.accept_retrieve
    monkeypatch.setattr(kdtree_ops, "accept_retrieve", lambda *a: real(*a)._replace(bonus=real(*a).bonus + 1))
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        again = ddtree_round(pr, pr.hooked, ddtree_batch("cpu", prefix, budget + 1, V), logits, verified, budget,
                             greedy_logits(target, V), hidden)
    assert counters.mismatches["verify"] == 1 and "verify differs" in caplog.text and "next_tokens" in caplog.text
    assert_same_round(again, theirs)  # still the PR's result


def test_ddtree_unsupported_calls_go_to_pr(pr, ddtree_hook, caplog):
    counters = ddtree_hook("on")
    g = torch.Generator().manual_seed(5)
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        deep = ddtree_logits(2, 32, 30, "random", g)  # L = 32: past the op's depth limit
        theirs = pr.calls.build(deep, 40, torch.device("cpu"))
        ours = pr.utils.build_ddtree_tree(deep, 40, torch.device("cpu"))
        for a, b in zip(ours, theirs):
            same(a, b, "fallback build")
        assert counters.sglang["build_ddtree_tree"] == 1 and counters.ours["build_ddtree_tree"] == 0
        assert "draft length L=32" in caplog.text

        bs, L, V, budget = 2, 4, 40, 12
        logits, verified = ddtree_logits(bs, L, V, "random", g), torch.randint(0, V, (bs,), generator=g)
        hooked = pr.hooked
        paged = _types.SimpleNamespace(**{**vars(hooked), "verify": lambda vi, **kw: vi.verify(**{**kw, "page_size": 2})})
        with pytest.raises(AssertionError, match="page_size"):  # the PR's own verify asserts
            ddtree_round(pr, paged, ddtree_batch("cpu", [3, 5], budget + 1, V), logits, verified, budget,
                         greedy_logits(torch.zeros(bs, budget + 1, dtype=torch.long), V), None)
        assert counters.sglang["verify"] == 1 and "page size 2" in caplog.text

    batch = ddtree_batch("cpu", [3, 5], budget + 1, V)
    round_ = ddtree_round(pr, hooked, batch, logits, verified, budget, None, None)
    logits_output = _types.SimpleNamespace(next_token_logits=torch.zeros(bs * (budget + 1), V), hidden_states=None)
    batch.sampling_info.is_all_greedy = False
    assert sglang_hook._verify_refusal(round_.vi, batch, logits_output, 1, object()) == "non-greedy sampling in the batch"
    batch.sampling_info.is_all_greedy = True
    batch.sampling_info.logit_bias = torch.zeros(bs, V)
    assert "logit_bias" in sglang_hook._verify_refusal(round_.vi, batch, logits_output, 1, object())
    batch.sampling_info.logit_bias = None
    round_.vi._draft_pos_topk = torch.zeros(bs, L, 32, dtype=torch.long)
    assert "RANK_PROBE" in sglang_hook._verify_refusal(round_.vi, batch, logits_output, 1, object())


def test_ddtree_child_maps_are_a_snapshot(pr, ddtree_hook):
    """The lazy child_maps read the tree as it was built, even after the worker's buffers are
    overwritten by the next build."""
    ddtree_hook("on")
    g = torch.Generator().manual_seed(9)
    first, second = ddtree_logits(2, 5, 60, "random", g), ddtree_logits(2, 5, 60, "peaked", g)
    bufs = tree_buffers(4, 20, "cpu")
    ours = pr.utils.build_ddtree_tree(first, 20, torch.device("cpu"), **bufs)
    pr.utils.build_ddtree_tree(second, 20, torch.device("cpu"), **bufs)
    assert list(ours[3]) == pr.calls.build(first, 20, torch.device("cpu"))[3]
    assert len(ours[3]) == 2


def test_ddtree_install_uninstall_restores(pr, ddtree_hook):
    counters = ddtree_hook("on")
    assert pr.utils.build_ddtree_tree is not pr.calls.build and pr.worker.build_ddtree_tree is not pr.calls.build
    assert pr.info.DDTreeVerifyInput.__dict__["verify"] is not pr.calls.verify
    assert len(counters.hooked) == 6  # two in ddtree_utils, the worker's two names + its mask method, verify
    sglang_hook.uninstall()
    assert pr.utils.build_ddtree_tree is pr.calls.build and pr.worker.build_ddtree_tree is pr.calls.build
    assert pr.utils.build_eagle_tree_format is pr.calls.eagle_format and pr.worker.build_eagle_tree_format is pr.calls.eagle_format
    assert pr.worker.DDTreeWorker.__dict__["_build_flat_tree_mask"] is pr.calls.flat_mask
    assert pr.info.DDTreeVerifyInput.__dict__["verify"] is pr.calls.verify


def test_ddtree_absent_patches_nothing(pr, monkeypatch):
    """SGLang without the PR (0.5.23 as released): the hook registers, nothing gets patched."""
    import importlib.abc

    names = (sglang_hook.DDTREE_UTILS, sglang_hook.DDTREE_INFO, sglang_hook.DDTREE_WORKER)

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name in names:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sglang_hook.uninstall()
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Absent(), *sys.meta_path])
    try:
        assert sglang_hook.install("on")
        with pytest.raises(ModuleNotFoundError):
            import sglang.srt.speculative.ddtree_utils  # noqa: F401
        assert sglang_hook._STATE.ddtree.hooked == []
        assert not any("ddtree" in getattr(owner, "__module__", getattr(owner, "__name__", ""))
                       for owner, _, _ in sglang_hook._STATE.patched)
    finally:
        sglang_hook.uninstall()
    assert pr.utils.build_ddtree_tree is pr.calls.build and pr.info.DDTreeVerifyInput.__dict__["verify"] is pr.calls.verify


# ---- the DDTree ops (sglang_build_tree, accept_retrieve, flat mask with num_nodes) ----


def sglang_tree_case(bs, L, V, budget, kind, seed, device="cpu", k=None):
    g = torch.Generator().manual_seed(seed)
    chain = budget == L
    k = 1 if chain else (k or min(max(budget // L + 1, 2), V, 6))
    lp, tok = kdtree_ops.draft_topk(ddtree_logits(bs, L, V, kind, g), k)
    return lp.contiguous().to(device), tok.contiguous().to(device), chain


def sglang_tree_configs(count, seed):
    """(bs, L, V, budget, kind, k, depth bonus): budgets 1..1024 incl. chains, L 1..31, wide top-k."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    for i in range(count):
        L = pick(1, 31)
        budget = [L, pick(1, 64), pick(65, 512), pick(513, 1024)][i % 4]
        bs = pick(1, 9) if budget <= 512 else pick(1, 3)
        V = pick(2, 3000)
        k = [None, pick(1, 8), pick(1, 300)][i % 3]
        yield bs, L, V, budget, DDTREE_KINDS[i % len(DDTREE_KINDS)], (None if k is None else min(k, V)), [0.2, 0.0, -0.4, 1.0][i % 4]


@needs_gpu
def test_sglang_build_tree_cuda_matches_reference():
    trees = 0
    for i, (bs, L, V, budget, kind, k, bonus) in enumerate(sglang_tree_configs(120, seed=4321)):
        lp, tok, chain = sglang_tree_case(bs, L, V, budget, kind, seed=i, k=k)
        margin = [1.0, 0.0, 3.5][i % 3]
        want = kdtree_ops.sglang_build_tree(lp, tok, budget, depth_bonus=bonus, stop_margin=margin, chain=chain)
        got = kdtree_ops.sglang_build_tree(lp.cuda(), tok.cuda(), budget, depth_bonus=bonus, stop_margin=margin, chain=chain)
        for name, a, b in zip(kdtree_ops.SGLangTree._fields, got, want):
            assert torch.equal(a.cpu(), b), (i, bs, L, V, budget, kind, k, bonus, name)
        trees += bs
    assert trees >= 300


def retrieve_case(bs, L, V, budget, kind, seed, device):
    """A tree from sglang_build_tree, its EAGLE retrieve arrays, candidates and targets."""
    lp, tok, chain = sglang_tree_case(bs, L, V, budget, kind, seed)
    tree = kdtree_ops.sglang_build_tree(lp, tok, budget, chain=chain)
    par = tree.parents.int()
    _, _, _, nxt, sib = torch.ops.kdtree.verify_metadata(torch.zeros_like(par), par, torch.zeros(bs, dtype=torch.int32), True)
    g = torch.Generator().manual_seed(seed)
    cand = torch.cat((torch.randint(0, V, (bs, 1), generator=g), tree.node_tokens), 1)
    target = ddtree_targets(tree.parents, tree.node_tokens, V, g, follow=0.9)
    return [t.contiguous().to(device) for t in (nxt, sib, cand, target)], tree


@needs_gpu
def test_accept_retrieve_cuda_matches_reference():
    for i, (bs, L, V, budget, kind, _, _) in enumerate(sglang_tree_configs(60, seed=99)):
        args, _ = retrieve_case(bs, L, V, budget, kind, i, "cuda")
        for depth in (budget, L, 2, 0):
            got = kdtree_ops.accept_retrieve(*args, depth)
            want = kdtree_ops.accept_retrieve(*[a.cpu() for a in args], depth)
            for name, a, b in zip(kdtree_ops.RetrieveAccept._fields, got, want):
                assert torch.equal(a.cpu(), b), (i, depth, name)
    broken = [a.clone() for a in args]
    broken[0][:, 0] = budget + 7  # a child index past the tree reads as "no child", never out of bounds
    got = kdtree_ops.accept_retrieve(*broken, budget)
    want = kdtree_ops.accept_retrieve(*[a.cpu() for a in broken], budget)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)) and (got.accept_len == 1).all()


def test_accept_retrieve_reference_hand_case():
    # root -> 1 (5), 2 (7), 3 (5); 1 -> 4 (9); 3 -> 5 (8): siblings in order 1, 2, 3
    nxt = torch.tensor([[1, 4, -1, 5, -1, -1]])
    sib = torch.tensor([[-1, 2, 3, -1, -1, -1]])
    cand = torch.tensor([[100, 5, 7, 5, 9, 8]])
    target = torch.tensor([[5, 9, 0, 8, 11, 12]])
    r = kdtree_ops.accept_retrieve(nxt, sib, cand, target, 5)
    assert r.accepted.tolist() == [[0, 1, 4, -1, -1, -1]] and r.accept_len.tolist() == [3] and r.bonus.tolist() == [11]
    assert r.accepted_tokens.tolist() == [[5, 9, 11, 11, 11, 11]]
    assert r.commit_order.tolist() == [0, 1, 4, 2, 3, 5]
    r = kdtree_ops.accept_retrieve(nxt, sib, cand, target, 1)  # accept_index width 2
    assert r.accepted.tolist() == [[0, 1]] and r.bonus.tolist() == [9] and r.commit_order.tolist() == [0, 1, 2, 3, 4, 5]


def test_flat_custom_mask_num_nodes_reference():
    lp, tok, _ = sglang_tree_case(3, 4, 30, 20, "ties", seed=1)
    tree = kdtree_ops.sglang_build_tree(lp, tok, 20)
    D = 21
    packed = kdtree_ops.pack_tree_mask(tree.visibility.reshape(3 * D, D)).view(3, D, -1)
    prefix = torch.tensor([4, 0, 9])
    sizes = tree.tree_sizes.clone()
    sizes[1] = 5
    size = kdtree_ops.flat_mask_size(13, 3, D)
    mask, indptr = kdtree_ops.flat_custom_mask(packed, prefix, size + 3, sizes)
    for b, (P, n) in enumerate(zip(prefix.tolist(), sizes.tolist())):
        block = mask[int(indptr[b]) : int(indptr[b + 1])].view(D, P + D)
        assert block[:n, :P].all() and not block[n:].any() and not block[:, P + n :].any()
        assert torch.equal(block[:n, P : P + n], tree.visibility[b, :n, :n])
    assert not mask[size:].any()


@needs_gpu
def test_flat_custom_mask_num_nodes_cuda_matches_reference():
    g = torch.Generator().manual_seed(3)
    for i, (bs, L, V, budget, kind, _, _) in enumerate(sglang_tree_configs(30, seed=7)):
        lp, tok, chain = sglang_tree_case(bs, L, V, budget, kind, seed=i)
        tree = kdtree_ops.sglang_build_tree(lp, tok, budget, chain=chain)
        D = budget + 1
        packed = kdtree_ops.pack_tree_mask(tree.visibility.reshape(bs * D, D)).view(bs, D, -1)
        prefix = torch.randint(0, 2000, (bs,), generator=g, dtype=[torch.int32, torch.int64][i % 2])
        sizes = tree.tree_sizes.to([torch.int64, torch.int32][i % 3 % 2])
        size = kdtree_ops.flat_mask_size(int(prefix.sum()), bs, D)
        for cap in (size, size + 41, max(size - 999, 0)):
            got = kdtree_ops.flat_custom_mask(packed.cuda(), prefix.cuda(), cap, sizes.cuda())
            want = kdtree_ops.flat_custom_mask(packed, prefix, cap, sizes)
            assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), (i, cap)


# ---- main job ----


def test_main_runs_a_checked_round_on_cpu(capsys):
    """`python bench_ops.py` (the main job) at tiny sizes: the self-check and every stage of the DDTree round
    run, are checked and show up in the stage table."""
    sizes = {"batch": 3, "context": 40, "budget": 12, "heads": 2, "layers": 2, "depth": 5, "vocab": 300}
    argv = ["--device", "cpu"] + [a for k, v in sizes.items() for a in (f"--{k}", str(v))]
    assert bench_ops.main(argv) == 0
    table = capsys.readouterr().out.split("SGLang path ms")[1]
    for stage in ("draft_topk", "build_tree", "verify_metadata", "kv_write", "verify_attn", "accept_walk",
                  "commit_accept", "defragment"):
        assert any(line.startswith(stage) and " ok: " in line for line in table.splitlines()), stage
    assert "FAIL" not in table and "all checks passed" in table


# ---- Device guards: out-of-range data on CUDA, graph-safe (no host sync) ----
# An index outside its tensor never reaches memory: the kernels give the affected rows a
# defined value (NaN) and raise a flag in host-mapped memory, read by kdtree_ops.guard_errors().

GUARD_SLOT, GUARD_INDPTR, GUARD_MASK = (kdtree_ops.GUARDS[i] for i in range(3))
GUARD_FP8 = kdtree_ops.GUARDS[4]


def test_guard_names_follow_the_cuda_enum():
    """kdtree_ops.GUARDS names the guard words in the order of common.cuh's Guard enum, each
    entry naming the op its enumerator's comment names (guard_errors() indexes GUARDS by word)."""
    source = (kdtree_ops.SRC_DIR / "common.cuh").read_text()
    enum = source[source.index("enum Guard : int {"):source.index("kGuardCount")]
    ops = re.findall(r"^\s*kGuard\w+(?: = 0)?,\s*// ([a-z_0-9]+)", enum, re.MULTILINE)
    assert len(ops) == len(kdtree_ops.GUARDS), (ops, kdtree_ops.GUARDS)
    for op, name in zip(ops, kdtree_ops.GUARDS):
        assert f"({op}" in name, (op, name)


def poisoned_requests(out, lse, qo_indptr, bad):
    """Rows of requests in `bad` are NaN in out and lse; every other row is finite."""
    qo = qo_indptr.tolist()
    for b in range(len(qo) - 1):
        rows = slice(qo[b], qo[b + 1])
        if b in bad:
            assert torch.isnan(out[rows]).all() and torch.isnan(lse[rows]).all(), b
        else:
            assert torch.isfinite(out[rows]).all(), b


@needs_gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("slot", ["past_pool", "negative", "huge", "beyond_int32"])
@pytest.mark.parametrize("hint", [None, 64], ids=["splits", "one_split"])
def test_verify_guard_slot_out_of_range(verify_kernel, index_dtype, slot, hint):
    """A prefix slot outside kv_cache: its request's rows come out NaN, the others exact, the
    guard raised (and cleared by reading it). beyond_int32: an int64 slot whose low 32 bits
    name a good row (the Hopper kernel reads int64 slots as int32)."""
    if slot == "beyond_int32" and index_dtype == torch.int32:
        pytest.skip("an int32 slot cannot lie beyond int32")
    case = make_verify_case([1500, 700, 2100], [9, 5, 13], 16, index_dtype=index_dtype)
    S = case["kv_cache"].shape[0]
    bad = {"past_pool": S, "negative": -1, "huge": 2**31 - 5 if index_dtype == torch.int32 else 2**40,
           "beyond_int32": 2**32 + int(case["kv_indices"][0])}[slot]
    good = case["kv_indices"].clone()
    case["kv_indices"][1500 + 333] = bad
    kdtree_ops.guard_errors()
    out, lse = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=hint)
    torch.cuda.synchronize()
    poisoned_requests(out, lse, case["qo_indptr"], {1})
    assert kdtree_ops.guard_errors() == [GUARD_SLOT]
    assert kdtree_ops.guard_errors() == []
    case["kv_indices"] = good
    ref_out, ref_lse = verify_reference(case)
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[9:14] = False
    assert rel_err(out[keep], ref_out[keep]) < 1e-2


@needs_gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_verify_refuses_a_pool_of_2_31_rows(index_dtype):
    """The Hopper kernel holds a slot as an int32, so a kv_cache of 2^31 rows is refused with
    a message (a stride-0 view makes one without the 2.4 TB)."""
    case = make_verify_case([40, 7], [3, 2], 2, index_dtype=index_dtype)
    case["kv_cache"] = case["kv_cache"][:1].expand(2**31, 576)
    with pytest.raises(RuntimeError, match=re.escape("kv_cache must have fewer than 2^31 rows, got 2147483648")):
        kdtree_ops.verify_attn(*verify_args(case))


@needs_gpu
@pytest.mark.parametrize("defect", ["k_scale_0", "k_scale_negative", "k_scale_inf", "k_scale_subnormal", "tree_k_beyond_f16"])
def test_verify_guard_fp8_range(verify_kernel, defect):
    """An fp8 pool's k_scale tensor holding a value the kernels cannot divide by (every row
    NaN), or a tree_k value past 65504 x k_scale, which f16 cannot hold in the pool's units
    (that request's rows NaN, the others exact): the guard is raised either way."""
    case, _ = fp8_pool(make_verify_case([1500, 700, 2100], [9, 5, 13], 16), torch.uint8, 0.37)
    bad = {0, 1, 2}
    if defect == "tree_k_beyond_f16":
        case["tree_k"][9 + 3, 100] = 70000 * 0.37
        bad = {1}
    else:
        case["k_scale"].fill_({"k_scale_0": 0.0, "k_scale_negative": -0.37, "k_scale_inf": math.inf,
                               "k_scale_subnormal": 1e-39}[defect])
    kdtree_ops.guard_errors()
    out, lse = kdtree_ops.verify_attn(*verify_args(case), k_scale=case["k_scale"])
    torch.cuda.synchronize()
    poisoned_requests(out, lse, case["qo_indptr"], bad)
    assert kdtree_ops.guard_errors() == [GUARD_FP8]
    if defect == "tree_k_beyond_f16":
        case["tree_k"][9 + 3, 100] = 60000 * 0.37  # within f16 in the pool's units: served
        out, lse = kdtree_ops.verify_attn(*verify_args(case), k_scale=case["k_scale"])
        torch.cuda.synchronize()
        poisoned_requests(out, lse, case["qo_indptr"], set())
        assert kdtree_ops.guard_errors() == []


MALFORMED_BATCHES = {
    "kv_indptr_decreasing": lambda c: c["kv_indptr"].__setitem__(2, 10),
    "kv_indptr_past_indices": lambda c: c["kv_indptr"].__setitem__(-1, c["kv_indices"].shape[0] + 1),
    "kv_indptr_not_from_0": lambda c: c["kv_indptr"].__setitem__(0, -3),
    "qo_indptr_short_of_T": lambda c: c["qo_indptr"].__setitem__(-1, c["q"].shape[0] - 1),
    "qo_indptr_decreasing": lambda c: c["qo_indptr"].__setitem__(1, 50),
    "nodes_past_mask_words": lambda c: c.__setitem__("tree_mask", c["tree_mask"][:, :1].contiguous()),
}


@needs_gpu
@pytest.mark.parametrize("defect", list(MALFORMED_BATCHES))
@pytest.mark.parametrize("hint", [None, 64], ids=["splits", "one_split"])
def test_verify_guard_malformed_batch(verify_kernel, defect, hint, monkeypatch):
    """Indptrs that do not describe the batch: every output row NaN, nothing read out of
    bounds, the guard raised; KDTREE_CHECK=1 turns the same defect into an error."""
    case = make_verify_case([1500, 700, 2100], [9, 35, 13], 16)
    MALFORMED_BATCHES[defect](case)
    kdtree_ops.guard_errors()
    out, lse = kdtree_ops.verify_attn(*verify_args(case), max_kv_len=hint)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    assert kdtree_ops.guard_errors() == [GUARD_INDPTR]
    monkeypatch.setenv("KDTREE_CHECK", "1")
    with pytest.raises(RuntimeError, match="indptr|tree_mask"):
        kdtree_ops.verify_attn(*verify_args(case))


@needs_gpu
def test_verify_guard_in_graph_replay(verify_kernel):
    """Captured once; replayed with a bad slot, then with good data again: NaN rows and the
    flag only on the bad replay (the guard needs no host sync, so it works inside graphs)."""
    case = make_verify_case([1500, 40], [9, 13], 16, pool=4000)
    static = verify_args(case)[:-1]
    run = lambda: kdtree_ops.verify_attn(*static, case["sm_scale"], max_kv_len=2048)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    good = case["kv_indices"].clone()
    kdtree_ops.guard_errors()
    case["kv_indices"][1500 + 7] = 4000 + 9
    graph.replay()
    torch.cuda.synchronize()
    poisoned_requests(out, lse, case["qo_indptr"], {1})
    assert kdtree_ops.guard_errors() == [GUARD_SLOT]
    case["kv_indices"].copy_(good)
    graph.replay()
    torch.cuda.synchronize()
    assert_verify_close(out, lse, case)
    assert kdtree_ops.guard_errors() == []


@needs_gpu
@pytest.mark.parametrize("defect", ["mask_indptr_past_mask", "mask_indptr_negative", "kv_indptr_decreasing"])
def test_sglang_mask_guard(defect):
    """SGLang's flat mask with indptrs that point outside custom_mask: the row reads nothing,
    gets no bits, and the guard is raised; the other requests' rows are exact."""
    case = make_verify_case([40, 7, 19], [9, 5, 13], 2)
    flat, mask_indptr = (t.cuda() for t in sglang_flat_mask(case))
    qo, kvp = case["qo_indptr"].long(), case["kv_indptr"].clone()
    good = kdtree_ops.sglang_mask_to_packed(flat, mask_indptr, qo, kvp, num_rows=27, max_nodes=13)
    if defect == "mask_indptr_past_mask":
        mask_indptr[1] = flat.numel() - 3
    elif defect == "mask_indptr_negative":
        mask_indptr[1] = -50
    else:
        kvp[2] = kvp[1] - 1  # request 1's prefix length negative
    kdtree_ops.guard_errors()
    packed = kdtree_ops.sglang_mask_to_packed(flat, mask_indptr, qo, kvp, num_rows=27, max_nodes=13)
    torch.cuda.synchronize()
    assert kdtree_ops.guard_errors() == [GUARD_MASK]
    assert (packed[9:14] == 0).all() and torch.equal(packed[:9], good[:9])
    if defect != "kv_indptr_decreasing":  # that one also shifts request 2's prefix
        assert torch.equal(packed[14:], good[14:])


def test_hook_device_guard_trip_falls_back(sgl, spy, caplog, monkeypatch):
    """A tripped device guard, read when the next step's metadata is built: one error naming
    it; from then on SGLang's path serves the verify calls, and SGLang's CUDA-graph runner
    stops replaying TARGET_VERIFY batches (a graph captured with our kernels cannot switch)."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    b = spy_step(sgl, spy)
    sglang_hook.install("on")
    st, layer = sglang_hook._STATE, b.srv.runner.layer(0)
    reads = [[], [kdtree_ops.GUARDS[0]]]
    monkeypatch.setattr(kdtree_ops, "guard_errors", lambda clear=True: reads.pop(0) if reads else [])
    b.backend.init_forward_metadata(b.step.fb)
    assert not torch.all(call_spied(b, layer) == 7) and st.ours == 1
    assert DecodeCudaGraphRunner.can_run_graph.__wrapped__ is not None
    with caplog.at_level(_logging.WARNING, logger="kdtree_ops"):
        b.backend.init_forward_metadata(b.step.fb)
        for _ in range(2):
            assert torch.all(call_spied(b, layer) == 7)
    assert (st.ours, st.fallbacks) == (1, 2) and kdtree_ops.GUARDS[0] in st.guard_tripped
    assert DecodeCudaGraphRunner.can_run_graph(None, b.step.fb) is False
    errors = [r.getMessage() for r in caplog.records if r.name == "kdtree_ops" and r.levelno >= _logging.ERROR]
    assert len(errors) == 1 and kdtree_ops.GUARDS[0] in errors[0]


@needs_gpu
def test_hook_device_guard_on_gpu(sgl):
    """A prefix slot outside the pool in SGLang's own kv_indices (as a corrupted req_to_token
    would give): the kernel reads nothing outside the pool and leaves that request's rows NaN,
    the other requests' rows are SGLang's; the next step reads the guard and SGLang serves."""
    srv = hook_server(sgl, "cuda", N=9, layers=2, heads=16, pool_size=1 << 14, max_context=4096)
    r = srv.runner
    g = torch.Generator().manual_seed(5)
    r.fill(g)
    sglang_hook.install("on")
    st, layer = sglang_hook._STATE, r.layer(0)
    kdtree_ops.guard_errors()
    prefix_lens = [300, 17, 1000]
    step = sgl.verify_step(r, prefix_lens, hook_spec(srv, prefix_lens, g), generator=g)
    r.backend.init_forward_metadata(step.fb)
    md = r.backend.forward_metadata
    good = md.kv_indices.clone()
    md.kv_indices[int(md.kv_indptr[1]) + 3] = r.kv_pool.kv_buffer[0].shape[0] + 1000
    q, k, v = sgl.layer_inputs(r, step.T, g)
    ours = r.backend.forward_extend(q, k, v, layer, step.fb).view(step.T, r.heads, 512).clone()
    torch.cuda.synchronize()
    assert st.ours == 1 and st.guard_tripped is None
    md.kv_indices.copy_(good)
    ref = sglang_forward(r.backend, q, k, v, layer, step.fb).view(step.T, r.heads, 512)
    qo = md.qo_indptr.tolist()
    assert torch.isnan(ours[qo[1] : qo[2]]).all()
    keep = torch.ones(step.T, dtype=torch.bool)
    keep[qo[1] : qo[2]] = False
    rows_close(ours[keep].flatten(1), ref[keep].flatten(1), r.heads, ROW_TOL["cuda"])
    r.backend.init_forward_metadata(step.fb)  # the next step: the guard is read here
    assert st.guard_tripped == GUARD_SLOT
    r.backend.forward_extend(q, k, v, layer, step.fb)
    assert (st.ours, st.fallbacks) == (1, 1)


@needs_gpu
@pytest.mark.parametrize("disjoint", [False, True])
def test_move_kv_guard(disjoint):
    """A slot past the pool on CUDA (without check mode): that pair moves nothing, the other
    pairs move, and the guard is raised."""
    kv = kv_pool(10, (8,), torch.bfloat16, 2, "cuda")
    before = [t.clone() for t in kv]
    kdtree_ops.guard_errors()
    kdtree_ops.move_kv(kv, torch.tensor([1, 10**6], device="cuda"), torch.tensor([5, 6], device="cuda"), disjoint=disjoint)
    torch.cuda.synchronize()
    assert kdtree_ops.guard_errors() == [kdtree_ops.GUARDS[3]]
    for t, b in zip(kv, before):  # bit patterns: the pool's random bits hold NaNs
        assert torch.equal(t[5].view(torch.int16), b[1].view(torch.int16))
        assert torch.equal(t[6].view(torch.int16), b[6].view(torch.int16))


@needs_gpu
def test_tree_kernels_stay_in_bounds_on_bad_links():
    """Parents and sibling/child links outside the tree (no guard flag: these kernels ignore
    such a link) never make verify_metadata, accept_walk or accept_retrieve read or write
    outside their tensors (run under compute-sanitizer: see BENCHMARKS.md); outputs stay in
    their ranges."""
    _, tree, prefix_lens, target = tree_samples("cuda", 0)
    N = tree.parents.shape[1]
    parents = tree.parents.clone()
    parents[0, 5], parents[1, 7], parents[2, 3] = N + 3, -7, 2**31 - 1
    bad = kdtree_ops.Tree(tree.tokens, parents, tree.depths, None, None)
    md = kdtree_ops.verify_metadata(bad, prefix_lens, retrieve=True)
    walk = kdtree_ops.accept_walk(bad, target, 5)
    (nxt, sib, cand, tgt), _ = retrieve_case(3, 5, 70, 24, DDTREE_KINDS[0], 0, "cuda")
    D = nxt.shape[1]
    nxt[0, 0], sib[1, 1], nxt[2, 2] = D + 5, 10**6, -(2**40)
    ret = kdtree_ops.accept_retrieve(nxt, sib, cand, tgt, 5)
    torch.cuda.synchronize()
    assert md.positions.shape[0] == 3 * N
    for accepted, accept_len in (walk[:2], ret[:2]):  # (accepted, accept_len, ...) both
        assert ((accept_len >= 1) & (accept_len <= 6)).all()
        assert ((accepted >= -1) & (accepted < max(N, D))).all()
