// build_tree's depth-wise build: the whole CTA grows the top-budget prefixes a depth at a time
// (budgets over 64). Included by build_tree.cu only.
#pragma once

#include "build_tree_replay.cuh"  // the score keys, node ids and launch constants both builds use

namespace kdtree {
namespace {

// The heap's pop order is the top-`budget` prefixes sorted by (score descending, rank tuple), so
// the tree can be built a depth at a time by the whole CTA: keep S, the best `budget` prefixes
// found so far in that order; a prefix of depth d + 1 can only enter S if its parent is in S
// and, once S is full, its score is at least that of S's last entry. Per depth: count each
// parent's children that pass by binary search over the sorted log-probs; when they are more
// than the budget, raise the bar to the best score that still leaves `budget` prefixes at or
// above it (bisection over score keys, each parent's count bracketed between steps); generate
// the survivors in rank-tuple order, sort them and merge them into S. S is closed under taking
// parents (a parent beats its children), so the children of its deepest entries are the only
// new candidates. When the candidates or the table outgrow their shared memory, or the
// log-probs are not sorted non-positive values, the heap replay runs instead.
//
// Entries live in a table of slots: 0 is the root; a slot's id packs its parent slot (13 bits),
// rank (10 bits) and depth (5 bits); its ordinal is its index among the candidates of its depth,
// which were generated in rank-tuple order, so equal scores compare by ordinal after climbing
// to a common depth.

constexpr int kMaxSlots = 8192, kMaxCandidates = 4096, kReplayMaxBudget = 64;
static_assert(kMaxCandidates <= 8 * kBuildThreads, "block_sort holds 8 keys per thread");
static_assert(kMaxCandidates <= (1 << 19) && kMaxSlots <= (1 << 13), "cand_key's fields");
constexpr uint16_t kNoSlot = 0xFFFFu;
constexpr int kParentsPerThread = kMaxBudget / kBuildThreads;

using SlotId = PackedId<13, 10>;

// A candidate's sort key: score key, then ordinal (rank-tuple order within its depth); its
// parent slot rides in the low bits so the merge's searches need no second lookup.
__device__ __forceinline__ uint64_t cand_key(uint32_t score_key, uint32_t ordinal, uint32_t parent) {
  return static_cast<uint64_t>(score_key) << 32 | ordinal << 13 | parent;
}
__device__ __forceinline__ uint32_t cand_ordinal(uint64_t k) { return static_cast<uint32_t>(k) >> 13; }
__device__ __forceinline__ uint32_t cand_parent(uint64_t k) { return static_cast<uint32_t>(k) & 0x1FFFu; }

// Shared-memory layout of the parallel path; the host sizes the launch with the same function.
struct LevelLayout : Carve {
  size_t ckey, cid, t_score, t_id, sel_key, par_off, lprow, surv, t_ord, node_of, sel_slot,
      par_slot;
  __host__ __device__ LevelLayout(int cand_cap, int slot_cap, int budget, int keff) {
    ckey = take(sizeof(uint64_t) * cand_cap);
    cid = take(sizeof(uint32_t) * cand_cap);
    t_score = take(sizeof(float) * slot_cap);
    t_id = take(sizeof(uint32_t) * slot_cap);
    sel_key = take(sizeof(uint32_t) * 2 * budget);
    par_off = take(sizeof(int32_t) * (budget + 1));
    lprow = take(sizeof(float) * 2 * keff);
    surv = take(sizeof(uint16_t) * cand_cap);
    t_ord = take(sizeof(uint16_t) * slot_cap);
    node_of = take(sizeof(uint16_t) * slot_cap);
    sel_slot = take(sizeof(uint16_t) * 2 * budget);
    par_slot = take(sizeof(uint16_t) * budget);
  }
};


// Sum or max (Max) of one value per thread over the CTA; all threads must call it.
template <bool Max, typename T> __device__ T block_reduce(T v, int* s_scan) {
  static_assert(sizeof(T) == sizeof(int));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto warp_reduce = [](T x) { return Max ? __reduce_max_sync(kFull, x) : __reduce_add_sync(kFull, x); };
  v = warp_reduce(v);
  if (lane == 0) s_scan[warp] = static_cast<int>(v);
  __syncthreads();
  const T t = warp_reduce(lane < static_cast<int>(blockDim.x >> 5) ? static_cast<T>(s_scan[lane]) : T{0});
  __syncthreads();
  return t;
}

// Ascending bitonic sort of the first `count` keys in shared memory by the whole CTA. Thread t
// holds keys E*t .. E*t + E - 1 in registers (past `count`: the largest key), E = 1 .. 8 as
// few as the block allows, so strides below E stay in registers, strides below 32 * E are warp
// shuffles, and only longer ones meet at a barrier.
template <int E, int J>
__device__ __forceinline__ void sort_in_registers(uint64_t (&v)[E], int base, int k) {
  if constexpr (J < E) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((e & J) == 0) {
        const uint64_t x = v[e], y = v[e | J];
        if ((x > y) == (((base + e) & k) == 0)) {
          v[e] = y;
          v[e | J] = x;
        }
      }
    }
  }
}

template <int E> __device__ void block_sort(uint64_t* key, int count, int n) {
  const int base = threadIdx.x * E;
  const bool active = base < n;
  const bool warp_active = (threadIdx.x & ~31) * E < n;
  uint64_t v[E];
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = active && base + e < count ? key[base + e] : ~uint64_t{0};
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j >= 32 * E) {
        if (active) {
#pragma unroll
          for (int e = 0; e < E; ++e) key[base + e] = v[e];
        }
        __syncthreads();
        if (active) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const uint64_t other = key[(base + e) ^ j];
            const bool keep_min = (((base + e) & j) == 0) == (((base + e) & k) == 0);
            v[e] = keep_min ? min(v[e], other) : max(v[e], other);
          }
        }
        __syncthreads();
      } else if (j >= E) {
        if (warp_active) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const uint64_t other = __shfl_xor_sync(kFull, v[e], j / E);
            const bool keep_min = (((base + e) & j) == 0) == (((base + e) & k) == 0);
            v[e] = keep_min ? min(v[e], other) : max(v[e], other);
          }
        }
      } else if (j == 4) {
        sort_in_registers<E, 4>(v, base, k);
      } else if (j == 2) {
        sort_in_registers<E, 2>(v, base, k);
      } else {
        sort_in_registers<E, 1>(v, base, k);
      }
    }
  }
  if (active) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (base + e < count) key[base + e] = v[e];
    }
  }
  __syncthreads();
}

__device__ void block_sort(uint64_t* key, int count) {
  int n = 1;
  while (n < count) n <<= 1;
  if (n <= kBuildThreads) block_sort<1>(key, count, n);
  else if (n <= 2 * kBuildThreads) block_sort<2>(key, count, n);
  else if (n <= 4 * kBuildThreads) block_sort<4>(key, count, n);
  else block_sort<8>(key, count, n);
}

// Ranks r in [lo, hi) of a parent with score s whose child scores are >= t, plus lo: the
// children that pass are a prefix of the ranks, and the caller knows it ends in [lo, hi].
__device__ __forceinline__ int children_at_least(const float* lprow, int lo, int hi, float s, float t) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__fadd_rn(s, lprow[mid]) >= t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

struct LevelState {
  uint64_t* ckey;      // candidates' cand_key, sorted
  uint32_t* cid;       // [ordinal] candidate id
  float* t_score;      // [slot]
  uint32_t* t_id;      // [slot]
  uint32_t* sel_key;   // [2][budget] score keys of S, double-buffered
  int32_t* par_off;    // [parents + 1] first candidate of each parent
  float* lprow;        // [2][keff] log-probs of the depth being built and the next
  uint16_t* surv;      // [ordinal] slot of a candidate that entered S, else kNoSlot
  uint16_t* t_ord;     // [slot]
  uint16_t* node_of;   // [slot] node index once S is final
  uint16_t* sel_slot;  // [2][budget] slots of S
  uint16_t* par_slot;  // [parents] parents of the next depth, in rank-tuple order
};

// True when entry x of S (score key xk) comes before a depth-dc candidate with score key ck
// whose parent is slot cp: by score, then by rank tuple.
__device__ __forceinline__ bool entry_before(const LevelState& st, uint32_t x, uint32_t xk,
                                             uint32_t ck, uint32_t cp, uint32_t dc) {
  if (xk != ck) return xk < ck;
  const uint32_t dx = SlotId::depth(st.t_id[x]);
  uint32_t a = cp;
  for (uint32_t da = dc - 1; da > dx; --da) a = SlotId::parent(st.t_id[a]);
  if (a == x) return true;  // x is a prefix of the candidate
  return st.t_ord[x] < st.t_ord[a];
}

// Builds the tree a depth at a time into s_id (node ids as NodeId) and returns the node
// count, or 0 when a capacity ran out (the caller then replays the heap). Every thread calls it.
__device__ int build_levels(const float* g_lp, int K, int L, int keff, int budget, int cand_cap,
                            int slot_cap, const LevelState& st, uint32_t* s_id, int* s_scan) {
  __shared__ int s_fail, s_kept;
  const int tid = threadIdx.x, nt = blockDim.x;
  // The depth-wise argument needs each depth's log-probs sorted and <= 0 (children never beat
  // their parent); for anything else the heap still defines a tree, so it is replayed. A depth
  // is checked before it is used: depths below the last one built cannot matter to the heap
  // either, since it pops `budget` nodes before any of their parents.
  auto out_of_order = [](int r, float v, float before) { return !(v <= 0.f) || (r > 0 && v > before); };
  bool unsorted = false;
  if (tid == 0) {
    st.t_score[0] = 0.f;
    st.t_id[0] = SlotId::pack(0, 0, 0);
    st.t_ord[0] = 0;
    st.par_slot[0] = 0;
    s_fail = 0;
  }
  for (int r = tid; r < keff; r += nt) {
    st.lprow[r] = g_lp[r];
    unsorted |= out_of_order(r, g_lp[r], r > 0 ? g_lp[r - 1] : 0.f);
  }
  int m = 0, cur = 0, slots = 1, parents = 1;
  for (int d = 0; d < L; ++d) {
    if (__syncthreads_or(unsorted)) return 0;
    const float* lprow = st.lprow + (d & 1) * keff;
    // The next depth's log-probs are loaded now, checked and stored at the end of this one.
    float next[kParentsPerThread], before[kParentsPerThread];
#pragma unroll
    for (int j = 0; j < kParentsPerThread; ++j) {
      const int r = tid + j * kBuildThreads;
      const float* row = g_lp + static_cast<int64_t>(d + 1) * K;
      next[j] = d + 1 < L && r < keff ? row[r] : 0.f;
      before[j] = d + 1 < L && r < keff && r > 0 ? row[r - 1] : 0.f;
    }
    const uint16_t* sel = st.sel_slot + cur * budget;
    const uint32_t* selk = st.sel_key + cur * budget;
    const bool full = m == budget;
    const float tau = full ? key_score(selk[budget - 1]) : -INFINITY;

    // A thread owns parents p0 + j, j < kParentsPerThread; hi[j] = its children that pass.
    const int p0 = tid * kParentsPerThread;
    float sp[kParentsPerThread];
    int lo[kParentsPerThread], hi[kParentsPerThread];
    int mine = 0;
#pragma unroll
    for (int j = 0; j < kParentsPerThread; ++j) {
      const bool own = p0 + j < parents;
      sp[j] = own ? st.t_score[st.par_slot[p0 + j]] : 0.f;
      lo[j] = 0;
      hi[j] = !own ? 0 : full ? children_at_least(lprow, 0, keff, sp[j], tau) : keff;
      mine += hi[j];
    }
    int nc = block_reduce<false>(mine, s_scan);
    if (nc > budget) {
      // Bisection for the smallest score key kb such that S and the candidates hold at least
      // `budget` entries with key <= kb: everything worse can never enter S.
      uint32_t khi = full ? selk[budget - 1] : 0u;
      if (!full) {
        uint32_t worst = m > 0 ? selk[m - 1] : 0u;
#pragma unroll
        for (int j = 0; j < kParentsPerThread; ++j) {
          if (hi[j] > 0) worst = max(worst, score_key(__fadd_rn(sp[j], lprow[keff - 1])));
        }
        khi = block_reduce<true>(worst, s_scan);
      }
      uint32_t klo = selk[0];
      while (klo < khi && nc > budget) {
        const uint32_t mid = klo + (khi - klo) / 2;
        const float t = key_score(mid);
        int cnt[kParentsPerThread], sum = 0;
#pragma unroll
        for (int j = 0; j < kParentsPerThread; ++j) {
          cnt[j] = children_at_least(lprow, lo[j], hi[j], sp[j], t);
          sum += cnt[j];
        }
        int in_s = 0, top = m;  // entries of S with key <= mid
        while (in_s < top) {
          const int q = (in_s + top) >> 1;
          if (selk[q] <= mid) in_s = q + 1;
          else top = q;
        }
        const int total = block_reduce<false>(sum, s_scan);
        const bool enough = total + in_s >= budget;
#pragma unroll
        for (int j = 0; j < kParentsPerThread; ++j) (enough ? hi[j] : lo[j]) = cnt[j];
        if (enough) {
          khi = mid;
          nc = total;
        } else {
          klo = mid + 1;
        }
      }
    }
    if (nc > cand_cap) return 0;  // uniform: nc is the same in every thread
    if (nc == 0) break;
    mine = 0;
#pragma unroll
    for (int j = 0; j < kParentsPerThread; ++j) mine += hi[j];
    int run = block_exclusive_scan(mine, s_scan, nc);
#pragma unroll
    for (int j = 0; j < kParentsPerThread; ++j) {
      if (p0 + j < parents) st.par_off[p0 + j] = run;
      run += hi[j];
    }
    if (tid == 0) st.par_off[parents] = nc;
    __syncthreads();

    // Candidates in rank-tuple order: ordinal g belongs to the parent whose run holds g.
    for (int g = tid; g < nc; g += nt) {
      int a = 0, b = parents;  // last parent with par_off <= g
      while (b - a > 1) {
        const int mid = (a + b) >> 1;
        if (st.par_off[mid] <= g) a = mid;
        else b = mid;
      }
      const uint32_t ps = st.par_slot[a], r = g - st.par_off[a];
      const float sc = __fadd_rn(st.t_score[ps], lprow[r]);
      st.ckey[g] = cand_key(score_key(sc), g, ps);
      st.cid[g] = SlotId::pack(ps, r, d + 1);
    }
    if (tid == 0) s_kept = 0;
    __syncthreads();
    if (parents > 1) block_sort(st.ckey, nc);  // one parent's children are already in order

    // Merge S and the candidates; positions past the budget drop out.
    uint16_t* sel2 = st.sel_slot + (cur ^ 1) * budget;
    uint32_t* selk2 = st.sel_key + (cur ^ 1) * budget;
    const uint32_t dc = d + 1;
    for (int i = tid; i < m; i += nt) {
      const uint32_t x = sel[i], xk = selk[i];
      int a = 0, b = nc;  // candidates before x
      while (a < b) {
        const int mid = (a + b) >> 1;
        const uint64_t k = st.ckey[mid];
        if (!entry_before(st, x, xk, static_cast<uint32_t>(k >> 32), cand_parent(k), dc)) a = mid + 1;
        else b = mid;
      }
      const int pos = i + a;
      if (pos < budget) {
        sel2[pos] = static_cast<uint16_t>(x);
        selk2[pos] = xk;
      }
    }
    for (int j = tid; j < nc; j += nt) {
      const uint64_t k = st.ckey[j];
      const uint32_t g = cand_ordinal(k), ck = static_cast<uint32_t>(k >> 32), cp = cand_parent(k);
      int a = 0, b = m;  // entries of S before the candidate
      while (a < b) {
        const int mid = (a + b) >> 1;
        if (entry_before(st, sel[mid], selk[mid], ck, cp, dc)) a = mid + 1;
        else b = mid;
      }
      const int pos = j + a;
      uint16_t slot = kNoSlot;
      if (pos < budget) {
        // Kept candidates are a prefix of the sorted ones, so their slots are contiguous.
        if (slots + j >= slot_cap) {
          s_fail = 1;
        } else {
          slot = static_cast<uint16_t>(slots + j);
          sel2[pos] = slot;
          selk2[pos] = ck;
          st.t_score[slot] = key_score(ck);
          st.t_id[slot] = st.cid[g];
          st.t_ord[slot] = static_cast<uint16_t>(g);
          atomicMax(&s_kept, j + 1);
        }
      }
      st.surv[g] = slot;
    }
    __syncthreads();
    if (s_fail) return 0;
    m = min(budget, m + nc);
    cur ^= 1;
    slots += s_kept;

    // The kept candidates, in rank-tuple order, are the next depth's parents.
    const int per_c = (nc + nt - 1) / nt, c0 = min(nc, tid * per_c), c1 = min(nc, c0 + per_c);
    int flagged = 0;
    for (int g = c0; g < c1; ++g) flagged += st.surv[g] != kNoSlot;
    int at = block_exclusive_scan(flagged, s_scan, parents);
    for (int g = c0; g < c1; ++g) {
      if (st.surv[g] != kNoSlot) st.par_slot[at++] = st.surv[g];
    }
#pragma unroll
    for (int j = 0; j < kParentsPerThread; ++j) {
      const int r = tid + j * kBuildThreads;
      if (d + 1 < L && r < keff) {
        st.lprow[((d + 1) & 1) * keff + r] = next[j];
        unsorted |= out_of_order(r, next[j], before[j]);
      }
    }
    if (parents == 0) break;  // nothing deeper can enter S
  }
  __syncthreads();

  const uint16_t* sel = st.sel_slot + cur * budget;
  if (tid == 0) st.node_of[0] = 0;
  for (int i = tid; i < m; i += nt) st.node_of[sel[i]] = static_cast<uint16_t>(i + 1);
  __syncthreads();
  if (tid == 0) s_id[0] = NodeId::pack(0, 0, 0);
  for (int i = tid; i < m; i += nt) {
    const uint32_t u = st.t_id[sel[i]];
    s_id[i + 1] = NodeId::pack(st.node_of[SlotId::parent(u)], SlotId::rank(u), SlotId::depth(u));
  }
  __syncthreads();
  return m + 1;
}

}  // namespace
}  // namespace kdtree
