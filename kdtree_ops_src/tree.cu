// DDTree on the GPU (Ringel & Romano 2026, arXiv 2604.12989): best-first tree build, verify metadata (positions, EAGLE
// retrieve arrays, SGLang's flat custom mask) and the accept walk. One CTA per request; no
// allocation depends on device data, so every launch is capturable in a CUDA graph.
#include "common.cuh"

namespace kdtree {
namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kMaxBudget = 1024;
constexpr int kMaxDepth = 31;  // a node's root path fits one warp, its depth five bits
constexpr int kBuildThreads = 512;
constexpr uint32_t kEmpty = 0xFFFFFFFFu;  // the key of no candidate: it is the key of a NaN only

// ---- build_tree ----------------------------------------------------------------------------
//
// Two builds with identical results: the depth-wise one below (build_levels) for budgets over
// 64, and a replay of the CPU reference's heap for small budgets and whatever the depth-wise
// build declines.
//
// The replay runs the heap exactly, one pop per step, in one warp: the
// candidate set is spread over the warp's registers (lane = allocation % 32), each lane caches
// its own best, and a pop is a warp min-reduction over those. Candidates compare by a 32-bit key
// (score descending, float32 order); equal keys fall back to comparing rank tuples through the
// parent links of the nodes already built, which only exact score ties pay for.

// A candidate or node: parent node (11 bits), rank at its depth (10 bits), depth (5 bits).
__device__ __forceinline__ uint32_t pack_id(uint32_t parent, uint32_t rank, uint32_t depth) {
  return parent | rank << 11 | depth << 21;
}
__device__ __forceinline__ uint32_t id_parent(uint32_t id) { return id & 0x7FFu; }
__device__ __forceinline__ uint32_t id_rank(uint32_t id) { return (id >> 11) & 0x3FFu; }
__device__ __forceinline__ uint32_t id_depth(uint32_t id) { return id >> 21; }

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

// True when candidate x's rank tuple precedes y's lexicographically (a proper prefix first).
// x and y are distinct; their parents and all their ancestors are built nodes in s_id.
__device__ __forceinline__ bool lex_less(uint32_t x, uint32_t y, const uint32_t* s_id) {
  uint32_t px = id_parent(x), cx = id_rank(x), dx = id_depth(x);
  uint32_t py = id_parent(y), cy = id_rank(y), dy = id_depth(y);
  bool y_longer = false;
  while (dx > dy) {  // x -> its ancestor at y's depth
    const uint32_t u = s_id[px];
    cx = id_rank(u);
    px = id_parent(u);
    --dx;
  }
  while (dy > dx) {
    const uint32_t u = s_id[py];
    cy = id_rank(u);
    py = id_parent(u);
    --dy;
    y_longer = true;
  }
  if (px == py) return cx != cy ? cx < cy : y_longer;  // equal up to here: the prefix is first
  for (;;) {  // distinct nodes at one depth >= 1: climb to the children of their common ancestor
    const uint32_t u = s_id[px], v = s_id[py];
    if (id_parent(u) == id_parent(v)) return id_rank(u) < id_rank(v);
    px = id_parent(u);
    py = id_parent(v);
  }
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
      if (lex_less(other, bi, s_id)) {
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
    id[0] = pack_id(0, 0, 1);
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
    const unsigned tie = __ballot_sync(kFull, bkey == m);
    int w = __ffs(tie) - 1;
    uint32_t wid = __shfl_sync(kFull, bid, w);
    for (unsigned rest = tie & (tie - 1); rest; rest &= rest - 1) {
      const int l = __ffs(rest) - 1;
      const uint32_t other = __shfl_sync(kFull, bid, l);
      if (lex_less(other, wid, s_id)) {
        w = l;
        wid = other;
      }
    }
    const uint32_t p = id_parent(wid), c = id_rank(wid), d = id_depth(wid);
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
    if (lane == w) put<S>(key, id, bslot, sib_key, sib ? pack_id(p, c + 1, d) : 0u);
    if (kid && lane == tgt) put<S>(key, id, alloc >> 5, kid_key, pack_id(n, 0, d + 1));
    if (lane == w || (kid && lane == tgt)) rescan<S>(key, id, s_id, bkey, bid, bslot);
    alloc += kid;
    if (lane <= static_cast<int>(d)) s_path[n * lp1 + lane] = path;
    __syncwarp();  // node n's root path is read by every lane from now on
  }
  return n;
}

// ---- build_tree, parallel path ---------------------------------------------------------------
//
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

__device__ __forceinline__ uint32_t pack_slot(uint32_t parent, uint32_t rank, uint32_t depth) {
  return parent | rank << 13 | depth << 23;
}
__device__ __forceinline__ uint32_t slot_parent(uint32_t id) { return id & 0x1FFFu; }
__device__ __forceinline__ uint32_t slot_rank(uint32_t id) { return (id >> 13) & 0x3FFu; }
__device__ __forceinline__ uint32_t slot_depth(uint32_t id) { return id >> 23; }

// A candidate's sort key: score key, then ordinal (rank-tuple order within its depth); its
// parent slot rides in the low bits so the merge's searches need no second lookup.
__device__ __forceinline__ uint64_t cand_key(uint32_t score_key, uint32_t ordinal, uint32_t parent) {
  return static_cast<uint64_t>(score_key) << 32 | ordinal << 13 | parent;
}
__device__ __forceinline__ uint32_t cand_ordinal(uint64_t k) { return static_cast<uint32_t>(k) >> 13; }
__device__ __forceinline__ uint32_t cand_parent(uint64_t k) { return static_cast<uint32_t>(k) & 0x1FFFu; }

// Shared-memory layout of the parallel path; the host sizes the launch with the same function.
struct LevelLayout {
  size_t ckey, cid, t_score, t_id, sel_key, par_off, lprow, surv, t_ord, node_of, sel_slot,
      par_slot, bytes;
  __host__ __device__ LevelLayout(int cand_cap, int slot_cap, int budget, int keff) {
    size_t o = 0;
    auto take = [&o](size_t n) { const size_t at = o; o += (n + 15) / 16 * 16; return at; };
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
    bytes = o;
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
  const uint32_t dx = slot_depth(st.t_id[x]);
  uint32_t a = cp;
  for (uint32_t da = dc - 1; da > dx; --da) a = slot_parent(st.t_id[a]);
  if (a == x) return true;  // x is a prefix of the candidate
  return st.t_ord[x] < st.t_ord[a];
}

// Builds the tree a depth at a time into s_id (node ids as pack_id) and returns the node
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
    st.t_id[0] = pack_slot(0, 0, 0);
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
      st.cid[g] = pack_slot(ps, r, d + 1);
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
  if (tid == 0) s_id[0] = pack_id(0, 0, 0);
  for (int i = tid; i < m; i += nt) {
    const uint32_t u = st.t_id[sel[i]];
    s_id[i + 1] = pack_id(st.node_of[slot_parent(u)], slot_rank(u), slot_depth(u));
  }
  __syncthreads();
  return m + 1;
}

struct BuildArgs {
  const float* lp;       // [B, L, K]
  const void* tok;       // [B, L, K] int32 or int64
  const int64_t* root;   // [B]
  int64_t* tokens;       // [B, N]
  int32_t* parents;      // [B, N]
  int32_t* depths;       // [B, N]
  int32_t* num_nodes;    // [B]
  int32_t* mask;         // [B, N, W]
  int L, K, keff, budget, N, W;
  int cand_cap, slot_cap;  // capacities of the parallel path, 0 = heap replay only
  bool lp_in_smem;
};

template <int S, typename Tok>
__global__ void __launch_bounds__(kBuildThreads, 1) build_tree_kernel(BuildArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_nodes, s_scan[33];
  const int b = blockIdx.x, N = a.N, lp1 = a.L + 1;
  float* s_score = reinterpret_cast<float*>(smem);
  uint32_t* s_id = reinterpret_cast<uint32_t*>(s_score + N);
  unsigned char* region = reinterpret_cast<unsigned char*>(s_id + N);  // one path's scratch
  float* s_lp = reinterpret_cast<float*>(region);
  uint16_t* s_path = reinterpret_cast<uint16_t*>(s_lp + (a.lp_in_smem ? a.L * a.keff : 0));
  const float* g_lp = a.lp + static_cast<int64_t>(b) * a.L * a.K;

  int nn = 0;
  if (a.cand_cap > 0) {
    const LevelLayout lay(a.cand_cap, a.slot_cap, a.budget, a.keff);
    const LevelState st{at_offset<uint64_t>(region, lay.ckey),     at_offset<uint32_t>(region, lay.cid),
                        at_offset<float>(region, lay.t_score),     at_offset<uint32_t>(region, lay.t_id),
                        at_offset<uint32_t>(region, lay.sel_key),  at_offset<int32_t>(region, lay.par_off),
                        at_offset<float>(region, lay.lprow),       at_offset<uint16_t>(region, lay.surv),
                        at_offset<uint16_t>(region, lay.t_ord),    at_offset<uint16_t>(region, lay.node_of),
                        at_offset<uint16_t>(region, lay.sel_slot), at_offset<uint16_t>(region, lay.par_slot)};
    nn = build_levels(g_lp, a.K, a.L, a.keff, a.budget, a.cand_cap, a.slot_cap, st, s_id, s_scan);
    for (int i = threadIdx.x; i < nn; i += blockDim.x) {  // root paths, for the mask below
      uint32_t node = i;
      for (int k = static_cast<int>(id_depth(s_id[i])); k >= 0; --k) {
        s_path[i * lp1 + k] = static_cast<uint16_t>(node);
        node = id_parent(s_id[node]);
      }
    }
  }
  if (nn == 0) {
    const float* lpt = g_lp;
    int lps = a.K;
    __syncthreads();  // the parallel path's scratch is reused
    if (a.lp_in_smem) {  // the pop loop's loads are its critical path: keep them on chip
      for (int i = threadIdx.x; i < a.L * a.keff; i += blockDim.x) {
        const int d = i / a.keff;
        s_lp[i] = g_lp[static_cast<int64_t>(d) * a.K + (i - d * a.keff)];
      }
      lpt = s_lp;
      lps = a.keff;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      const int n = build_warp<S>(lpt, lps, a.L, a.keff, a.budget, lp1, s_score, s_id, s_path);
      if (threadIdx.x == 0) s_nodes = n;
    }
    __syncthreads();
    nn = s_nodes;
  }
  __syncthreads();

  const Tok* tok = static_cast<const Tok*>(a.tok);
  const int64_t row0 = static_cast<int64_t>(b) * N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    int64_t t = 0;
    int32_t par = -1, dep = 0;
    if (i == 0) {
      t = a.root[b];
    } else if (i < nn) {
      const uint32_t u = s_id[i];
      dep = static_cast<int32_t>(id_depth(u));
      par = static_cast<int32_t>(id_parent(u));
      t = static_cast<int64_t>(tok[(static_cast<int64_t>(b) * a.L + dep - 1) * a.K + id_rank(u)]);
    }
    a.tokens[row0 + i] = t;
    a.parents[row0 + i] = par;
    a.depths[row0 + i] = dep;
  }
  if (threadIdx.x == 0) a.num_nodes[b] = nn;

  // Ancestor mask: one warp per row, lane l owns words l and l + 32 (W <= 33).
  const int lane = threadIdx.x & 31;
  for (int row = threadIdx.x >> 5; row < N; row += blockDim.x >> 5) {
    uint32_t w0 = 0, w1 = 0;
    if (row < nn) {
      const int d = static_cast<int>(id_depth(s_id[row]));
      for (int k = 0; k <= d; ++k) {
        const uint32_t anc = s_path[row * lp1 + k];
        const uint32_t bit = 1u << (anc & 31);
        if (anc >> 5 == static_cast<uint32_t>(lane)) w0 |= bit;
        if (anc >> 5 == static_cast<uint32_t>(lane + 32)) w1 |= bit;
      }
    }
    int32_t* out = a.mask + (row0 + row) * a.W;
    if (lane < a.W) out[lane] = static_cast<int32_t>(w0);
    if (lane + 32 < a.W) out[lane + 32] = static_cast<int32_t>(w1);
  }
}

void check_contiguous(const at::Tensor& t, const char* name) {
  KD_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

int max_smem_optin(const at::Tensor& on) {
  int v = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, on.get_device()));
  return v;
}

template <int S, typename Tok>
void launch_build(const BuildArgs& a, int B, size_t smem) {
  auto kernel = build_tree_kernel<S, Tok>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  kernel<<<B, kBuildThreads, smem, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Tok>
void dispatch_slots(const BuildArgs& a, int B, size_t smem) {
  // Per-lane candidate slots: the smallest power of two with 32 * S >= budget.
  if (a.budget <= 32) launch_build<1, Tok>(a, B, smem);
  else if (a.budget <= 64) launch_build<2, Tok>(a, B, smem);
  else if (a.budget <= 128) launch_build<4, Tok>(a, B, smem);
  else if (a.budget <= 256) launch_build<8, Tok>(a, B, smem);
  else if (a.budget <= 512) launch_build<16, Tok>(a, B, smem);
  else launch_build<32, Tok>(a, B, smem);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_tree(
    const at::Tensor& topk_logprobs, const at::Tensor& topk_tokens, const at::Tensor& root_tokens,
    int64_t budget) {
  check_cuda(topk_logprobs, "topk_logprobs", topk_logprobs);
  check_cuda(topk_tokens, "topk_tokens", topk_logprobs);
  check_cuda(root_tokens, "root_tokens", topk_logprobs);
  check_dim(topk_logprobs, "topk_logprobs", 3);
  check_dtype(topk_logprobs, "topk_logprobs", at::kFloat);
  check_contiguous(topk_logprobs, "topk_logprobs");
  check_index(topk_tokens, "topk_tokens");
  KD_CHECK(topk_tokens.sizes() == topk_logprobs.sizes(), "topk_tokens must have shape ",
           topk_logprobs.sizes(), " like topk_logprobs, got ", topk_tokens.sizes());
  check_contiguous(topk_tokens, "topk_tokens");
  const int64_t B = topk_logprobs.size(0), L = topk_logprobs.size(1), K = topk_logprobs.size(2);
  check_dim(root_tokens, "root_tokens", 1);
  check_dtype(root_tokens, "root_tokens", at::kLong);
  KD_CHECK(root_tokens.size(0) == B, "root_tokens must have shape [", B, "], got ",
           root_tokens.sizes());
  check_contiguous(root_tokens, "root_tokens");
  KD_CHECK(budget >= 1 && budget <= kMaxBudget, "budget must be in [1, ", kMaxBudget, "], got ",
           budget);
  KD_CHECK(L >= 1 && L <= kMaxDepth, "topk_logprobs must have 1 to ", kMaxDepth,
           " positions (dim 1), got ", L);
  KD_CHECK(K >= 1 && K <= INT32_MAX, "topk_logprobs must have 1 to ", INT32_MAX,
           " ranks (dim 2), got ", K);

  const int64_t N = budget + 1, W = (N + 31) / 32;
  const auto opts = topk_logprobs.options();
  at::Tensor tokens = at::empty({B, N}, opts.dtype(at::kLong));
  at::Tensor parents = at::empty({B, N}, opts.dtype(at::kInt));
  at::Tensor depths = at::empty({B, N}, opts.dtype(at::kInt));
  at::Tensor num_nodes = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor mask = at::empty({B, N, W}, opts.dtype(at::kInt));
  if (B == 0) return {tokens, parents, depths, num_nodes, mask};

  const c10::cuda::CUDAGuard guard(topk_logprobs.device());
  BuildArgs a{};
  a.lp = topk_logprobs.data_ptr<float>();
  a.tok = topk_tokens.data_ptr();
  a.root = root_tokens.data_ptr<int64_t>();
  a.tokens = tokens.data_ptr<int64_t>();
  a.parents = parents.data_ptr<int32_t>();
  a.depths = depths.data_ptr<int32_t>();
  a.num_nodes = num_nodes.data_ptr<int32_t>();
  a.mask = mask.data_ptr<int32_t>();
  a.L = static_cast<int>(L);
  a.K = static_cast<int>(K);
  a.keff = static_cast<int>(std::min<int64_t>(K, budget));
  a.budget = static_cast<int>(budget);
  a.N = static_cast<int>(N);
  a.W = static_cast<int>(W);
  const size_t base = static_cast<size_t>(N) * 2 * sizeof(float);
  const size_t path_bytes = static_cast<size_t>(N) * (L + 1) * sizeof(uint16_t);
  const size_t lp_bytes = static_cast<size_t>(L) * a.keff * sizeof(float);
  const size_t limit = static_cast<size_t>(max_smem_optin(topk_logprobs)) - 1024;  // static smem
  a.lp_in_smem = base + lp_bytes + path_bytes <= limit;
  size_t region = path_bytes + (a.lp_in_smem ? lp_bytes : 0);
  // The parallel path needs room for a depth's candidates (about the budget once the bar is
  // raised) and N table slots; more room only lets deeper or bushier trees avoid the replay.
  a.cand_cap = a.slot_cap = 0;
  // Small budgets replay faster than the depth-wise build, which pays about 10 us per depth
  // (H200, 8 requests: 6 us vs 15 us at budget 16; at 64, 26 us vs 17 us for a 3-deep tree
  // but 54 us vs 128 us for a 15-deep one).
  const bool depthwise = a.budget > kReplayMaxBudget;
  for (int cand = kMaxCandidates; depthwise && !a.cand_cap && cand >= a.budget && cand >= a.keff; cand /= 2) {
    for (int slot = kMaxSlots; slot >= cand && slot > a.budget; slot /= 2) {
      const size_t bytes = LevelLayout(cand, slot, a.budget, a.keff).bytes;
      if (base + bytes <= limit) {
        a.cand_cap = cand;
        a.slot_cap = slot;
        region = std::max(region, bytes);
        break;
      }
    }
  }
  const size_t smem = base + region;
  if (topk_tokens.scalar_type() == at::kInt) {
    dispatch_slots<int32_t>(a, static_cast<int>(B), smem);
  } else {
    dispatch_slots<int64_t>(a, static_cast<int>(B), smem);
  }
  return {tokens, parents, depths, num_nodes, mask};
}

// ---- verify_metadata -----------------------------------------------------------------------

template <typename I>
__global__ void verify_metadata_kernel(const int32_t* __restrict__ depths,
                                       const int32_t* __restrict__ parents,
                                       const I* __restrict__ prefix_lens, int B, int N,
                                       bool retrieve, int64_t* positions, int32_t* qo_indptr,
                                       int64_t* r_index, int64_t* r_next, int64_t* r_sibling) {
  extern __shared__ int32_t s_head[];  // [N]: lowest-index child seen so far, -1 if none
  const int b = blockIdx.x;
  const int64_t row0 = static_cast<int64_t>(b) * N;
  const int64_t prefix = static_cast<int64_t>(prefix_lens[b]);
  for (int i = threadIdx.x; i < N; i += blockDim.x) positions[row0 + i] = prefix + depths[row0 + i];
  if (threadIdx.x == 0) {
    qo_indptr[b] = b * N;
    if (b == B - 1) qo_indptr[B] = B * N;
  }
  if (!retrieve) return;  // uniform across the block

  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    s_head[i] = -1;
    r_index[row0 + i] = row0 + i;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    // Children lists in index order, like sglang's build_tree_kernel_efficient, which prepends
    // nodes from last to first: 32 nodes per step from the top, peers found by __match_any.
    const int lane = threadIdx.x;
    for (int base = (N - 1) & ~31; base >= 0; base -= 32) {
      const int j = base + lane;
      int p = j < N ? parents[row0 + j] : -1;
      if (p >= N) p = -1;  // out-of-range parent: not a child (keeps shared memory in bounds)
      const unsigned peers = __match_any_sync(kFull, p);
      const unsigned above = lane == 31 ? 0u : peers & (~0u << (lane + 1));
      int64_t sibling = -1;
      if (p >= 0) sibling = above ? base + __ffs(above) - 1 : s_head[p];
      if (j < N) r_sibling[row0 + j] = sibling;
      __syncwarp();
      if (p >= 0 && lane == __ffs(peers) - 1) s_head[p] = j;
      __syncwarp();
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < N; i += blockDim.x) r_next[row0 + i] = s_head[i];
}

void check_tree_arg(const at::Tensor& t, const char* name, const at::Tensor& like,
                    at::ScalarType dtype) {
  check_cuda(t, name, like);
  check_dim(t, name, 2);
  check_dtype(t, name, dtype);
  check_contiguous(t, name);
  KD_CHECK(t.sizes() == like.sizes(), name, " must have shape ", like.sizes(), ", got ",
           t.sizes());
}

void check_prefix_lens(const at::Tensor& prefix_lens, const at::Tensor& like, int64_t B) {
  check_cuda(prefix_lens, "prefix_lens", like);
  check_dim(prefix_lens, "prefix_lens", 1);
  check_index(prefix_lens, "prefix_lens");
  check_contiguous(prefix_lens, "prefix_lens");
  KD_CHECK(prefix_lens.size(0) == B, "prefix_lens must have shape [", B, "], got ",
           prefix_lens.sizes());
}

template <typename F> void dispatch_index(at::ScalarType dtype, F&& f) {
  if (dtype == at::kInt) f(int32_t{});
  else f(int64_t{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_metadata(
    const at::Tensor& depths, const at::Tensor& parents, const at::Tensor& prefix_lens,
    bool retrieve) {
  check_tree_arg(depths, "depths", depths, at::kInt);
  check_tree_arg(parents, "parents", depths, at::kInt);
  const int64_t B = depths.size(0), N = depths.size(1);
  check_prefix_lens(prefix_lens, depths, B);
  KD_CHECK(B * N < INT32_MAX, "depths has too many nodes for int32 qo_indptr: ", depths.sizes());

  const auto opts = depths.options();
  at::Tensor positions = at::empty({B * N}, opts.dtype(at::kLong));
  at::Tensor qo_indptr = at::empty({B + 1}, opts.dtype(at::kInt));
  const std::vector<int64_t> rshape = retrieve ? std::vector<int64_t>{B, N} : std::vector<int64_t>{0};
  at::Tensor r_index = at::empty(rshape, opts.dtype(at::kLong));
  at::Tensor r_next = at::empty(rshape, opts.dtype(at::kLong));
  at::Tensor r_sibling = at::empty(rshape, opts.dtype(at::kLong));
  if (B == 0) {
    qo_indptr.zero_();
    return {positions, qo_indptr, r_index, r_next, r_sibling};
  }
  KD_CHECK(N >= 1, "depths must have at least one node per request, got ", depths.sizes());
  KD_CHECK(N * sizeof(int32_t) <= 48 * 1024, "depths has too many nodes per request: ", N);

  const c10::cuda::CUDAGuard guard(depths.device());
  dispatch_index(prefix_lens.scalar_type(), [&](auto tag) {
    using I = decltype(tag);
    const size_t smem = retrieve ? N * sizeof(int32_t) : 0;
    verify_metadata_kernel<I><<<B, 256, smem, current_stream()>>>(
        depths.data_ptr<int32_t>(), parents.data_ptr<int32_t>(), prefix_lens.data_ptr<I>(),
        static_cast<int>(B), static_cast<int>(N), retrieve, positions.data_ptr<int64_t>(),
        qo_indptr.data_ptr<int32_t>(), retrieve ? r_index.data_ptr<int64_t>() : nullptr,
        retrieve ? r_next.data_ptr<int64_t>() : nullptr,
        retrieve ? r_sibling.data_ptr<int64_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {positions, qo_indptr, r_index, r_next, r_sibling};
}

// ---- flat_custom_mask ----------------------------------------------------------------------
//
// SGLang's FULL_MASK layout: request b's block starts at mask_indptr[b] and holds N rows of
// prefix_len_b + N bools, the prefix all true, then the tree row. Writing the prefix columns is
// the whole cost (O(context)); everything else is O(N^2) per request.

// One warp: B is the batch size, so a shuffle scan over chunks of 32 is plenty.
template <typename I>
__global__ void mask_indptr_kernel(const I* __restrict__ prefix_lens, int B, int N,
                                   int64_t* mask_indptr) {
  const int lane = threadIdx.x;
  int64_t carry = 0;
  for (int base = 0; base < B; base += 32) {
    const int b = base + lane;
    const int64_t prefix = b < B ? max(static_cast<int64_t>(prefix_lens[b]), int64_t{0}) : 0;
    const int64_t size = b < B ? N * (prefix + N) : 0;
    const int64_t incl = warp_inclusive_scan(size);
    if (b < B) mask_indptr[b] = carry + incl - size;
    carry += __shfl_sync(kFull, incl, 31);
  }
  if (lane == 0) mask_indptr[B] = carry;
}

constexpr int kFillThreads = 256;
constexpr int kTailBlocks = 132;

// Blocks [0, B*N): one tree row each. Blocks after: clear [mask_indptr[B], capacity).
// With num_nodes, rows at or past a request's node count see nothing, and no row sees them.
template <typename I, typename J>
__global__ void __launch_bounds__(kFillThreads)
    flat_mask_kernel(const int32_t* __restrict__ mask, const I* __restrict__ prefix_lens,
                     const J* __restrict__ num_nodes, const int64_t* __restrict__ mask_indptr,
                     int B, int N, int W, int64_t capacity, uint8_t* out) {
  __shared__ uint32_t s_row[(kMaxBudget + 1 + 31) / 32];
  const int64_t rows = static_cast<int64_t>(B) * N;
  if (blockIdx.x >= rows) {
    const int64_t start = mask_indptr[B];
    const int64_t first = (start + 15) >> 4, last = capacity >> 4;  // whole 16-byte chunks
    const int64_t t = (blockIdx.x - rows) * kFillThreads + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x - rows) * kFillThreads;
    for (int64_t c = first + t; c < last; c += stride) {
      reinterpret_cast<uint4*>(out)[c] = make_uint4(0, 0, 0, 0);
    }
    if (t < 16) {  // the ragged bytes at both ends
      const int64_t head = start + t, tail = (last << 4) + t;
      if (head < capacity && head < (first << 4)) out[head] = 0;
      if (tail >= start && tail < capacity) out[tail] = 0;
    }
    return;
  }
  const int b = static_cast<int>(blockIdx.x / N), i = static_cast<int>(blockIdx.x % N);
  const int64_t prefix = max(static_cast<int64_t>(prefix_lens[b]), int64_t{0});
  const int64_t start = mask_indptr[b] + i * (prefix + N);
  const int64_t end = min(start + prefix + N, capacity);
  const int64_t live = num_nodes == nullptr ? N : min(max(static_cast<int64_t>(num_nodes[b]), int64_t{0}), static_cast<int64_t>(N));
  const uint8_t row_live = i < live;
  for (int k = threadIdx.x; k < W; k += kFillThreads) {
    uint32_t word = row_live ? static_cast<uint32_t>(mask[static_cast<int64_t>(blockIdx.x) * W + k]) : 0u;
    const int64_t dead = live - 32 * static_cast<int64_t>(k);  // columns of this word past the count
    if (dead < 32) word &= dead <= 0 ? 0u : (1u << dead) - 1u;
    s_row[k] = word;
  }
  __syncthreads();
  if (start >= end) return;

  auto value = [&](int64_t col) -> uint8_t {  // col in [0, prefix + N)
    if (col < prefix) return row_live;
    const int64_t j = col - prefix;
    return (s_row[j >> 5] >> (j & 31)) & 1u;
  };
  // 16-byte chunks: whole ones inside the row are one vector store; the row's ragged ends are
  // written byte by byte since neighbouring rows own the rest of those chunks.
  for (int64_t c = (start >> 4) + threadIdx.x; c < (end + 15) >> 4; c += kFillThreads) {
    const int64_t lo = c << 4;
    if (lo >= start && lo + 16 <= end) {
      const int64_t col = lo - start;
      uint4 v;
      if (col + 16 <= prefix) {
        const uint32_t ones = row_live * 0x01010101u;
        v = make_uint4(ones, ones, ones, ones);
      } else {
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          w[q] = 0;
#pragma unroll
          for (int k = 0; k < 4; ++k) w[q] |= static_cast<uint32_t>(value(col + 4 * q + k)) << (8 * k);
        }
        v = make_uint4(w[0], w[1], w[2], w[3]);
      }
      reinterpret_cast<uint4*>(out)[c] = v;
    } else {
      for (int k = 0; k < 16; ++k) {
        const int64_t pos = lo + k;
        if (pos >= start && pos < end) out[pos] = value(pos - start);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> flat_custom_mask(const at::Tensor& mask,
                                                    const at::Tensor& prefix_lens,
                                                    int64_t capacity,
                                                    const std::optional<at::Tensor>& num_nodes) {
  check_cuda(mask, "mask", mask);
  check_dim(mask, "mask", 3);
  check_dtype(mask, "mask", at::kInt);
  check_contiguous(mask, "mask");
  const int64_t B = mask.size(0), N = mask.size(1), W = mask.size(2);
  KD_CHECK(N >= 1 && N <= kMaxBudget + 1, "mask must have 1 to ", kMaxBudget + 1,
           " nodes (dim 1), got ", N);
  KD_CHECK(W == (N + 31) / 32, "mask must have ", (N + 31) / 32, " words per row (dim 2), got ",
           W);
  check_prefix_lens(prefix_lens, mask, B);
  KD_CHECK(capacity >= 0, "capacity must be >= 0, got ", capacity);
  KD_CHECK(B * N + kTailBlocks < INT32_MAX, "mask has too many rows: ", mask.sizes());
  const at::Tensor* counts = num_nodes.has_value() ? &*num_nodes : nullptr;
  if (counts != nullptr) {
    check_cuda(*counts, "num_nodes", mask);
    check_dim(*counts, "num_nodes", 1);
    check_index(*counts, "num_nodes");
    check_contiguous(*counts, "num_nodes");
    KD_CHECK(counts->size(0) == B, "num_nodes must have shape [", B, "], got ", counts->sizes());
  }

  const auto opts = mask.options();
  at::Tensor custom_mask = at::empty({capacity}, opts.dtype(at::kBool));
  at::Tensor mask_indptr = at::empty({B + 1}, opts.dtype(at::kLong));
  const c10::cuda::CUDAGuard guard(mask.device());
  const at::ScalarType count_type = counts != nullptr ? counts->scalar_type() : at::kLong;
  dispatch_index(prefix_lens.scalar_type(), [&](auto tag) {
    using I = decltype(tag);
    const I* lens = prefix_lens.data_ptr<I>();
    mask_indptr_kernel<I><<<1, 32, 0, current_stream()>>>(
        lens, static_cast<int>(B), static_cast<int>(N), mask_indptr.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    dispatch_index(count_type, [&](auto count_tag) {
      using J = decltype(count_tag);
      const unsigned blocks = static_cast<unsigned>(B * N + kTailBlocks);
      flat_mask_kernel<I, J><<<blocks, kFillThreads, 0, current_stream()>>>(
          mask.data_ptr<int32_t>(), lens, counts != nullptr ? counts->data_ptr<J>() : nullptr,
          mask_indptr.data_ptr<int64_t>(), static_cast<int>(B), static_cast<int>(N),
          static_cast<int>(W), capacity, reinterpret_cast<uint8_t*>(custom_mask.data_ptr<bool>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {custom_mask, mask_indptr};
}

// ---- accept_walk ---------------------------------------------------------------------------

__global__ void accept_walk_kernel(const int32_t* __restrict__ parents,
                                   const int64_t* __restrict__ tokens,
                                   const int64_t* __restrict__ target, int N, int cols,
                                   int32_t* accepted, int32_t* accept_len, int64_t* bonus) {
  extern __shared__ int32_t s_first[];  // [N]: lowest-index child carrying its parent's target
  const int b = blockIdx.x;
  const int64_t row0 = static_cast<int64_t>(b) * N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) s_first[i] = N;
  __syncthreads();
  for (int j = threadIdx.x + 1; j < N; j += blockDim.x) {
    const int p = parents[row0 + j];
    if (p >= 0 && p < N && tokens[row0 + j] == target[row0 + p]) atomicMin(&s_first[p], j);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // at most `cols` dependent shared-memory loads
    int32_t* acc = accepted + static_cast<int64_t>(b) * cols;
    int cur = 0, len = 1;
    acc[0] = 0;
    while (len < cols && s_first[cur] < N) {
      cur = s_first[cur];
      acc[len++] = cur;
    }
    for (int k = len; k < cols; ++k) acc[k] = -1;
    accept_len[b] = len;
    bonus[b] = target[row0 + cur];
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> accept_walk(const at::Tensor& parents,
                                                          const at::Tensor& tokens,
                                                          const at::Tensor& target_tokens,
                                                          int64_t max_depth) {
  check_tree_arg(parents, "parents", parents, at::kInt);
  check_tree_arg(tokens, "tokens", parents, at::kLong);
  check_tree_arg(target_tokens, "target_tokens", parents, at::kLong);
  const int64_t B = parents.size(0), N = parents.size(1);
  KD_CHECK(N >= 1 && N <= kMaxBudget + 1, "parents must have 1 to ", kMaxBudget + 1,
           " nodes (dim 1), got ", N);
  KD_CHECK(max_depth >= 0 && max_depth < INT32_MAX, "max_depth must be >= 0, got ", max_depth);

  const auto opts = parents.options();
  at::Tensor accepted = at::empty({B, max_depth + 1}, opts.dtype(at::kInt));
  at::Tensor accept_len = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor bonus = at::empty({B}, opts.dtype(at::kLong));
  if (B == 0) return {accepted, accept_len, bonus};
  const c10::cuda::CUDAGuard guard(parents.device());
  accept_walk_kernel<<<B, 256, N * sizeof(int32_t), current_stream()>>>(
      parents.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(), target_tokens.data_ptr<int64_t>(),
      static_cast<int>(N), static_cast<int>(max_depth + 1), accepted.data_ptr<int32_t>(),
      accept_len.data_ptr<int32_t>(), bonus.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accepted, accept_len, bonus};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("build_tree", &build_tree);
  m.impl("verify_metadata", &verify_metadata);
  m.impl("flat_custom_mask", &flat_custom_mask);
  m.impl("accept_walk", &accept_walk);
}

}  // namespace kdtree
