// build_tree's heap replay: the CPU reference's best-first heap run exactly, one pop per step,
// in one warp (small budgets, and whatever the depth-wise build declines). Included by
// build_tree.cu only.
#pragma once

#include "common.cuh"

namespace kdtree {
namespace {

constexpr int kBuildThreads = 512;
constexpr uint32_t kEmpty = 0xFFFFFFFFu;  // the key of no candidate: it is the key of a NaN only

// The replay runs the heap exactly, one pop per step, in one warp: the
// candidate set is spread over the warp's registers (lane = allocation % 32), each lane caches
// its own best, and a pop is a warp min-reduction over those. Candidates compare by a 32-bit key
// (score descending, float32 order); equal keys fall back to comparing rank tuples through the
// parent links of the nodes already built, which only exact score ties pay for.

// A candidate or node: parent node (11 bits), rank at its depth (10 bits), depth (5 bits).
using NodeId = PackedId<11, 10>;

// Order-preserving map of a float32 score to a key that is smaller for a higher score; -0 and
// +0 map to one key because the reference's heap sees them as equal.
__device__ __forceinline__ uint32_t score_key(float s) {
  uint32_t u = __float_as_uint(s);
  if (u == 0x80000000u) u = 0;
  const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ord;
}
__device__ __forceinline__ float key_score(uint32_t key) {
  const uint32_t ord = ~key;
  return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7FFFFFFFu) : ~ord);
}

template <int S> __device__ __forceinline__ uint32_t get(const uint32_t (&a)[S], int slot) {
  uint32_t v = 0;
#pragma unroll
  for (int j = 0; j < S; ++j) v = j == slot ? a[j] : v;  // registers cannot be indexed at run time
  return v;
}

template <int S>
__device__ __forceinline__ void put(uint32_t (&key)[S], uint32_t (&id)[S], int slot, uint32_t k,
                                    uint32_t v) {
#pragma unroll
  for (int j = 0; j < S; ++j) {
    if (j == slot) {
      key[j] = k;
      id[j] = v;
    }
  }
}

template <int S> __device__ __forceinline__ uint32_t tree_min(const uint32_t* a) {
  if constexpr (S == 1) {
    return a[0];
  } else {
    return min(tree_min<S / 2>(a), tree_min<S - S / 2>(a + S / 2));  // log-depth, not a chain
  }
}

// A lane's best candidate: min key, then the lexicographically first rank tuple among equals.
template <int S>
__device__ __forceinline__ void rescan(const uint32_t (&key)[S], const uint32_t (&id)[S],
                                       const uint32_t* s_id, uint32_t& bkey, uint32_t& bid,
                                       int& bslot) {
  const uint32_t mn = tree_min<S>(key);
  uint32_t eq = 0;
#pragma unroll
  for (int j = 0; j < S; ++j) eq |= (key[j] == mn ? 1u : 0u) << j;
  int bs = __ffs(eq) - 1;
  uint32_t bi = get<S>(id, bs);
  if (mn != kEmpty) {
    // Rolled loop: one inlined copy of the slow comparison, never a call with the slots live.
    for (eq &= eq - 1; eq; eq &= eq - 1) {
      const int j = __ffs(eq) - 1;
      const uint32_t other = get<S>(id, j);
      if (rank_tuple_less<NodeId>(other, bi, s_id)) {
        bs = j;
        bi = other;
      }
    }
  }
  bkey = mn;
  bid = bi;
  bslot = bs;
}

// Warp 0: pops up to `budget` nodes. Node n's score, id and root path go to shared memory;
// returns the node count (root included). lpt[d * lps + r] = log-prob of rank r at depth d + 1.
template <int S>
__device__ int build_warp(const float* lpt, int lps, int L, int keff, int budget, int lp1,
                          float* s_score, uint32_t* s_id, uint16_t* s_path) {
  const int lane = threadIdx.x & 31;
  uint32_t key[S], id[S];
#pragma unroll
  for (int j = 0; j < S; ++j) {
    key[j] = kEmpty;
    id[j] = 0;
  }
  if (lane == 0) {
    key[0] = score_key(__fadd_rn(0.f, lpt[0]));
    id[0] = NodeId::pack(0, 0, 1);
    s_score[0] = 0.f;
    s_id[0] = 0;
    s_path[0] = 0;
  }
  uint32_t bkey = key[0], bid = id[0];
  int bslot = 0;
  __syncwarp();
  int alloc = 1;  // candidates ever stored; one per pop at most, so < budget <= 32 * S
  int n = 1;
  for (; n <= budget; ++n) {
    const uint32_t m = __reduce_min_sync(kFull, bkey);
    if (m == kEmpty) break;  // every prefix is in the tree
    uint32_t wid;
    const int w = pop_lane<NodeId>(bkey == m, bid, s_id, wid);
    const uint32_t p = NodeId::parent(wid), c = NodeId::rank(wid), d = NodeId::depth(wid);
    const float s = key_score(m);
    const bool sib = c + 1 < static_cast<uint32_t>(keff);
    const bool kid = d < static_cast<uint32_t>(L) && n < budget;  // the last pop needs no child
    const uint16_t path = lane < static_cast<int>(d) ? s_path[p * lp1 + lane]
                                                     : static_cast<uint16_t>(n);
    const float sp = s_score[p];
    const float lsib = sib ? lpt[static_cast<int64_t>(d - 1) * lps + c + 1] : 0.f;
    const float lkid = kid ? lpt[static_cast<int64_t>(d) * lps] : 0.f;
    if (lane == 0) {
      s_score[n] = s;
      s_id[n] = wid;
    }
    __syncwarp();  // a tie-break in the rescan below may climb through node n
    const uint32_t sib_key = sib ? score_key(__fadd_rn(sp, lsib)) : kEmpty;
    const uint32_t kid_key = kid ? score_key(__fadd_rn(s, lkid)) : kEmpty;
    const int tgt = alloc & 31;
    if (lane == w) put<S>(key, id, bslot, sib_key, sib ? NodeId::pack(p, c + 1, d) : 0u);
    if (kid && lane == tgt) put<S>(key, id, alloc >> 5, kid_key, NodeId::pack(n, 0, d + 1));
    if (lane == w || (kid && lane == tgt)) rescan<S>(key, id, s_id, bkey, bid, bslot);
    alloc += kid;
    if (lane <= static_cast<int>(d)) s_path[n * lp1 + lane] = path;
    __syncwarp();  // node n's root path is read by every lane from now on
  }
  return n;
}

}  // namespace
}  // namespace kdtree
