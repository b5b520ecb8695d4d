"""defrag: keep accepted tree-verify KV compact, and compact requests' scattered KV slots.

Two tools for page-size-1 token pools in SGLang's layout (slot 0 is padding and never
allocated; allocatable slots are 1..size; ``req_to_token[row, pos]`` is the slot holding the
KV of token ``pos`` of the request in ``row``):

* :func:`accept_moves` / :func:`commit_accept` — after a tree verify, move each request's
  accepted nodes to the front of its verify window, point ``req_to_token`` at them and hand
  back the rejected slots. Pure torch plus :func:`kdtree_ops.move_kv`: fixed-size outputs, no
  host sync, capturable in CUDA graphs.
* :func:`plan` / :func:`apply` / :func:`defragment` — give a request (or every request whose
  KV is split into too many runs) one contiguous run of slots, within a byte budget per call.
  Planning runs on the host between steps (vectorised per request); applying enqueues one
  :func:`kdtree_ops.move_kv` and then updates ``req_to_token`` and the free list, so every
  later kernel on the stream sees consistent KV. Works on plain tensors (:class:`TensorPool`)
  and on SGLang's ``ReqToTokenPool`` + ``TokenToKVPoolAllocator`` (:class:`SGLangPool`).

Invariants :func:`apply` keeps, whatever the plan: every request reads the same KV bytes in
the same order, no slot is owned twice, and free ∪ owned is unchanged. A plan that cannot be
met changes nothing and says why.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence, Union

import torch

import kdtree_ops

PAD = -1  # slot padding in every fixed-size slot tensor here; move_kv skips such pairs


# --------------------------------------------------------------------------------------------
# After verify: compact accepted nodes to the front of each request's window
# --------------------------------------------------------------------------------------------


class AcceptMoves(NamedTuple):
    src: torch.Tensor  # [B*(L+1)] slots to copy from, PAD for no move (nodes already in place)
    dst: torch.Tensor  # [B*(L+1)] slots to copy to, PAD likewise
    kept: torch.Tensor  # [B, L+1] slot of accepted token j after the move, PAD past accept_len
    freed: torch.Tensor  # [B, N] rejected window slots, PAD where kept or padding slot 0


def accept_moves(
    accepted: torch.Tensor, accept_len: torch.Tensor, out_cache_loc: torch.Tensor, num_nodes: int
) -> AcceptMoves:
    """Slot moves that put each request's accepted nodes at the front of its verify window.

    Parameters
    ----------
    accepted : Tensor [B, L+1], int32/int64
        ``accept_walk``'s accepted node indices per request, root (0) first, padded with -1.
        Along an accepted path node indices strictly increase (parents precede children).
    accept_len : Tensor [B], int32/int64
        Number of valid entries per row (0 for padding requests of a CUDA-graph batch).
    out_cache_loc : Tensor [B*N], int32/int64
        The verify window: node i of request b sits in slot ``out_cache_loc[b*N + i]``.
    num_nodes : int
        N, tree nodes per request (root included).

    Returns
    -------
    AcceptMoves
        ``src``/``dst`` ready for :func:`kdtree_ops.move_kv` (overlapping, so not disjoint);
        ``kept[b, j]`` = ``out_cache_loc[b*N + j]`` for ``j < accept_len[b]``; ``freed`` the
        window slots past ``accept_len`` (``freed[freed > 0]`` outside a graph gives the
        allocator's free list input).
    """
    B, width = accepted.shape
    window = out_cache_loc.view(B, num_nodes)
    j = torch.arange(width, device=accepted.device)
    k = accept_len.to(torch.int64)[:, None]
    node = accepted.to(torch.int64)
    valid = (j < k) & (j < num_nodes) & (node >= 0)
    src = window.gather(1, node.clamp(0, num_nodes - 1))
    dst = window[:, j.clamp(max=num_nodes - 1)]
    move = valid & (node != j)
    pad = torch.full_like(src, PAD)
    i = torch.arange(num_nodes, device=accepted.device)
    return AcceptMoves(
        src=torch.where(move, src, pad).reshape(-1),
        dst=torch.where(move, dst, pad).reshape(-1),
        kept=torch.where(valid, dst, pad),
        freed=torch.where((i >= k) & (window > 0), window, torch.full_like(window, PAD)),
    )


def commit_accept(
    kv_layers: Sequence[torch.Tensor],
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted: torch.Tensor,
    accept_len: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_nodes: int,
) -> AcceptMoves:
    """Compact accepted KV (:func:`accept_moves` + :func:`kdtree_ops.move_kv`) and set
    ``req_to_token[req, prefix_len + j] = kept[b, j]`` for ``j < accept_len``. Capturable.

    Rows of padding requests (``accept_len`` 0) are left as they are. Returns the moves; the
    caller frees ``freed`` (after the graph, ``freed[freed > 0]``).
    """
    m = accept_moves(accepted, accept_len, out_cache_loc, num_nodes)
    kdtree_ops.move_kv(kv_layers, m.src, m.dst)
    B, width = m.kept.shape
    rows = req_pool_indices.to(torch.int64)[:, None].expand(B, width)
    j = torch.arange(width, device=m.kept.device)
    valid = m.kept >= 0
    prefix = prefix_lens.to(torch.int64)[:, None]
    # Every lane writes a cell; lanes past accept_len rewrite column prefix_len with the value
    # lane 0 writes there (or its current value when nothing is accepted), so duplicate
    # writes always agree and the scatter is deterministic.
    last = req_to_token.shape[1] - 1
    cols = torch.where(valid, prefix + j, prefix).clamp(0, last)
    first_col = prefix.clamp(0, last)
    old = req_to_token[rows[:, :1], first_col]  # [B, 1]
    first = torch.where(valid[:, :1], m.kept[:, :1].to(old.dtype), old)
    vals = torch.where(valid, m.kept.to(old.dtype), first.expand(B, width))
    req_to_token.index_put_((rows, cols), vals)
    return m


# --------------------------------------------------------------------------------------------
# Pools
# --------------------------------------------------------------------------------------------


@dataclass
class TensorPool:
    """A token pool as plain tensors.

    Attributes
    ----------
    req_to_token : Tensor [R, max_ctx], int32
    kv_layers : list of Tensor [size+1, ...]
        Per-layer KV buffers (same row size).
    free_slots : Tensor [f], int64
        Free slots in allocation order (allocators take from the front).
    size : int
        Allocatable slots are 1..size; slot 0 is padding.
    """

    req_to_token: torch.Tensor
    kv_layers: list
    free_slots: torch.Tensor
    size: int

    @property
    def kv_groups(self) -> list:
        return [list(self.kv_layers)]

    def free(self) -> torch.Tensor:
        return self.free_slots

    def update_free(self, taken: torch.Tensor, released: torch.Tensor) -> None:
        f = self.free_slots
        keep = ~torch.isin(f, taken.to(f.device))
        self.free_slots = torch.cat((f[keep], released.to(f.device, f.dtype)))


class SGLangPool:
    """SGLang 0.5.23's ``ReqToTokenPool`` + ``TokenToKVPoolAllocator`` (page size 1) with its
    ``MLATokenToKVPool`` (or any KV pool whose per-layer buffers are ``kv_buffer``). Rows move
    as bytes, so an fp8 pool's storage buffers (e4m3 bytes as uint8) move like any other.

    Free slots are the allocator's ``free_pages`` then ``release_pages``; released slots go
    where the allocator's own ``free`` would put them (``release_pages`` when ``need_sort``).
    """

    def __init__(self, req_to_token_pool, allocator, kv_pool=None):
        if getattr(allocator, "page_size", 1) != 1:
            raise ValueError(f"defrag needs page_size 1, got {allocator.page_size}")
        self.req_pool = req_to_token_pool
        self.allocator = allocator
        self.kv_pool = kv_pool if kv_pool is not None else allocator.get_kvcache()

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_pool.req_to_token

    @property
    def kv_groups(self) -> list:
        # The FP4 MLA pool keeps per-row scales in kv_scale_buffer: they must move with
        # their payload (a second move_kv, their rows having another size).
        scales = getattr(self.kv_pool, "kv_scale_buffer", None)
        return [list(self.kv_pool.kv_buffer)] + ([list(scales)] if scales is not None else [])

    @property
    def size(self) -> int:
        return self.allocator.size

    def free(self) -> torch.Tensor:
        a = self.allocator
        return torch.cat((a.free_pages, a.release_pages))

    def update_free(self, taken: torch.Tensor, released: torch.Tensor) -> None:
        a = self.allocator
        taken = taken.to(a.free_pages.device)
        a.free_pages = a.free_pages[~torch.isin(a.free_pages, taken)]
        a.release_pages = a.release_pages[~torch.isin(a.release_pages, taken)]
        released = released.to(a.free_pages.device, a.free_pages.dtype)
        if a.need_sort:
            a.release_pages = torch.cat((a.release_pages, released))
        else:
            a.free_pages = torch.cat((a.free_pages, released))


Pool = Union[TensorPool, SGLangPool]


# --------------------------------------------------------------------------------------------
# Fragmentation metric, planning, applying
# --------------------------------------------------------------------------------------------


def _rows_lens(rows, lens, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).to(device)
    lens = torch.as_tensor(lens, dtype=torch.int64).reshape(-1).to(device)
    if rows.shape != lens.shape:
        raise ValueError(f"rows and lens must have the same length, got {rows.numel()} and {lens.numel()}")
    return rows, lens


def fragmentation(req_to_token: torch.Tensor, rows, lens) -> torch.Tensor:
    """Contiguous slot runs per request (1 = one run, 0 = empty request).

    Parameters
    ----------
    req_to_token : Tensor [R, max_ctx], int32
    rows, lens : sequence or Tensor [n]
        The requests' rows in ``req_to_token`` and their token counts.

    Returns
    -------
    Tensor [n], int64, on ``req_to_token``'s device.
    """
    rows, lens = _rows_lens(rows, lens, req_to_token.device)
    if rows.numel() == 0:
        return lens.clone()
    width = max(int(lens.max()), 1)
    tok = req_to_token[rows, :width].to(torch.int64)
    j = torch.arange(1, width, device=tok.device)
    breaks = (tok[:, 1:] != tok[:, :-1] + 1) & (j < lens[:, None])
    return breaks.sum(1) + (lens > 0)


@dataclass
class DefragPlan:
    """What :func:`plan` decided. Apply it with :func:`apply` before the pool changes again.

    ``reason`` is None when every requested compaction fits; otherwise it says why some did
    not (those requests are in ``skipped`` and stay untouched).
    """

    compacted: list = field(default_factory=list)  # rows given one run (in plan order)
    starts: list = field(default_factory=list)  # first slot of each compacted row's run
    lens: list = field(default_factory=list)  # token counts of the compacted rows
    skipped: dict = field(default_factory=dict)  # row -> reason
    src: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    dst: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    old_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    taken: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    released: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    bytes: int = 0  # KV bytes copied (all layers), reads and writes not double counted
    disjoint: bool = True  # no moved-to slot is also moved from: one-pass move_kv
    # What it was planned against: the live requests (rows, lens), their slots and the free
    # list, hashed. apply() refuses the plan once any of it has changed.
    basis: tuple = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), "")

    @property
    def moved_slots(self) -> int:
        return int(self.src.numel())

    @property
    def reason(self) -> Optional[str]:
        if not self.skipped:
            return None
        return "; ".join(f"row {r}: {why}" for r, why in self.skipped.items())


def _slot_bytes(kv_layers) -> int:
    return sum(math.prod(kv.shape[1:]) * kv.element_size() for kv in kv_layers)


def _pool_state(pool: Pool, rows: torch.Tensor, lens: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(hash of the requests' slots and the free list, their slots flattened, the free list)."""
    width = max(int(lens.max()) if rows.numel() else 0, 1)
    tokens = pool.req_to_token[rows.to(pool.req_to_token.device), :width].to("cpu", torch.int64)
    flat = tokens[torch.arange(width) < lens[:, None]]
    free = pool.free().to("cpu", torch.int64)
    h = hashlib.sha256()
    for t in (rows, lens, flat, torch.sort(free).values):
        h.update(t.numpy().tobytes())
        h.update(b"|")
    return h.hexdigest(), tokens, free


def _longest_run(avail: torch.Tensor) -> int:
    edges = torch.diff(torch.cat((avail.new_zeros(1), avail, avail.new_zeros(1))).to(torch.int8))
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    return int((ends - starts).max()) if starts.numel() else 0


def plan(
    pool: Pool,
    rows,
    lens,
    *,
    requests=None,
    min_runs: int = 2,
    byte_budget: Optional[int] = 256 << 20,
    pinned: Optional[torch.Tensor] = None,
) -> DefragPlan:
    """Choose target runs for requests; touches nothing.

    Parameters
    ----------
    pool : TensorPool or SGLangPool
    rows, lens : sequence or Tensor [n]
        Every live request's row in ``req_to_token`` and token count. Slots neither free nor
        owned by these requests are never written.
    requests : sequence of int, optional
        Rows to compact, in this order. Default: every row with at least ``min_runs`` runs,
        most fragmented first.
    min_runs : int
        Fragmentation threshold for the default selection.
    byte_budget : int or None
        Most KV bytes (all layers) to copy in this call; requests that would exceed it are
        skipped ("over budget") and can go next call. None: no limit.
    pinned : Tensor of slots, optional
        Slots held by something other than these requests (e.g. the radix prefix cache).
        A request owning a pinned slot, or a slot another request also owns, is skipped: its
        old slots cannot be freed.

    Returns
    -------
    DefragPlan
    """
    size = pool.size
    rows, lens = _rows_lens(rows, lens, "cpu")
    n = rows.numel()
    uniq, counts = torch.unique(rows, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"rows must be distinct, but row {int(uniq[counts > 1][0])} appears more than once")
    digest, tokens, free = _pool_state(pool, rows, lens)
    width = tokens.shape[1]
    flat = tokens[torch.arange(width) < lens[:, None]]
    who = torch.repeat_interleave(torch.arange(n), lens)

    if ((flat < 1) | (flat > size)).any() or ((free < 1) | (free > size)).any():
        raise ValueError(f"pool bookkeeping holds slots outside 1..{size}")
    used = torch.bincount(flat, minlength=size + 1)
    is_free = torch.bincount(free, minlength=size + 1)
    if (is_free > 1).any() or ((is_free > 0) & (used > 0)).any():
        raise ValueError("pool bookkeeping is inconsistent: a slot is free twice, or free and used")
    blocked = used > 1
    if pinned is not None:
        blocked[torch.as_tensor(pinned, dtype=torch.int64).cpu()] = True
    blocked_req = torch.bincount(who[blocked[flat]], minlength=n) > 0

    owner = torch.full((size + 1,), -2, dtype=torch.int64)  # -1 free, -2 someone else, k request
    owner[free] = -1
    owner[flat] = who
    initially_free = owner == -1

    index = {int(r): k for k, r in enumerate(rows.tolist())}
    if requests is None:
        runs = fragmentation(tokens.to(torch.int32), torch.arange(n), lens)
        order = torch.argsort(-runs, stable=True)
        chosen = [int(rows[k]) for k in order.tolist() if runs[k] >= min_runs]
    else:
        chosen = list(dict.fromkeys(int(r) for r in requests))  # a row named twice is planned once

    out = DefragPlan(basis=(rows, lens, digest))
    per_slot = sum(_slot_bytes(g) for g in pool.kv_groups)
    src, dst, old = [], [], []
    budget = math.inf if byte_budget is None else byte_budget
    for r in chosen:
        k = index.get(r)
        if k is None:
            out.skipped[r] = "not among the given rows"
            continue
        if blocked_req[k]:
            out.skipped[r] = "owns a slot that is pinned or shared with another request"
            continue
        length = int(lens[k])
        s = tokens[k, :length]
        if length == 0:
            continue
        avail = (owner == -1) | (owner == k)
        avail[0] = False
        c = torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(avail, 0)))
        a = torch.arange(1, size + 2 - length)
        ok = (c[a + length] - c[a]) == length
        shift = s - torch.arange(length)
        in_range = (shift >= 1) & (shift <= size + 1 - length)
        matches = torch.bincount(shift[in_range], minlength=size + 2)[a]
        score = torch.where(ok, matches, torch.full_like(matches, -1))
        if a.numel() == 0 or int(score.max()) < 0:
            out.skipped[r] = f"no run of {length} contiguous free slots (longest is {_longest_run(avail)})"
            continue
        start = int(a[torch.argmax(score)])
        run = torch.arange(start, start + length)
        move = s != run
        cost = int(move.sum()) * per_slot
        if cost > budget:
            out.skipped[r] = f"over budget ({cost} bytes to copy, {int(budget)} left)"
            continue
        budget -= cost
        owner[s] = -1
        owner[run] = k
        src.append(s[move])
        dst.append(run[move])
        old.append(s)
        out.compacted.append(r)
        out.starts.append(start)
        out.lens.append(length)
        out.bytes += cost

    final_free = owner == -1
    slots = torch.arange(size + 1)
    out.taken = slots[initially_free & ~final_free]
    out.released = slots[final_free & ~initially_free]  # ascending: later allocations stay contiguous
    if src:
        out.src, out.dst, out.old_slots = torch.cat(src), torch.cat(dst), torch.cat(old)
        out.disjoint = not bool(torch.isin(out.src, out.dst).any())
    return out


def apply(pool: Pool, p: DefragPlan) -> None:
    """Enqueue the plan's copy on the current stream, then update ``req_to_token`` and the
    free list. Raises (changing nothing) if the requests, their slots or the free list moved
    on since :func:`plan` (a request finished or grew, a slot was allocated or freed); a plan
    that moves nothing is a no-op whatever changed."""
    if not p.compacted:
        return
    basis_rows, basis_lens, digest = p.basis
    if _pool_state(pool, basis_rows, basis_lens)[0] != digest:
        raise ValueError("defrag plan is stale: the requests' slots or the free list changed since plan()")
    rtt = pool.req_to_token
    dev = rtt.device
    lens = torch.tensor(p.lens)
    rows = torch.repeat_interleave(torch.tensor(p.compacted), lens)
    cols = torch.cat([torch.arange(n) for n in p.lens])
    if p.moved_slots:
        src, dst = p.src.to(dev), p.dst.to(dev)
        for layers in pool.kv_groups:
            kdtree_ops.move_kv(layers, src, dst, disjoint=p.disjoint)
    starts = torch.repeat_interleave(torch.tensor(p.starts), lens)
    rtt[rows.to(dev), cols.to(dev)] = (starts + cols).to(dev, rtt.dtype)
    pool.update_free(p.taken, p.released)


def defragment(pool: Pool, rows, lens, **kwargs) -> DefragPlan:
    """:func:`plan` then :func:`apply`; keyword arguments go to :func:`plan`."""
    p = plan(pool, rows, lens, **kwargs)
    apply(pool, p)
    return p


def check_partition(pool: Pool, rows, lens, pinned: Optional[torch.Tensor] = None) -> None:
    """Raise unless every slot 1..size is exactly one of: free, owned by one of the requests,
    or pinned."""
    rows, lens = _rows_lens(rows, lens, "cpu")
    width = max(int(lens.max()) if rows.numel() else 0, 1)
    tokens = pool.req_to_token[rows.to(pool.req_to_token.device), :width].to("cpu", torch.int64)
    parts = [tokens[torch.arange(width) < lens[:, None]], pool.free().to("cpu", torch.int64)]
    if pinned is not None:
        parts.append(torch.as_tensor(pinned, dtype=torch.int64).cpu())
    every = torch.sort(torch.cat(parts)).values
    if not torch.equal(every, torch.arange(1, pool.size + 1)):
        raise AssertionError("slot ownership is not a partition of 1..size")
