"""SGLang 0.5.23's own verify step, built from its real classes, for tests and benchmarks.

Everything a TARGET_VERIFY forward sees comes from SGLang's code: the pools
(``ReqToTokenPool``, ``MLATokenToKVPool`` / ``MHATokenToKVPool``), the allocator, the KV index
translator, ``TritonAttnBackend`` with its metadata paths (``init_forward_metadata`` and the
CUDA-graph ``init_cuda_graph_state`` / ``init_forward_metadata_out_graph``), ``ForwardBatch``,
``KVLocPlan``, and the speculative inputs: EAGLE trees made by SGLang's draft-result organiser
and tree builder, DFlash chains. Only the model is missing: q and k per layer are random.

Works on CPU (SGLang's Triton kernels run under ``TRITON_INTERPRET=1``, which must be set
before triton is imported; the interpreter handles float16 and float32 but not bfloat16) and
on CUDA. Needs ``sglang`` (and ``transformers``) importable.
"""

from __future__ import annotations

import types
from typing import Optional, Sequence

import torch

import transformers
from sglang.kernels.ops.speculative import spec_tree
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention import triton_backend
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.layers.radix_attention import RadixAttention
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

MLA_QK, MLA_V = 576, 512


def publish_server(device: str, *, algorithm: str = "EAGLE", num_draft_tokens: int = 4, topk: int = 2,
                   steps: int = 3, **server_args) -> None:
    """Publish the server arguments SGLang's backends read at construction (call
    ``reset_context()`` when done); ``server_args`` go to ``ServerArgs`` as they are."""
    reset_context()
    spec = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=num_draft_tokens)
    if algorithm == "EAGLE":
        spec.update(speculative_eagle_topk=topk, speculative_num_steps=steps)
    publish(ServerArgs(model_path="dummy", device=device, attention_backend="triton", **spec, **server_args),
            role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))


class Runner:
    """One model runner's attention state: its KV pool and its TritonAttnBackend.

    A target runner owns the request table and the allocator; a draft runner (``draft_of``)
    shares both, as SGLang's speculative workers do, with a KV pool of its own.
    """

    def __init__(self, *, device: str, dtype: torch.dtype, heads: int, layers: int, num_tokens_per_req: int,
                 pool_size: int = 4096, max_context: int = 1024, max_reqs: int = 8, mla: bool = True,
                 head_dim: int = 128, draft_of: Optional["Runner"] = None):
        self.device, self.dtype, self.heads, self.layers, self.mla = device, dtype, heads, layers, mla
        if draft_of is None:
            self.req_to_token_pool = ReqToTokenPool(size=max_reqs, max_context_len=max_context, device=device,
                                                    enable_memory_saver=False)
        else:
            self.req_to_token_pool = draft_of.req_to_token_pool
            pool_size = draft_of.allocator.size
        if mla:
            self.kv_pool = MLATokenToKVPool(size=pool_size, page_size=1, dtype=dtype, kv_lora_rank=MLA_V,
                                            qk_rope_head_dim=MLA_QK - MLA_V, layer_num=layers, device=device,
                                            enable_memory_saver=False)
            self.qk_dim, self.v_dim, kv_heads = MLA_QK, MLA_V, 1
        else:
            self.kv_pool = MHATokenToKVPool(size=pool_size, page_size=1, dtype=dtype, head_num=heads,
                                            head_dim=head_dim, layer_num=layers, device=device,
                                            enable_memory_saver=False)
            self.qk_dim, self.v_dim, kv_heads = head_dim, head_dim, heads
        self.kv_heads = kv_heads
        self.allocator = (TokenToKVPoolAllocator(size=pool_size, dtype=dtype, device=device, kvcache=self.kv_pool,
                                                 need_sort=False) if draft_of is None else draft_of.allocator)
        translator = KVIndexTranslator(req_to_token=self.req_to_token_pool.req_to_token,
                                       token_to_kv_pool_allocator=self.allocator, token_to_kv_pool=self.kv_pool,
                                       page_size=1, device=device, is_draft_worker=draft_of is not None)
        model_config = types.SimpleNamespace(
            attention_arch=AttentionArch.MLA if mla else AttentionArch.MHA,
            hf_config=transformers.PretrainedConfig(model_type="llama"), linear_attn_registry_result=None,
            get_max_num_attention_heads=lambda: heads, get_num_kv_heads=lambda tp, dcp=1: kv_heads,
            v_head_dim=self.v_dim, swa_v_head_dim=None, context_len=max_context, head_dim=self.qk_dim,
            is_encoder_decoder=False, is_draft_model=draft_of is not None)
        self.model_runner = types.SimpleNamespace(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.kv_pool,
            token_to_kv_pool_allocator=self.allocator, sliding_window_size=None, page_size=1,
            kv_index_translator=translator, decode_num_tokens_per_req=lambda: num_tokens_per_req,
            model_config=model_config, is_draft_worker=draft_of is not None, device=device, gpu_id=0,
            spec_algorithm=None, kv_cache_dtype=dtype)
        self.translator = translator
        self.backend = triton_backend.TritonAttnBackend(self.model_runner)

    def layer(self, layer_id: int, *, fp8_checkpoint: bool = False) -> RadixAttention:
        """An attention layer as the model builds it; ``fp8_checkpoint`` gives it the KV-cache
        scales an FP8 checkpoint's quantisation config sets (1.0 when none are stored)."""
        quant = Fp8Config(is_checkpoint_fp8_serialized=True) if fp8_checkpoint else None
        layer = RadixAttention(self.heads, self.qk_dim, self.qk_dim**-0.5, self.kv_heads, layer_id,
                               v_head_dim=self.v_dim, quant_config=quant)
        if layer.quant_method is not None:
            layer.quant_method.process_weights_after_loading(layer)
        return layer

    def fill(self, generator: torch.Generator) -> None:
        """Fresh random KV in every slot of every layer."""
        for bufs in (getattr(self.kv_pool, "kv_buffer", None), getattr(self.kv_pool, "k_buffer", None),
                     getattr(self.kv_pool, "v_buffer", None)):
            for buf in bufs or ():
                buf.copy_(torch.randn(buf.shape, generator=generator).to(buf.dtype))


def eagle_tree(runner: Runner, seq_lens: torch.Tensor, *, topk: int, steps: int, num_draft_tokens: int,
               generator: torch.Generator, mask_buffer: Optional[torch.Tensor] = None) -> EagleVerifyInput:
    """An EAGLE verify input as SGLang's draft loop makes it: per step, random draft top-k
    probabilities through SGLang's ``select_top_k_tokens``, then its ``organize_draft_results``
    and ``build_tree_kernel_efficient`` (the flat custom mask, positions, retrieve arrays).
    SGLang's own Triton tree builder stands in for sgl_kernel's CUDA one, which needs a
    compiled extension."""
    B, dev = seq_lens.numel(), seq_lens.device
    scores, tokens, parents = [], [], []
    score = None
    for i in range(steps):
        rows = B if i == 0 else B * topk
        p = torch.rand(rows, topk, generator=generator).to(dev)
        p = (p / p.sum(-1, keepdim=True)).sort(-1, descending=True).values
        ids = torch.randint(0, 32000, (rows, topk), generator=generator).to(dev)
        if i == 0:
            _, _, score, info = spec_utils._select_top_k_tokens_first(p, ids, None, topk)
        else:
            later = getattr(spec_utils._select_top_k_tokens_later, "_torchdynamo_orig_callable",
                            spec_utils._select_top_k_tokens_later)
            _, _, score, info = later(i, p, ids, None, score, topk)
        scores.append(info[0])
        tokens.append(info[1])
        parents.append(info[2])
    parent_list, top_index, draft_tokens = eagle_utils.organize_draft_results(scores, tokens, parents,
                                                                              num_draft_tokens)
    bonus = torch.randint(0, 32000, (B,), generator=generator).to(dev)
    build = eagle_utils.build_tree_kernel_efficient_func
    eagle_utils.build_tree_kernel_efficient_func = spec_tree.sgl_build_tree_kernel_triton
    try:
        mask, positions, r_index, r_next, r_sibling, draft = eagle_utils.build_tree_kernel_efficient(
            bonus, parent_list, top_index, draft_tokens, seq_lens, int(seq_lens.sum()), topk, steps,
            num_draft_tokens, tree_mask_buf=mask_buffer)
    finally:
        eagle_utils.build_tree_kernel_efficient_func = build
    return EagleVerifyInput(
        draft_token=draft, custom_mask=mask, positions=positions, retrieve_index=r_index,
        retrieve_next_token=r_next, retrieve_next_sibling=r_sibling, retrieve_cum_len=None, spec_steps=steps,
        topk=topk, draft_token_num=num_draft_tokens, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=seq_lens.cpu())


def dflash_chain(seq_lens: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> DFlashVerifyInput:
    """A DFlash verify input: a causal chain of draft tokens, no custom mask."""
    B, dev = seq_lens.numel(), seq_lens.device
    draft = torch.randint(0, 32000, (B * num_draft_tokens,), generator=generator).to(dev)
    positions = (seq_lens[:, None] + torch.arange(num_draft_tokens, device=dev)).reshape(-1)
    return DFlashVerifyInput(draft_token=draft, positions=positions, draft_token_num=num_draft_tokens)


class Step(types.SimpleNamespace):
    """One verify step: the ForwardBatch and what built it."""


def verify_step(target: Runner, prefix_lens: Sequence[int], spec_info, *, generator: torch.Generator,
                rows: Optional[torch.Tensor] = None) -> Step:
    """Lay out a TARGET_VERIFY batch as SGLang's scheduler does: each request's prefix in
    allocator slots scattered over the pool, ``num_tokens_per_req`` fresh slots per request
    for the draft tokens, the request table filled, a KVLocPlan bound, and the ForwardBatch."""
    dev = target.device
    B, N = len(prefix_lens), spec_info.draft_token_num
    target.allocator.clear()
    total = sum(prefix_lens) + B * N
    slots = target.allocator.alloc(total)
    assert slots is not None, f"pool too small for {total} slots"
    slots = slots[torch.randperm(total, generator=generator).to(slots.device)]
    prefix_slots, out_loc = slots[: sum(prefix_lens)], slots[sum(prefix_lens):]
    rows = torch.arange(1, B + 1, dtype=torch.int64, device=dev) if rows is None else rows
    table = target.req_to_token_pool.req_to_token
    start = 0
    for b, p in enumerate(prefix_lens):
        table[rows[b], :p] = prefix_slots[start:start + p].to(table.dtype)
        table[rows[b], p:p + N] = out_loc[b * N:(b + 1) * N].to(table.dtype)
        start += p
    seq = torch.tensor(list(prefix_lens), dtype=torch.int64, device=dev)
    plan = KVLocPlan(source=target.translator, req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq.cpu(),
                     write_virtual=None, write_slots=out_loc, read_extent=N)
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=B,
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
