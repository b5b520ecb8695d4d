"""sglang_hook: run SGLang's MLA tree-verify attention on kdtree_ops, without patching SGLang.

SGLang (0.5.23) sends every TARGET_VERIFY forward of an MLA model through
``TritonAttnBackend.forward_extend``, whose Triton kernel re-streams the whole prefix once per
head. :func:`install` wraps that method: the target model's MLA verify calls it can serve
(576/512 with one KV head, any page size; a bf16/fp16 pool in q's dtype with no KV scale or a
scale of 1.0, or SGLang's fp8 e4m3 pool with equal k and v scales; causal attention without
sliding window, logit cap, sinks or score_mod; a tree custom mask or none; int32 or int64
index tensors, eager or from the CUDA-graph buffers) save KV exactly as SGLang does and then
run :func:`kdtree_ops.verify_attn` into SGLang's own output buffer. Other target calls (an
e5m2 pool, k_scale != v_scale on an fp8 pool, ...), and any call that raises, go to SGLang's
method unchanged, each reason logged once (logger ``"kdtree_ops"``); other models' calls (a
DFlash draft, a dense model) go there silently and uncounted. The kernels load when SGLang
builds a rank's backend, after it has chosen the rank's GPU.

fp8 pools (``--kv-cache-dtype fp8_e4m3``: MLATokenToKVPool keeps e4m3 bytes as uint8): the
nodes' KV is saved as SGLang's MLA path saves it (``k / layer.k_scale`` rounded to e4m3), and
prefix rows are read as ``e4m3 * k_scale`` for keys and values, k_scale being the python
float SGLang hands its own kernel (``layer.k_scale_float`` when the layer has both scales,
else 1.0), so a captured CUDA graph bakes it in as SGLang's does; the nodes' own k enter
unscaled, in q's dtype, as in SGLang's kernel. SGLang's Triton kernel also rounds q and the
softmax weights to e4m3 for the prefix part; kdtree_ops does not, so on fp8 pools validate's
error is mostly that rounding of SGLang's.

Environment
-----------
KDTREE_VERIFY         ``off`` (default: nothing patched), ``validate`` (SGLang's result is
                      returned; ours is computed beside it and the error logged) or ``on``.
KDTREE_LOG_EVERY      verify steps between summaries (validate / profile), default 100.
KDTREE_VALIDATE_TOL   relative error (max |ours - sglang| / max |sglang| per layer) above
                      which validate warns, default 0.02 (bf16 rounding of the output is ~0.4%;
                      on fp8 pools SGLang's own e4m3 rounding of q and P comes on top).
KDTREE_PROFILE=1      per-phase timings of verify steps (CUDA events, eager steps only).
KDTREE_DEFRAG=1       compact fragmented requests' KV slots between verify steps (defrag.py).
KDTREE_DEFRAG_BUDGET_MB, KDTREE_DEFRAG_EVERY
                      bytes defrag may copy per call (default 256) and steps between calls
                      (default 16).

With SGLang's DDTree (PR #29907) present, its tree build, EAGLE-format conversion, flat verify
mask and greedy acceptance are replaced by kdtree_ops ops with identical results (section
"DDTree" below); without it nothing of that is patched.

Every process that should be hooked has to import kdtree_ops (which installs the hook when
KDTREE_VERIFY is set): SGLang starts one scheduler process per TP rank, so put
``import kdtree_ops`` in a ``sitecustomize.py`` on the servers' PYTHONPATH. The patch is
applied when SGLang's backend module is imported (an import hook), never by importing SGLang
early from sitecustomize.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Callable, Optional

import torch

import kdtree_ops

logger = logging.getLogger("kdtree_ops")

TRITON_BACKEND = "sglang.srt.layers.attention.triton_backend"
GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
MODES = ("off", "validate", "on")

# Timed phases beside attention: (module, class or None for a module function, attribute,
# phase). Only the places SGLang 0.5.23 actually has; a missing one is skipped.
PROFILE_POINTS = (
    ("sglang.srt.speculative.dflash_info", "DFlashVerifyInput", "prepare_for_verify", "prepare_for_verify"),
    ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2", "_accept_block", "accept"),
    ("sglang.srt.speculative.eagle_worker_common", None, "eagle_sample", "accept"),
    ("sglang.srt.speculative.ngram_worker", None, "eagle_sample", "accept"),
)



def env_mode() -> str:
    """KDTREE_VERIFY as one of :data:`MODES` (unknown values read as off, with a warning)."""
    m = os.environ.get("KDTREE_VERIFY", "off").strip().lower() or "off"
    if m not in MODES:
        logger.warning("kdtree_ops: KDTREE_VERIFY=%r is not one of %s; the hook stays off", m, "|".join(MODES))
        return "off"
    return m


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------------------------
# The core: plain tensors in, SGLang's output buffer out (testable without SGLang)
# --------------------------------------------------------------------------------------------


def packed_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows: int, max_nodes: int):
    """SGLang's flat TARGET_VERIFY ``custom_mask`` as verify_attn's packed rows; None stays None
    (DFlash's chain verify). Host ints only, so it is capturable."""
    if custom_mask is None:
        return None
    return kdtree_ops.sglang_mask_to_packed(
        custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows=num_rows, max_nodes=max_nodes
    )


def verify_attention(q, kv_buffer, kv_indptr, kv_indices, qo_indptr, k, packed_mask, scaling, out, max_kv_len=None,
                     k_scale=None):
    """MLA tree-verify attention into SGLang's output buffer.

    q: [T, H*576] or [T, H, 576]; k: the nodes' latents [T, 1, 576] (or [T, 576]); kv_buffer:
    the layer's pool ``[S, 1, 576]`` (q's dtype, or fp8 e4m3 read as e4m3 * k_scale, a python
    float); the index tensors are TritonAttnBackend's forward_metadata in TARGET_VERIFY
    (prefix-only kv_indptr); out: ``[T, H*512]``. Returns out.
    """
    T = q.shape[0]
    H = out.numel() // (T * kdtree_ops.MLA_V_DIM) if T else 0
    args = (q.reshape(T, H, kdtree_ops.MLA_QK_DIM), kv_buffer, kv_indptr, kv_indices, qo_indptr,
            k.reshape(T, kdtree_ops.MLA_QK_DIM), packed_mask, scaling)
    kdtree_ops.verify_attn(*args, out=out.view(T, H, kdtree_ops.MLA_V_DIM), max_kv_len=max_kv_len, k_scale=k_scale)
    return out


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------


class _Profiler:
    """Phase timings: CUDA event pairs resolved when complete (never waited on), or host time
    for CPU tensors. Nothing is timed while a CUDA graph is being captured."""

    def __init__(self):
        self.pending: list = []  # (phase, start event, end event)
        self.total: dict = {}  # phase -> [milliseconds, count]
        self.graph_steps = 0

    @contextmanager
    def phase(self, name: str, device: torch.device):
        if _capturing():
            yield
            return
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._add(name, (time.perf_counter() - t0) * 1e3)

    def _add(self, name: str, ms: float) -> None:
        acc = self.total.setdefault(name, [0.0, 0])
        acc[0] += ms
        acc[1] += 1

    def collect(self) -> None:
        still = []
        for name, start, end in self.pending:
            if end.query():
                self._add(name, start.elapsed_time(end))
            else:
                still.append((name, start, end))
        self.pending = still

    def summary(self, steps: int) -> str:
        self.collect()
        parts = [
            f"{name} {ms / max(steps, 1):.3f} ms/step ({n} calls, {ms / n:.3f} ms/call)"
            for name, (ms, n) in sorted(self.total.items())
        ]
        self.total = {}
        if self.graph_steps:
            parts.append(f"{self.graph_steps} steps replayed from CUDA graphs are not broken down")
            self.graph_steps = 0
        return "; ".join(parts) or "nothing timed"


class _Validator:
    """Per-layer max |ours - sglang| and max |sglang|, accumulated on the device (captured
    graphs keep accumulating on replay) and read only when a summary is due."""

    LAYERS = 512

    def __init__(self, tol: float):
        self.tol = tol
        self.stats: dict = {}  # device -> Tensor [LAYERS, 2] float32: max abs err, max |ref|
        self.seen: set = set()

    def buffer(self, device: torch.device) -> Optional[torch.Tensor]:
        buf = self.stats.get(device)
        if buf is None and not _capturing():  # a fill captured into a graph would rerun on replay
            buf = self.stats[device] = torch.zeros(self.LAYERS, 2, dtype=torch.float32, device=device)
        return buf

    def add(self, layer_id: int, ours: torch.Tensor, ref: torch.Tensor) -> bool:
        buf = self.buffer(ref.device)
        if buf is None or not 0 <= layer_id < self.LAYERS:
            return False
        err = (ours.float() - ref.float()).abs().amax()
        err = torch.where(torch.isnan(err) | ~torch.isfinite(ours.float()).all(), torch.full_like(err, math.inf), err)
        row = buf[layer_id]
        row[0] = torch.maximum(row[0], err)
        row[1] = torch.maximum(row[1], ref.float().abs().amax())
        self.seen.add(layer_id)
        return True

    def summary(self, steps: int) -> tuple[str, list]:
        """(summary line, per-layer warnings past the tolerance); resets the window."""
        layers = sorted(self.seen)
        if not layers:
            return "no verify layer compared yet", []
        worst_abs, worst_rel, bad = (0.0, -1), (0.0, -1), []
        for device, buf in self.stats.items():
            rows = buf[layers].tolist()  # the one host sync of validate mode, every N steps
            buf.zero_()
            for lid, (err, ref_max) in zip(layers, rows):
                rel = err / ref_max if ref_max > 0 else (0.0 if err == 0 else math.inf)
                worst_abs = max(worst_abs, (err, lid))
                worst_rel = max(worst_rel, (rel, lid))
                if not rel <= self.tol:
                    bad.append(
                        f"layer {lid} on {device}: max abs err {err:.3g}, max |sglang| {ref_max:.3g}, "
                        f"rel {rel:.3g} > tol {self.tol:g}"
                    )
        line = (
            f"{len(layers)} layers compared: max abs err {worst_abs[0]:.3g} (layer {worst_abs[1]}), "
            f"max rel err {worst_rel[0]:.3g} (layer {worst_rel[1]}), tol {self.tol:g}"
        )
        return line, bad


class _State:
    def __init__(self, mode: str):
        self.mode = mode
        self.log_every = kdtree_ops.env_number("KDTREE_LOG_EVERY", 100, minimum=1)
        self.profile = kdtree_ops.env_flag("KDTREE_PROFILE")
        self.defrag = kdtree_ops.env_flag("KDTREE_DEFRAG")
        self.defrag_budget = kdtree_ops.env_number("KDTREE_DEFRAG_BUDGET_MB", 256, minimum=0) << 20
        self.defrag_every = kdtree_ops.env_number("KDTREE_DEFRAG_EVERY", 16, minimum=1)
        self.validator = _Validator(kdtree_ops.env_number("KDTREE_VALIDATE_TOL", 0.02, minimum=0.0, kind=float))
        self.profiler = _Profiler()
        self.steps = 0  # verify steps seen (eager and graph replays)
        self.window_start = 0
        self.ours = 0  # verify layer calls served by kdtree_ops in this window
        self.fallbacks = 0
        self.warned: set = set()
        self.patched: list = []  # (owner, attribute, original value)
        self.step_shared = weakref.WeakKeyDictionary()  # backend -> (metadata, custom_mask, batch, capturing, T, _step_shared)
        self.backends = weakref.WeakSet()  # every TritonAttnBackend that prepared a verify step
        self.local = threading.local()
        self.defrag_off: Optional[str] = None
        self.guard_tripped: Optional[str] = None  # the kernels' device guards (kdtree_ops.guard_errors)


_STATE: Optional[_State] = None
_FINDER: Optional["_PostImportFinder"] = None
_LOCK = threading.RLock()


def _warn_once(reason: str, detail: str = "") -> None:
    st = _STATE
    if st is None or reason in st.warned:
        return
    st.warned.add(reason)
    logger.warning(
        "kdtree_ops: %s%s; SGLang's own path serves these verify calls (logged once per reason)",
        reason,
        f" [{detail}]" if detail else "",
    )


# --------------------------------------------------------------------------------------------
# Import hook: patch SGLang modules when they are imported, not by importing them early
# --------------------------------------------------------------------------------------------


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.callbacks: dict = {}  # module name -> [fn(module)]

    def find_spec(self, name, path=None, target=None):
        if name not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            # Taken only now: importlib.util.find_spec also asks for specs it never executes.
            for fn in self.callbacks.pop(name, []):
                _guarded(fn, module)

        loader.exec_module = exec_and_patch
        return spec


def _guarded(fn: Callable, module) -> None:
    try:
        fn(module)
    except Exception as e:  # a hook problem must never break SGLang's import
        logger.warning("kdtree_ops: could not patch %s: %s: %s; SGLang runs unpatched there", module.__name__, type(e).__name__, e)


def _when_imported(name: str, fn: Callable) -> None:
    """fn(module) now if the module is loaded, else right after its first import."""
    global _FINDER
    if name in sys.modules:
        _guarded(fn, sys.modules[name])
        return
    if _FINDER is None:
        _FINDER = _PostImportFinder()
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.callbacks.setdefault(name, []).append(fn)


def _wrapper_of(wrapper, original):
    """Mark ``wrapper`` as this hook's stand-in for SGLang's ``original``: ``_kdtree_original``
    tells our wrappers from anyone else's (``__wrapped__`` alone would not), and uninstall,
    re-patching and tests read it."""
    wrapper.__wrapped__ = wrapper._kdtree_original = original
    wrapper.__doc__ = original.__doc__
    return wrapper


def _patch(owner, attr: str, new) -> None:
    _STATE.patched.append((owner, attr, owner.__dict__[attr]))
    setattr(owner, attr, new)


# --------------------------------------------------------------------------------------------
# TritonAttnBackend patches
# --------------------------------------------------------------------------------------------


def _serves_target_mla(backend) -> bool:
    """Whether this backend runs the target model's MLA attention: the only verify calls the
    hook takes. A draft model's runner (DFlash drafts run TARGET_VERIFY through a Triton
    backend of their own) and non-MLA models stay on SGLang's path, silently."""
    return bool(getattr(backend, "use_mla", False)) and not getattr(backend, "is_draft_runner", False)


_INDEX_DTYPES = (torch.int32, torch.int64)
_MLA_LAYER = (kdtree_ops.MLA_QK_DIM, kdtree_ops.MLA_V_DIM, 1)  # qk dims, v dims, KV heads
_FP8_E4M3 = torch.float8_e4m3fn  # what SGLang's fp8 MLA pool holds (as uint8) for --kv-cache-dtype fp8_e4m3


def _kv_descales(layer) -> tuple:
    """The (k, v) descales SGLang's Triton forward_extend passes its kernel: the layer's
    scales when it has both, else 1.0 (the same condition, read the same way)."""
    if layer.k_scale is not None and layer.v_scale is not None:
        return layer.k_scale_float, layer.v_scale_float
    return 1.0, 1.0


def _scale_reason(layer, pool_dtype: torch.dtype) -> Optional[str]:
    """KV scales the hook serves. An fp8 e4m3 pool: any finite scale >= 2^-126 equal for k
    and v (kdtree_ops reads keys and values from one row dequantized once; SGLang's kernel
    scales its keys by k_scale and its values by v_scale). A bf16/fp16 pool: none, or
    exactly 1.0 for both (FP8 checkpoints such as DeepSeek-V3/R1 and Kimi K2 give every layer
    k_scale = v_scale = 1.0 even when the pool is bf16; SGLang then divides k by 1.0 before
    saving it, which changes no bit)."""
    if layer.k_scale is None and layer.v_scale is None:
        return None
    if pool_dtype == _FP8_E4M3:
        k_descale, v_descale = _kv_descales(layer)
        if k_descale != v_descale:
            return f"k_scale {k_descale} != v_scale {v_descale} on an fp8 KV cache"
        if not (isinstance(k_descale, float) and kdtree_ops.k_scale_usable(k_descale)):
            return f"fp8 KV cache scale {k_descale!r} (a finite float >= 2^-126 is served)"
        return None
    k_scale, v_scale = getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)
    if k_scale == 1.0 and v_scale == 1.0:
        return None
    return f"KV scales k_scale={k_scale}, v_scale={v_scale} over a {pool_dtype} pool (only 1.0 is served)"


def _unsupported(backend, q, k, v, layer, fb, extra: dict) -> Optional[str]:
    """Why our path cannot serve this target-MLA TARGET_VERIFY call exactly as SGLang would
    (None: it can)."""
    if _STATE.guard_tripped:
        return f"a device guard tripped ({_STATE.guard_tripped})"
    for name in ("sinks", "score_mod", "aux_tensors"):
        if extra.get(name) is not None:
            return f"{name} is set"
    unknown = sorted(n for n, val in extra.items() if n not in ("save_kv_cache", "sinks", "score_mod", "aux_tensors") and val is not None)
    if unknown:
        return f"unknown forward_extend arguments {unknown}"
    if k is None or v is None:
        return "k/v not given (KV read back from the pool)"
    T, H = q.shape[0], layer.tp_q_head_num
    if q.numel() != T * H * kdtree_ops.MLA_QK_DIM or k.numel() != T * kdtree_ops.MLA_QK_DIM:
        return f"unexpected q/k shapes {tuple(q.shape)}/{tuple(k.shape)}"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        return f"q/k dtypes {q.dtype}/{k.dtype} (kdtree_ops runs bfloat16 and float16)"
    # Any --page-size: the MLA pool keeps a row per token slot and kv_indices are token slots
    # (the Triton kernel's page arithmetic lands on the same rows); pages make runs of slots.
    kv = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    if kv.dtype == torch.float8_e5m2:
        return "fp8 e5m2 KV cache (kdtree_ops reads e4m3 fp8 pools)"
    if kv.dtype not in (q.dtype, _FP8_E4M3) or kv.shape[-1] != kdtree_ops.MLA_QK_DIM:
        return f"KV pool stores {kv.dtype} rows of {kv.shape[-1]} (q is {q.dtype})"
    scale = _scale_reason(layer, kv.dtype)
    if scale:
        return scale
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        return "sliding-window layer"
    if layer.logit_cap and layer.logit_cap > 0:
        return "logit cap"
    if (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        return "xai temperature scaling"
    if layer.is_cross_attention or getattr(layer.attn_type, "value", "decoder") != "decoder":
        return f"non-causal attention ({layer.attn_type})"
    if getattr(backend, "dcp_size", 1) > 1:
        return "decode context parallelism (dcp_size > 1)"
    if getattr(backend, "enable_deterministic", False):
        return "deterministic inference (SGLang's batch-invariant kernel is kept)"
    if getattr(backend, "dllm_attention", None) is not None:
        return "diffusion-LM attention"
    can_fp8 = getattr(backend, "_can_run_dense_fp8_chunked_mha", None)
    if can_fp8 is not None and can_fp8(q, k, v, layer, fb):
        return "dense fp8 chunked MHA"
    md = backend.forward_metadata
    if md is None or md.qo_indptr is None or md.kv_indptr is None or md.kv_indices is None:
        return "verify metadata missing"
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "mask_indptr"):
        t = getattr(md, name)
        if t is not None and t.dtype not in _INDEX_DTYPES:
            return f"{name} of dtype {t.dtype}"
    if md.custom_mask is not None:
        if md.mask_indptr is None or md.custom_mask.dtype not in (torch.bool, torch.uint8):
            return f"custom mask of dtype {md.custom_mask.dtype} without usable mask_indptr"
        if not isinstance(md.max_extend_len, int) or md.max_extend_len < 1:
            return f"max_extend_len {md.max_extend_len!r} is not a node count"
    if q.device.type == "cuda":
        return _kernels_reason()
    return None


def _kernels_reason() -> Optional[str]:
    """None when the CUDA kernels are loaded in this process (loading them if needed)."""
    try:
        if kdtree_ops.load():
            return None
        return "kdtree_ops CUDA kernels are not loaded in this process (KDTREE_NO_BUILD=1?)"
    except Exception as e:
        return f"kdtree_ops CUDA kernels could not be built or loaded ({type(e).__name__}: {e})"


def _step_shared(backend, md, fb, T: int):
    """What every layer of a verify step shares, worked out by its first layer: the packed tree
    mask (None for a causal chain), the prefix indices for an fp8 pool (_prefix_indices) and
    the longest prefix (_prefix_bound).

    Keyed on the metadata object, its mask tensor and the forward batch (a new step builds new
    ones) and on whether a graph is being captured: SGLang's warm-up runs use the capture's
    metadata eagerly, and a conversion made there would not be recorded into the graph.
    """
    capturing = _capturing()
    hit = _STATE.step_shared.get(backend)
    if (hit is not None and hit[0] is md and hit[1] is md.custom_mask and hit[2] is fb and hit[3] == capturing
            and hit[4] == T):
        return hit[5]
    packed = None
    if md.custom_mask is not None:
        packed = packed_tree_mask(md.custom_mask, md.mask_indptr, md.qo_indptr, md.kv_indptr, T, md.max_extend_len)
    shared = (packed, _prefix_indices(backend, md), _prefix_bound(fb))
    _STATE.step_shared[backend] = (md, md.custom_mask, fb, capturing, T, shared)
    return shared


def _prefix_bound(fb) -> Optional[int]:
    """Longest prefix in the batch from host data (eager only; a captured graph must serve
    every later batch, so it gets no bound)."""
    if _capturing():
        return None
    lens = getattr(fb, "seq_lens_cpu", None)
    if lens is None or lens.numel() == 0 or lens.device.type != "cpu":
        return None
    return int(lens.max())


def _prefix_indices(backend, md):
    """The prefix slots of the batch, cut to what its requests can hold: each prefix is at most
    the model's context length, the bound SGLang's own over-allocated index buffers assume.

    Under CUDA graphs SGLang passes its whole graph buffer (max tokens x context length
    entries). verify_attn sizes the widened fp8 route's workspace by the length it is given
    and skips the route past 1 GiB, so uncut it would never run there. Only fp8 pools' calls
    get the cut tensor: no other call's work depends on its length."""
    ctx = getattr(backend, "max_context_len", None)
    if not isinstance(ctx, int) or ctx < 1:
        return md.kv_indices
    bound = (md.kv_indptr.numel() - 1) * ctx
    return md.kv_indices[:bound] if md.kv_indices.numel() > bound else md.kv_indices


def _ours(tb, backend, q, k, v, layer, fb, save_kv_cache: bool, out: Optional[torch.Tensor] = None):
    """Our TARGET_VERIFY forward_extend: SGLang's KV save, then verify_attn into o."""
    md = backend.forward_metadata
    T, H = q.shape[0], layer.tp_q_head_num
    if save_kv_cache:  # the exact calls SGLang's forward_extend makes for an MLA layer
        loc_info = tb.KVWriteLoc.for_batch(fb, swa_loc=md.swa_out_cache_loc)
        if layer.k_scale is None:
            backend._set_kv_buffer(fb, layer, loc_info, k, v)
        else:
            backend.token_to_kv_pool.set_kv_buffer(layer, loc_info, k.clone().div_(layer.k_scale), v)
    if out is None:
        out = getattr(fb, "_attn_output", None)
        if out is None:
            out = q.new_empty((T, H * layer.v_head_dim))
    prof = _STATE.profiler if _STATE.profile else None
    with prof.phase("mask", q.device) if prof else _null():
        packed, fp8_indices, prefix_bound = _step_shared(backend, md, fb, T)
    kv = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    fp8 = kv.dtype == _FP8_E4M3
    # A python float, as SGLang passes its kernel: a per-layer constant a CUDA graph bakes in.
    k_scale = _kv_descales(layer)[0] if fp8 else None
    with prof.phase("attn.kdtree", q.device) if prof else _null():
        verify_attention(
            q,
            kv,
            md.kv_indptr,
            fp8_indices if fp8 else md.kv_indices,
            md.qo_indptr,
            k,
            packed,
            layer.scaling,
            out,
            max_kv_len=prefix_bound,
            k_scale=k_scale,
        )
    return out


@contextmanager
def _null():
    yield


def _make_forward_extend(tb, original):
    sig = inspect.signature(original)

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        st = _STATE
        if (
            st is None
            or st.mode == "off"
            or not forward_batch.forward_mode.is_target_verify()
            or not _serves_target_mla(self)
            or (layer.qk_head_dim, layer.v_head_dim, layer.tp_k_head_num) != _MLA_LAYER
        ):
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        prof = st.profiler if st.profile else None
        try:
            bound = sig.bind(self, q, k, v, layer, forward_batch, *args, **kwargs)
            bound.apply_defaults()
            extra = {n: val for n, val in bound.arguments.items() if n not in ("self", "q", "k", "v", "layer", "forward_batch")}
            reason = _unsupported(self, q, k, v, layer, forward_batch, extra)
        except Exception as e:
            reason = f"could not inspect the call ({type(e).__name__}: {e})"
        if reason is not None:
            _warn_once(reason)
            st.fallbacks += 1
            with prof.phase("attn.sglang", q.device) if prof else _null():
                return original(self, q, k, v, layer, forward_batch, *args, **kwargs)

        if st.mode == "validate":
            with prof.phase("attn.sglang", q.device) if prof else _null():
                ref = original(self, q, k, v, layer, forward_batch, *args, **kwargs)
            try:
                ours = _ours(tb, self, q, k, v, layer, forward_batch, save_kv_cache=False, out=torch.empty_like(ref))
                if st.validator.add(layer.layer_id, ours, ref):
                    st.ours += 1
                else:
                    _warn_once("validate: error statistics unavailable for graphs captured before any eager verify step")
            except Exception as e:
                _warn_once(f"exception in kdtree_ops' path: {type(e).__name__}", str(e))
            return ref

        try:
            out = _ours(tb, self, q, k, v, layer, forward_batch, save_kv_cache=bool(extra.get("save_kv_cache", True)))
            st.ours += 1
            return out
        except Exception as e:
            # KV was saved (or not) identically either way: SGLang's path saves again, idempotently.
            _warn_once(f"exception in kdtree_ops' path: {type(e).__name__}", str(e))
            st.fallbacks += 1
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)

    return _wrapper_of(forward_extend, original)


def _make_metadata_hook(original, in_capture_arg: bool):
    """Wrap init_forward_metadata(_out_graph): runs once per step, eagerly, also before a
    graph replay, so it is where steps are counted, caches reset, summaries logged."""

    def hooked(self, forward_batch, *args, **kwargs):
        st = _STATE
        local = st.local if st is not None else None
        outer = local is not None and not getattr(local, "depth", 0)
        if outer and forward_batch.forward_mode.is_target_verify():
            in_capture = bool(args[0] if args else kwargs.get("in_capture", False)) if in_capture_arg else False
            try:
                _on_verify_step(self, forward_batch, in_capture, replay=in_capture_arg and not in_capture)
            except Exception as e:
                logger.warning("kdtree_ops: step bookkeeping failed (%s: %s); continuing", type(e).__name__, e)
        if local is None:
            return original(self, forward_batch, *args, **kwargs)
        local.depth = getattr(local, "depth", 0) + 1
        try:
            return original(self, forward_batch, *args, **kwargs)
        finally:
            local.depth -= 1

    return _wrapper_of(hooked, original)


def _guards_tripped() -> bool:
    """Read the kernels' device guards (no sync). A trip means SGLang handed our kernels
    indices outside their tensors: the kernels read nothing out of bounds and wrote NaN
    rows, and from now on SGLang's own path serves every verify call (eager, and graphs stop
    replaying: see _make_can_run_graph)."""
    st = _STATE
    if st.guard_tripped is None:
        tripped = kdtree_ops.guard_errors()
        if tripped:
            st.guard_tripped = "; ".join(tripped)
            logger.error("kdtree_ops: device guard tripped: %s; SGLang's own path serves verify attention from now on",
                         st.guard_tripped)
    return st.guard_tripped is not None


def _on_verify_step(backend, fb, in_capture: bool, replay: bool) -> None:
    st = _STATE
    st.step_shared.pop(backend, None)
    if in_capture or _capturing() or not _serves_target_mla(backend):
        return
    _guards_tripped()
    st.steps += 1
    if replay and st.profile:
        st.profiler.graph_steps += 1
    if st.defrag and st.steps % st.defrag_every == 0:
        _maybe_defrag(backend, fb)
    if st.steps - st.window_start >= st.log_every:
        _log_summary()


def _log_summary() -> None:
    st = _STATE
    n = st.steps - st.window_start
    head = f"kdtree_ops[{st.mode}] verify steps {st.window_start + 1}-{st.steps}"
    if st.mode == "on":
        logger.info("%s: %d layer calls on kdtree_ops, %d on SGLang's path", head, st.ours, st.fallbacks)
    if st.mode == "validate":
        line, bad = st.validator.summary(n)
        logger.info("%s: %s", head, line)
        for b in bad:
            logger.warning("kdtree_ops[validate] error past tolerance: %s", b)
    if st.profile:
        logger.info("%s: profile: %s", head, st.profiler.summary(n))
    if any(st.ddtree.ours.values()) or any(st.ddtree.sglang.values()):
        logger.info("%s: DDTree calls so far: %s", head, st.ddtree.summary())
    st.window_start, st.ours, st.fallbacks = st.steps, 0, 0


def _make_init_hook(original):
    """Wrap TritonAttnBackend.__init__: SGLang builds its backends inside each rank after it
    has set the rank's device, so this is where the kernels load (built once per arch and
    cached); no import-time CUDA work, and never a first load inside a graph capture."""

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        st = _STATE
        if st is None:
            return
        try:
            st.backends.add(self)
            if _serves_target_mla(self) and str(getattr(self, "device", "cpu")).startswith("cuda"):
                reason = _kernels_reason()
                if reason:
                    _warn_once(reason)
        except Exception as e:
            logger.warning("kdtree_ops: backend setup failed (%s: %s); continuing", type(e).__name__, e)

    return _wrapper_of(init, original)


def _make_can_run_graph(original):
    """Wrap DecodeCudaGraphRunner.can_run_graph: graphs captured with our kernels cannot
    switch to SGLang's path, so once a device guard has tripped, TARGET_VERIFY batches run
    eagerly, where forward_extend falls back."""

    def can_run_graph(self, forward_batch, *args, **kwargs):
        st = _STATE
        try:
            if st is not None and forward_batch.forward_mode.is_target_verify() and _guards_tripped():
                return False
        except Exception as e:
            logger.warning("kdtree_ops: guard check failed (%s: %s); continuing", type(e).__name__, e)
        return original(self, forward_batch, *args, **kwargs)

    return _wrapper_of(can_run_graph, original)


def _patch_graph_runner(module) -> None:
    cls = module.DecodeCudaGraphRunner
    _patch(cls, "can_run_graph", _make_can_run_graph(cls.__dict__["can_run_graph"]))


def _patch_triton_backend(tb) -> None:
    cls = tb.TritonAttnBackend
    if "forward_extend" not in cls.__dict__:
        raise AttributeError("TritonAttnBackend.forward_extend not found")
    _patch(cls, "forward_extend", _make_forward_extend(tb, cls.__dict__["forward_extend"]))
    _patch(cls, "__init__", _make_init_hook(cls.__dict__["__init__"]))
    for name, has_flag in (("init_forward_metadata", False), ("init_forward_metadata_out_graph", True)):
        if name in cls.__dict__:
            _patch(cls, name, _make_metadata_hook(cls.__dict__[name], has_flag))
    logger.info("kdtree_ops: TritonAttnBackend.forward_extend hooked (KDTREE_VERIFY=%s)", _STATE.mode)


# --------------------------------------------------------------------------------------------
# Profile points outside attention
# --------------------------------------------------------------------------------------------


def _timed(original, phase: str):
    def timed(*args, **kwargs):
        st = _STATE
        if st is None or not st.profile:
            return original(*args, **kwargs)
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        with st.profiler.phase(phase, dev):
            return original(*args, **kwargs)

    return _wrapper_of(timed, original)


def _patch_profile_point(cls_name: Optional[str], attr: str, phase: str):
    def apply(module):
        owner = getattr(module, cls_name) if cls_name else module
        if attr not in owner.__dict__:
            logger.info("kdtree_ops: profile point %s.%s not in this SGLang; not timed", module.__name__, attr)
            return
        _patch(owner, attr, _timed(owner.__dict__[attr], phase))

    return apply


# --------------------------------------------------------------------------------------------
# DDTree (SGLang PR #29907): tree build, EAGLE-format conversion, verify mask and greedy
# acceptance on kdtree_ops. Patched when (and only if) SGLang imports the PR's modules.
# --------------------------------------------------------------------------------------------

DDTREE_UTILS = "sglang.srt.speculative.ddtree_utils"
DDTREE_WORKER = "sglang.srt.speculative.ddtree_worker"
DDTREE_INFO = "sglang.srt.speculative.ddtree_info"
DDTREE_CALLS = ("build_ddtree_tree", "build_eagle_tree_format", "_build_flat_tree_mask", "verify")


class DDTreeCounters:
    """Who served each DDTree call since install: ``ours`` (kdtree_ops' result was used) or
    ``sglang`` (the PR's own code); in validate mode ``compared`` and ``mismatches`` count the
    calls where kdtree_ops' result was computed beside the PR's and where they differed."""

    def __init__(self):
        self.ours = dict.fromkeys(DDTREE_CALLS, 0)
        self.sglang = dict.fromkeys(DDTREE_CALLS, 0)
        self.compared = dict.fromkeys(DDTREE_CALLS, 0)
        self.mismatches = dict.fromkeys(DDTREE_CALLS, 0)
        self.hooked: list = []  # "module.attribute" of every DDTree patch applied

    def summary(self) -> str:
        parts = []
        for name in DDTREE_CALLS:
            part = f"{name} {self.ours[name]} on kdtree_ops / {self.sglang[name]} on the PR's code"
            if self.compared[name]:
                part += f" ({self.compared[name]} compared, {self.mismatches[name]} differed)"
            parts.append(part)
        return "; ".join(parts)


class LazyChildMaps(Sequence):
    """``build_ddtree_tree``'s ``child_maps`` (per request ``{parent: {token: child}}``, every
    node a key) without a host sync in the build: a snapshot of the tree is taken on the GPU and
    copied to the host in one transfer on first access. The worker's own ``tree_is_spine`` line
    reads every map right after the build, so inside the worker that copy happens there, once
    per step. Maps list their nodes in index order; their contents equal the PR's."""

    def __init__(self, tree):
        self._snapshot = torch.cat((tree.tree_sizes[:, None], tree.parents, tree.node_tokens), 1)
        self._slots = tree.parents.shape[1]
        self._maps: Optional[list] = None

    def _materialize(self) -> list:
        if self._maps is None:
            D, maps = self._slots, []
            for row in self._snapshot.tolist():
                n, parents, tokens = row[0], row[1 : 1 + D], row[1 + D :]
                cm = {i: {} for i in range(n)}
                for i in range(1, n):
                    cm[parents[i]][tokens[i - 1]] = i
                maps.append(cm)
            self._maps, self._snapshot = maps, None
        return self._maps

    def __len__(self) -> int:
        return len(self._maps) if self._maps is not None else self._snapshot.shape[0]

    def __getitem__(self, i):
        return self._materialize()[i]

    def __eq__(self, other):
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"LazyChildMaps({self._materialize()!r})"


def _ddtree_warn_once(reason: str) -> None:
    st = _STATE
    if st is None or reason in st.warned:
        return
    st.warned.add(reason)
    logger.warning("kdtree_ops: %s; the DDTree PR's own code serves these calls (logged once per reason)", reason)


def _ddtree_fallback(name: str, reason: str, original, args, kwargs):
    _ddtree_warn_once(f"DDTree {name}: {reason}")
    _STATE.ddtree.sglang[name] += 1
    return original(*args, **kwargs)


def _ddtree_compared(name: str, differences: list) -> None:
    c = _STATE.ddtree
    c.compared[name] += 1
    if differences:
        c.mismatches[name] += 1
        key = f"validate: DDTree {name} differs"
        if key not in _STATE.warned:
            _STATE.warned.add(key)
            logger.warning("kdtree_ops[validate] DDTree %s differs from the PR's result: %s (first mismatch; "
                           "counted in the summary)", name, ", ".join(differences))


def _ddtree_device_refusal(t: torch.Tensor, what: str) -> Optional[str]:
    if t.device.type == "cpu" or (t.device.type == "cuda" and kdtree_ops.cuda_available()):
        return None
    return f"{what} on {t.device} (kdtree_ops runs on CPU or on CUDA with its kernels built)"


def _same_device(a, b) -> bool:
    def norm(d):
        d = torch.device(d)
        return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d

    return norm(a) == norm(b)


def _differences(names, ours, theirs) -> list:
    out = []
    for name, a, b in zip(names, ours, theirs):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
        else:
            same = list(a) == list(b) if isinstance(a, Sequence) and isinstance(b, Sequence) else a == b
        if not same:
            out.append(name)
    return out


def _pure_wrapper(name: str, original, prepare, fields):
    """A DDTree function without side effects beyond its outputs. ``prepare(arguments)`` gives a
    refusal reason or ``run(fresh)``, which computes kdtree_ops' result (``fresh``: into new
    tensors, never into the caller's buffers, since validate returns the PR's result)."""
    sig = inspect.signature(original)

    def wrapper(*args, **kwargs):
        st = _STATE
        if st is None or st.mode == "off" or getattr(st, "ddtree", None) is None:
            return original(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            run = prepare(bound.arguments)
        except Exception as e:
            run = f"could not inspect the call ({type(e).__name__}: {e})"
        if isinstance(run, str):
            return _ddtree_fallback(name, run, original, args, kwargs)
        if st.mode == "validate":
            theirs = original(*args, **kwargs)
            st.ddtree.sglang[name] += 1
            try:
                ours = run(True)
                pair = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
                _ddtree_compared(name, _differences(fields, *pair))
            except Exception as e:
                _ddtree_warn_once(f"validate: kdtree_ops' DDTree {name} raised {type(e).__name__}: {e}")
            return theirs
        try:
            result = run(False)
        except Exception as e:
            return _ddtree_fallback(name, f"exception in kdtree_ops' path: {type(e).__name__}: {e}", original, args, kwargs)
        st.ddtree.ours[name] += 1
        return result

    return _wrapper_of(wrapper, original)


def _prepare_build_tree(original):
    """build_ddtree_tree: draft_topk on the float32 logits (the PR's own torch.topk and
    logsumexp), then sglang_build_tree into the worker's buffers."""
    utils = sys.modules[original.__module__]

    def prepare(a):
        logits, budget, device = a["draft_logits"], a["tree_budget"], a["device"]
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            return "draft_logits is not a [bs, L, V] tensor"
        bs, L, V = logits.shape
        if not 1 <= L <= kdtree_ops.MAX_TREE_DEPTH:
            return f"draft length L={L} (kdtree_ops builds 1 to {kdtree_ops.MAX_TREE_DEPTH})"
        if not isinstance(budget, int) or not 1 <= budget <= kdtree_ops.MAX_TREE_BUDGET:
            return f"tree budget {budget!r} (kdtree_ops builds 1 to {kdtree_ops.MAX_TREE_BUDGET})"
        reason = _ddtree_device_refusal(logits, "draft_logits")
        if reason or not _same_device(device, logits.device):
            return reason or f"output device {device} differs from the logits' {logits.device}"
        from sglang.srt.environ import envs

        chain = budget == L  # the PR's spine shortcut
        k = 1 if chain else min(max(budget // L + 1, 2), V, int(envs.SGLANG_DDTREE_MAX_TOPK.get()))
        if k < 1:
            return f"top-k {k}"
        depth_bonus = float(envs.SGLANG_DDTREE_DEPTH_BONUS.get())
        stop_margin = float(utils._DDTREE_EARLY_STOP_MARGIN)
        D = budget + 1
        shapes = {"_out_node_token_ids": ((budget,), torch.int64), "_out_node_depths": ((budget,), torch.int64),
                  "_out_parents": ((D,), torch.int64), "_out_visibility": ((D, D), torch.bool)}
        views = {}
        for arg, (tail, dtype) in shapes.items():
            buf = a.get(arg)
            if buf is None or buf.shape[0] < bs:  # the PR allocates a new tensor then
                continue
            view = buf[:bs]
            if tuple(view.shape[1:]) != tail or view.dtype != dtype or not view.is_contiguous() or view.device != logits.device:
                return f"{arg} is {tuple(buf.shape)} {buf.dtype} on {buf.device}, not [>= {bs}, {tail}] {dtype} contiguous"
            views[arg] = view

        def run(fresh: bool):
            lp, tok = kdtree_ops.draft_topk(logits.float(), k)
            out = [torch.empty((bs, *tail), dtype=dtype, device=logits.device) if fresh or arg not in views
                   else views[arg] for arg, (tail, dtype) in shapes.items()]
            out.append(torch.empty(bs, dtype=torch.int64, device=logits.device))  # the PR's sizes are new too
            tree = kdtree_ops.sglang_build_tree(lp, tok, budget, depth_bonus=depth_bonus, stop_margin=stop_margin,
                                                chain=chain, out=out)
            return tree.node_tokens, tree.node_depths, tree.parents, LazyChildMaps(tree), tree.visibility, tree.tree_sizes

        return run

    return prepare


def _prepare_eagle_format(original):
    """build_eagle_tree_format: verify_metadata's retrieve arrays (children in index order, as
    the PR's), over the parents of live nodes only."""

    def prepare(a):
        parents, sizes, D, device = a["parents"], a["actual_tree_sizes"], a["draft_token_num"], a["device"]
        if not isinstance(parents, torch.Tensor) or parents.dim() != 2 or parents.shape[1] != int(D):
            return f"parents {getattr(parents, 'shape', None)} is not [bs, draft_token_num={D}]"
        bs = parents.shape[0]
        if not isinstance(sizes, torch.Tensor) or tuple(sizes.shape) != (bs,) or sizes.device != parents.device:
            return "actual_tree_sizes is not a [bs] tensor beside parents"
        if parents.dtype not in (torch.int32, torch.int64) or sizes.dtype not in (torch.int32, torch.int64):
            return f"parents / actual_tree_sizes dtypes {parents.dtype} / {sizes.dtype}"
        reason = _ddtree_device_refusal(parents, "parents")
        if reason or not _same_device(device, parents.device):
            return reason or f"output device {device} differs from the parents' {parents.device}"

        def run(fresh: bool):
            D_ = int(D)
            node = torch.arange(D_, device=parents.device)
            live_n = sizes.to(torch.int64)[:, None]
            p = parents.to(torch.int64)
            live = (node >= 1) & (node < live_n) & (p >= 0) & (p < live_n)  # what the PR's loops visit
            par = torch.where(live, p, -1).to(torch.int32)
            _, _, index, first_child, sibling = torch.ops.kdtree.verify_metadata(
                torch.zeros_like(par), par, torch.zeros(bs, dtype=torch.int32, device=par.device), True)
            return index, first_child, sibling

        return run

    return prepare


def _prepare_flat_mask(original):
    """DDTreeWorker._build_flat_tree_mask: pack_tree_mask + flat_custom_mask with the tree
    sizes, so pad rows see nothing (prefix included); its size comes from seq_lens_cpu."""

    def prepare(a):
        worker, batch, vis, sizes = a["self"], a["batch"], a["visibility"], a["actual_tree_sizes"]
        D = int(worker.max_tree_nodes)
        seq_lens, seq_cpu = batch.seq_lens, getattr(batch, "seq_lens_cpu", None)
        bs = seq_lens.shape[0]
        if not isinstance(vis, torch.Tensor) or tuple(vis.shape) != (bs, D, D) or vis.dtype != torch.bool:
            return f"visibility {getattr(vis, 'shape', None)} is not [bs={bs}, {D}, {D}] bool"
        if D > kdtree_ops.MAX_TREE_BUDGET + 1:
            return f"{D} tree nodes (kdtree_ops' flat mask takes up to {kdtree_ops.MAX_TREE_BUDGET + 1})"
        if not isinstance(sizes, torch.Tensor) or tuple(sizes.shape) != (bs,) or sizes.dtype not in (torch.int32, torch.int64):
            return "actual_tree_sizes is not a [bs] integer tensor"
        if seq_lens.dtype not in (torch.int32, torch.int64):
            return f"seq_lens dtype {seq_lens.dtype}"
        if not isinstance(seq_cpu, torch.Tensor) or seq_cpu.device.type != "cpu" or tuple(seq_cpu.shape) != (bs,):
            return "batch.seq_lens_cpu unavailable (the mask's size would need a device read)"
        if not (vis.device == sizes.device == seq_lens.device) or not _same_device(batch.device, vis.device):
            return "visibility, actual_tree_sizes and seq_lens are not on the batch's device"
        reason = _ddtree_device_refusal(vis, "visibility")
        if reason:
            return reason
        capacity = D * int(seq_cpu.sum()) + bs * D * D  # sum_b D * (seq_len_b + D), host data only

        def run(fresh: bool):
            packed = kdtree_ops.pack_tree_mask(vis.reshape(bs * D, D)).view(bs, D, -1)
            return kdtree_ops.flat_custom_mask(packed, seq_lens, capacity, sizes)[0]

        return run

    return prepare


def _verify_refusal(vi, batch, logits_output, page_size, model_runner) -> Optional[str]:
    """Why kdtree_ops cannot reproduce DDTreeVerifyInput.verify for this batch (None: it can)."""
    if getattr(vi, "_draft_pos_topk", None) is not None:
        return "SGLANG_DDTREE_RANK_PROBE is on"
    if batch.forward_mode.is_idle():
        return "idle batch"
    si = batch.sampling_info
    if not si.is_all_greedy:
        return "non-greedy sampling in the batch"
    for name in ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias"):
        if getattr(si, name, None) is not None:
            return f"sampling_info.{name} is set"
    from sglang.srt.speculative import spec_utils

    if getattr(spec_utils, "SIMULATE_ACC_LEN", 0) > 0:
        return "SGLANG_SIMULATE_ACC_LEN is set"
    if model_runner is not None and page_size != 1:
        return f"page size {page_size}"
    bs, D = len(batch.reqs), int(vi.draft_token_num)
    if len(batch.seq_lens) != bs:
        return f"{len(batch.seq_lens)} seq_lens for {bs} requests"
    arrays = {"retrieve_next_token": vi.retrieve_next_token, "retrieve_next_sibling": vi.retrieve_next_sibling,
              "draft_token": vi.draft_token.reshape(bs, D) if vi.draft_token.numel() == bs * D else None}
    for name, t in arrays.items():
        if t is None or tuple(t.shape) != (bs, D) or t.dtype != torch.int64 or not t.is_contiguous():
            return f"{name} is not a contiguous [bs={bs}, D={D}] int64 tensor"
    logits = logits_output.next_token_logits
    if logits.dim() != 2 or logits.shape[0] != bs * D:
        return f"next_token_logits {tuple(logits.shape)} is not [bs * D = {bs * D}, V]"
    if vi.max_tree_depth < 1:
        return f"max_tree_depth {vi.max_tree_depth}"
    if any(t.device != logits.device for t in arrays.values()) or not _same_device(batch.device, logits.device):
        return "tree, logits and batch are on different devices"
    hidden = logits_output.hidden_states
    if hidden is not None and hidden.shape[0] != bs * D:
        return f"hidden_states has {hidden.shape[0]} rows, not bs * D = {bs * D}"
    if model_runner is not None:
        if not isinstance(batch.seq_lens_sum, int):
            return "batch.seq_lens_sum is not an int"
        if not isinstance(batch.seq_lens_cpu, torch.Tensor) or batch.seq_lens_cpu.device.type != "cpu":
            return "batch.seq_lens_cpu is not a CPU tensor"
        if batch.out_cache_loc is None or batch.out_cache_loc.numel() != bs * D:
            return "out_cache_loc does not hold bs * D verify slots"
    return _ddtree_device_refusal(logits, "next_token_logits")


def _verify_plan(vi, batch, logits_output):
    """kdtree_ops' acceptance for the batch, without side effects on SGLang's state (besides
    the NaN sanitising eagle_sample applies to the logits). Ends with the step's one host sync:
    the accepted paths and their lengths, which verify's host outputs are made of."""
    from sglang.srt.utils.async_probe import sanitize_nan_logits

    bs, D = len(batch.reqs), int(vi.draft_token_num)
    logits = logits_output.next_token_logits
    sanitize_nan_logits(logits, "verify: target model logits")  # as eagle_sample does first
    target = torch.argmax(logits, dim=-1).reshape(bs, D)
    acc = kdtree_ops.accept_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.draft_token.reshape(bs, D),
                                     target, vi.max_tree_depth - 1)
    rows = torch.cat((acc.accept_len[:, None], acc.accepted), 1).tolist()  # the one D2H copy
    lens = [r[0] for r in rows]
    return acc, lens, [r[1 : 1 + n] for r, n in zip(rows, lens)]


def _verify_commit(info, vi, batch, logits_output, model_runner, plan):
    """Everything the PR's verify does after its acceptance kernel, from the plan: the verify
    input's outputs, then (with model_runner) the KV commit: rejected slots back to the
    allocator in slot order, accepted slots kept where they are, req_to_token and lengths."""
    acc, lens, paths = plan
    total, bs = sum(lens), len(lens)
    keep = acc.commit_order[:total]
    commit_lens = acc.accept_len.to(torch.int64)
    vi.accepted_indices = paths
    vi.next_tokens = acc.bonus
    vi.accepted_tokens = acc.accepted_tokens.view(-1)
    vi.accept_index_flat = keep
    vi.accept_length_per_req = commit_lens - 1
    if model_runner is not None:
        slots = batch.out_cache_loc
        batch.token_to_kv_pool_allocator.free(slots[acc.commit_order[total:]])
        batch.out_cache_loc = slots[keep]
        for req, n in zip(batch.reqs, lens, strict=True):
            req.kv_allocated_len = req.kv_committed_len + n
        grow = commit_lens.to(batch.seq_lens.dtype)
        info.assign_req_to_token_pool_func(batch.req_pool_indices, batch.req_to_token_pool.req_to_token,
                                           batch.seq_lens, batch.seq_lens + grow, batch.out_cache_loc, bs)
        batch.seq_lens.add_(grow)
        batch.seq_lens_cpu.add_(torch.tensor(lens, dtype=batch.seq_lens_cpu.dtype))
        batch.seq_lens_sum += total
    else:
        batch.seq_lens += commit_lens
    hidden = logits_output.hidden_states
    return vi.next_tokens, commit_lens, hidden[keep] if hidden is not None else None, [n - 1 for n in lens]


def _verify_differences(vi, batch, result, plan, slots_before, hidden) -> list:
    """validate: the PR's verify outputs and KV commit against what the plan would have done."""
    acc, lens, paths = plan
    total = sum(lens)
    keep = acc.commit_order[:total]
    expect = {
        "next_tokens": (result[0], acc.bonus),
        "commit_lens": (result[1], acc.accept_len.to(torch.int64)),
        "num_correct_drafts": (result[3], [n - 1 for n in lens]),
        "accepted_indices": (vi.accepted_indices, paths),
        "accepted_tokens": (vi.accepted_tokens, acc.accepted_tokens.view(-1)),
        "accept_index_flat": (vi.accept_index_flat, keep),
        "accept_length_per_req": (vi.accept_length_per_req, acc.accept_len.to(torch.int64) - 1),
    }
    if hidden is not None:
        expect["next_target_hidden"] = (result[2], hidden[keep])
    if slots_before is not None:
        expect["out_cache_loc"] = (batch.out_cache_loc, slots_before[keep])
    names = list(expect)
    return _differences(names, [e[1] for e in expect.values()], [e[0] for e in expect.values()])


def _wrap_verify(original):
    """DDTreeVerifyInput.verify for greedy batches: argmax, accept_retrieve, then the PR's
    bookkeeping from one host copy of the accepted paths (its contract returns host lists and
    updates seq_lens_cpu, so one sync is unavoidable; the PR's own verify syncs several times)."""
    sig = inspect.signature(original)
    info = sys.modules[original.__module__]
    name = "verify"

    def verify(self, *args, **kwargs):
        st = _STATE
        if st is None or st.mode == "off" or getattr(st, "ddtree", None) is None:
            return original(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            batch, logits_output, model_runner = a["batch"], a["logits_output"], a["model_runner"]
            reason = _verify_refusal(self, batch, logits_output, a["page_size"], model_runner)
        except Exception as e:
            reason = f"could not inspect the call ({type(e).__name__}: {e})"
        if reason is not None:
            return _ddtree_fallback(name, reason, original, (self, *args), kwargs)
        if st.mode == "validate":
            try:
                plan = _verify_plan(self, batch, logits_output)
            except Exception as e:
                plan = None
                _ddtree_warn_once(f"validate: kdtree_ops' DDTree verify raised {type(e).__name__}: {e}")
            slots = batch.out_cache_loc if model_runner is not None else None
            hidden = logits_output.hidden_states
            result = original(self, *args, **kwargs)
            st.ddtree.sglang[name] += 1
            if plan is not None:
                try:
                    _ddtree_compared(name, _verify_differences(self, batch, result, plan, slots, hidden))
                except Exception as e:
                    _ddtree_warn_once(f"validate: comparing DDTree verify raised {type(e).__name__}: {e}")
            return result
        try:
            plan = _verify_plan(self, batch, logits_output)
        except Exception as e:  # nothing of SGLang's state has changed yet
            return _ddtree_fallback(name, f"exception in kdtree_ops' path: {type(e).__name__}: {e}", original,
                                    (self, *args), kwargs)
        # From here SGLang's state changes; an error is raised as the PR's own verify would raise it.
        result = _verify_commit(info, self, batch, logits_output, model_runner, plan)
        st.ddtree.ours[name] += 1
        return result

    return _wrapper_of(verify, original)


def _patch_name(owner, attr: str, make) -> None:
    """Patch owner.attr with make(original); if it already holds our wrapper (a module that
    imported the name after we patched it), keep that and remember the true original."""
    current = owner.__dict__[attr]
    original = getattr(current, "_kdtree_original", current)
    _STATE.patched.append((owner, attr, original))
    if current is original:
        setattr(owner, attr, make(original))
    _STATE.ddtree.hooked.append(f"{getattr(owner, '__name__', owner)}.{attr}")


def _wrap_pure(name: str, prepare, fields):
    return lambda original: _pure_wrapper(name, original, prepare(original), fields)


_TREE_FIELDS = ("node_token_ids", "node_depths", "parents", "child_maps", "visibility", "actual_tree_sizes")


def _patch_ddtree_functions(module) -> None:
    """ddtree_utils' functions, and the worker's names for them (bound by its import)."""
    for attr, make in (
        ("build_ddtree_tree", _wrap_pure("build_ddtree_tree", _prepare_build_tree, _TREE_FIELDS)),
        ("build_eagle_tree_format", _wrap_pure("build_eagle_tree_format", _prepare_eagle_format,
                                               ("retrive_index", "retrive_next_token", "retrive_next_sibling"))),
    ):
        if attr in module.__dict__:
            _patch_name(module, attr, make)
    worker_cls = module.__dict__.get("DDTreeWorker")
    if worker_cls is not None and "_build_flat_tree_mask" in worker_cls.__dict__:
        _patch_name(worker_cls, "_build_flat_tree_mask", _wrap_pure("_build_flat_tree_mask", _prepare_flat_mask, ("custom_mask",)))
    logger.info("kdtree_ops: DDTree %s hooked (KDTREE_VERIFY=%s)", module.__name__, _STATE.mode)


def _patch_ddtree_info(module) -> None:
    _patch_name(module.DDTreeVerifyInput, "verify", _wrap_verify)
    logger.info("kdtree_ops: DDTree %s hooked (KDTREE_VERIFY=%s)", module.__name__, _STATE.mode)


def _install_ddtree() -> None:
    """Register the DDTree patches; nothing is patched unless SGLang imports the PR's modules."""
    _STATE.ddtree = DDTreeCounters()
    _when_imported(DDTREE_UTILS, _patch_ddtree_functions)
    _when_imported(DDTREE_INFO, _patch_ddtree_info)
    _when_imported(DDTREE_WORKER, _patch_ddtree_functions)


# --------------------------------------------------------------------------------------------
# Defrag
# --------------------------------------------------------------------------------------------


def _defrag_refusal(backend) -> Optional[str]:
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception as e:
        return f"server args unavailable ({type(e).__name__})"
    if not getattr(args, "disable_radix_cache", False):
        return "needs --disable-radix-cache (the prefix cache's slot references are not visible to the hook)"
    if not getattr(args, "disable_overlap_schedule", False):
        return "needs --disable-overlap-schedule (the overlapped scheduler allocates slots during the step)"
    if getattr(backend, "page_size", 1) != 1:
        return "needs page size 1"
    algorithm = str(getattr(args, "speculative_algorithm", None) or "").upper()
    drafts = [b for b in list(_STATE.backends) if getattr(b, "is_draft_runner", False)
              and getattr(b, "req_to_token_pool", None) is backend.req_to_token_pool]
    if algorithm not in ("", "NONE", "NGRAM") and not drafts:
        return (f"cannot see the {algorithm} draft model's KV pool (it shares the request table, but its attention "
                "backend is not TritonAttnBackend or was built before the hook); moving only the target's KV "
                "would corrupt the draft's")
    return None


def _maybe_defrag(backend, fb) -> None:
    """Between verify steps (never in capture): give fragmented requests one contiguous run
    of slots within the byte budget, moving the KV of every pool that shares the request
    table (target and Triton draft pools). Any problem turns defrag off for the process."""
    st = _STATE
    if st.defrag_off:
        return
    try:
        import defrag
    except ImportError as e:
        st.defrag_off = f"defrag.py unavailable ({e})"
        logger.warning("kdtree_ops: KDTREE_DEFRAG=1 but %s; defrag off", st.defrag_off)
        return
    reason = _defrag_refusal(backend)
    if reason:
        st.defrag_off = reason
        logger.warning("kdtree_ops: KDTREE_DEFRAG=1 but defrag %s; defrag off", reason)
        return
    try:
        rtp = backend.req_to_token_pool
        pools = []
        for b in list(st.backends):
            p = getattr(b, "token_to_kv_pool", None)
            if getattr(b, "req_to_token_pool", None) is rtp and p is not None and all(p is not q for q in pools):
                pools.append(p)
        allocator = getattr(backend, "token_to_kv_pool_allocator", None)
        if allocator is None:
            raise RuntimeError("backend has no token_to_kv_pool_allocator")
        pool = _SharedTablePool(rtp, allocator, pools)
        rows = fb.req_pool_indices.to("cpu", torch.int64)
        lens = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens.cpu()
        t0 = time.perf_counter()
        plan = defrag.defragment(pool, rows, lens.to(torch.int64), byte_budget=st.defrag_budget)
        if plan.compacted or plan.skipped:
            logger.info(
                "kdtree_ops: defrag at verify step %d: %d requests compacted (%d slots, %.1f MB over %d pools) in %.1f ms%s",
                st.steps,
                len(plan.compacted),
                plan.moved_slots,
                plan.bytes / 2**20,
                len(pools),
                (time.perf_counter() - t0) * 1e3,
                f"; skipped: {plan.reason}" if plan.reason else "",
            )
    except Exception as e:
        st.defrag_off = f"{type(e).__name__}: {e}"
        logger.warning("kdtree_ops: defrag failed (%s); defrag off for this process", st.defrag_off)


def _SharedTablePool(req_to_token_pool, allocator, kv_pools):
    import defrag

    class SharedTablePool(defrag.SGLangPool):
        """defrag's SGLang pool, moving the rows of every KV pool indexed by the same table."""

        @property
        def kv_groups(self) -> list:
            groups = []
            for p in kv_pools:
                for attr in ("kv_buffer", "k_buffer", "v_buffer", "kv_scale_buffer"):
                    bufs = getattr(p, attr, None)
                    if isinstance(bufs, (list, tuple)) and bufs:
                        groups.append(list(bufs))
            return groups

    return SharedTablePool(req_to_token_pool, allocator, kv_pools[0] if kv_pools else None)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def install(mode: Optional[str] = None) -> bool:
    """Hook SGLang's verify attention. ``mode``: ``validate`` or ``on`` (default: KDTREE_VERIFY).

    Patches apply as soon as (or, via an import hook, right after) SGLang's modules are
    imported. Installing again only updates the mode; ``off`` uninstalls. Returns whether the
    hook is (or will be) active.
    """
    global _STATE
    mode = env_mode() if mode is None else mode.strip().lower()
    if mode not in MODES:
        raise ValueError(f"kdtree_ops: mode must be one of {MODES}, got {mode!r}")
    with _LOCK:
        if mode == "off":
            uninstall()
            return False
        if _STATE is not None:
            _STATE.mode = mode
            return True
        _STATE = _State(mode)
        _when_imported(TRITON_BACKEND, _patch_triton_backend)
        _when_imported(GRAPH_RUNNER, _patch_graph_runner)
        _install_ddtree()
        if _STATE.profile:
            for module, cls_name, attr, phase in PROFILE_POINTS:
                _when_imported(module, _patch_profile_point(cls_name, attr, phase))
        logger.info("kdtree_ops: verify hook installed (mode %s)", mode)
        if _STATE.defrag:
            try:
                import defrag  # noqa: F401
            except ImportError as e:
                logger.warning("kdtree_ops: KDTREE_DEFRAG=1 but defrag.py is unavailable (%s); defrag off", e)
                _STATE.defrag = False
        return True


def uninstall() -> None:
    """Restore every patched SGLang attribute and drop pending import hooks."""
    global _STATE
    with _LOCK:
        if _FINDER is not None:
            _FINDER.callbacks.clear()
            if _FINDER in sys.meta_path:
                sys.meta_path.remove(_FINDER)
        if _STATE is None:
            return
        for owner, attr, original in reversed(_STATE.patched):
            setattr(owner, attr, original)
        _STATE = None
        logger.info("kdtree_ops: verify hook uninstalled")


def installed() -> Optional[str]:
    """The active mode, or None when the hook is not installed."""
    return None if _STATE is None else _STATE.mode


def maybe_install_from_env() -> None:
    """Called at the end of ``import kdtree_ops``: install when KDTREE_VERIFY asks for it and
    SGLang is importable; never raises."""
    try:
        if env_mode() == "off" or importlib.util.find_spec("sglang") is None:
            return
        install()
    except Exception as e:
        logger.warning("kdtree_ops: verify hook not installed (%s: %s); SGLang runs unchanged", type(e).__name__, e)
