// SGLang's DDTree (PR #29907) on the GPU: its tree build (float64 heap with depth bonus,
// early-stop pruning off the rank-0 spine, breadth-first relabel) and its greedy acceptance on
// EAGLE's retrieve arrays with the commit order. One CTA per request; no allocation depends on
// device data, so every launch is capturable in a CUDA graph.
#include "common.cuh"

#include <optional>

namespace kdtree {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kEmpty = ~uint64_t{0};  // the key of no candidate

// A candidate or node: parent node (11 bits), rank at its depth (11), depth (5), and one flag:
// whether every rank on its root path is 0 (the spine, never pruned). Ranks stay <= budget:
// rank r + 1 is only pushed once rank r became a node.
using TreeId = PackedId<11, 11, 1>;

// Order-preserving map of a float64 score to a key that is smaller for a higher score. The
// worker's heap compares -score with Python's float order, where -0 equals +0, so both map to
// one key (no result depends on the sign of a zero score: it only meets sums and compares).
__device__ __forceinline__ uint64_t score_key(double s) {
  uint64_t u = static_cast<uint64_t>(__double_as_longlong(s));
  if (u == 0x8000000000000000ull) u = 0;
  const uint64_t ord = (u >> 63) ? ~u : (u | 0x8000000000000000ull);
  const uint64_t key = ~ord;
  return key == kEmpty ? kEmpty - 1 : key;  // one NaN pattern would read as "empty"
}
__device__ __forceinline__ double key_score(uint64_t key) {
  const uint64_t ord = ~key;
  const uint64_t u = (ord >> 63) ? (ord & 0x7FFFFFFFFFFFFFFFull) : ~ord;
  return __longlong_as_double(static_cast<long long>(u));
}

// A lane's best candidate among its slots (slot % 32 == lane): least key, then least rank tuple.
__device__ void lane_best(const uint64_t* s_key, const uint32_t* s_cand, const uint32_t* s_node,
                          int slots_per_lane, uint64_t& bkey, uint32_t& bid, int& bslot) {
  const int lane = threadIdx.x & 31;
  bkey = kEmpty;
  bid = 0;
  bslot = lane;
  for (int j = 0; j < slots_per_lane; ++j) {
    const int slot = j * 32 + lane;
    const uint64_t k = s_key[slot];
    if (k < bkey || (k == bkey && k != kEmpty && rank_tuple_less<TreeId>(s_cand[slot], bid, s_node))) {
      bkey = k;
      bid = s_cand[slot];
      bslot = slot;
    }
  }
}

struct TreeArgs {
  const float* lp;        // [B, L, K]
  const int64_t* tok;     // [B, L, K]
  int64_t* node_tokens;   // [B, budget]
  int64_t* node_depths;   // [B, budget]
  int64_t* parents;       // [B, D]
  bool* visibility;       // [B, D, D]
  int64_t* tree_sizes;    // [B]
  int L, K, budget, D;
  double depth_bonus, log_budget, stop_margin;
  bool chain, lp_in_smem;
};

// Shared memory of one CTA; the host sizes the launch with the same function.
struct TreeLayout : Carve {
  size_t node, nchild, sib, newi, oldi, start, pnew, dnew, region, lp;
  int slots_per_lane;
  __host__ __device__ TreeLayout(int budget, int L, int K, bool lp_in_smem) {
    const int D = budget + 1;
    slots_per_lane = (budget + 31) / 32;
    node = take(sizeof(uint32_t) * D);
    nchild = take(sizeof(uint16_t) * D);
    sib = take(sizeof(uint16_t) * D);
    newi = take(sizeof(uint16_t) * D);
    oldi = take(sizeof(uint16_t) * D);
    start = take(sizeof(uint16_t) * D);
    pnew = take(sizeof(uint16_t) * D);
    dnew = take(sizeof(uint8_t) * D);
    // The heap's slots while building, each node's root path (node at every depth) after.
    const size_t heap = (sizeof(uint64_t) + sizeof(uint32_t)) * 32 * slots_per_lane;
    const size_t paths = sizeof(uint16_t) * static_cast<size_t>(D) * (L + 1);
    region = take(heap > paths ? heap : paths);
    lp = take(lp_in_smem ? sizeof(float) * L * K : 0);
  }
};

// Warp 0: replays the worker's heap; node n's id goes to s_node[n] (n in pop order), its rank
// among its parent's children to s_sib[n]. Returns the node count, root included.
__device__ int replay_heap(const TreeArgs& a, const float* lpt, uint64_t* s_key, uint32_t* s_cand,
                           uint32_t* s_node, uint16_t* s_nchild, uint16_t* s_sib, int slots_per_lane) {
  const int lane = threadIdx.x & 31;
  const int K = a.K;
  auto lp = [&](uint32_t d, uint32_t r) { return static_cast<double>(lpt[d * K + r]); };
  for (int j = 0; j < slots_per_lane; ++j) s_key[j * 32 + lane] = kEmpty;
  const double first = lp(0, 0);
  const double prune_below = __dsub_rn(__dsub_rn(first, a.log_budget), a.stop_margin);
  if (lane == 0) {
    s_key[0] = score_key(first);
    s_cand[0] = TreeId::pack(0, 0, 1, true);
    s_node[0] = TreeId::pack(0, 0, 0, true);
    s_nchild[0] = 0;
  }
  __syncwarp();
  uint64_t bkey;
  uint32_t bid;
  int bslot;
  lane_best(s_key, s_cand, s_node, slots_per_lane, bkey, bid, bslot);
  int alloc = 1, count = 0;  // slots ever used: one per child pushed, so < budget
  while (count < a.budget) {
    const uint32_t hi = __reduce_min_sync(kFull, static_cast<uint32_t>(bkey >> 32));
    const uint32_t lo = __reduce_min_sync(
        kFull, static_cast<uint32_t>(bkey >> 32) == hi ? static_cast<uint32_t>(bkey) : 0xFFFFFFFFu);
    const uint64_t m = static_cast<uint64_t>(hi) << 32 | lo;
    if (m == kEmpty) break;  // the heap ran dry
    uint32_t wid;
    const int w = pop_lane<TreeId>(bkey == m, bid, s_node, wid);
    const int wslot = __shfl_sync(kFull, bslot, w);
    const double s = key_score(m);
    const uint32_t p = TreeId::parent(wid), r = TreeId::rank(wid), d = TreeId::depth(wid);
    const bool spine = TreeId::flags(wid) != 0;
    bool rescan = lane == w;
    if (!spine && s < prune_below) {
      if (lane == w) s_key[wslot] = kEmpty;  // pruned: it spawns nothing
    } else {
      const int n = ++count;
      uint64_t sib_key = kEmpty;
      if (r + 1 < static_cast<uint32_t>(K)) {
        sib_key = score_key(__dadd_rn(__dsub_rn(s, lp(d - 1, r)), lp(d - 1, r + 1)));
      }
      if (lane == w) {  // the next sibling takes the popped slot
        s_key[wslot] = sib_key;
        s_cand[wslot] = TreeId::pack(p, r + 1, d, false);
      }
      if (lane == 0) {
        s_node[n] = wid;
        s_sib[n] = s_nchild[p];
        s_nchild[p] += 1;
        s_nchild[n] = 0;
      }
      // The first child, unless this was the last node: the worker pushes it but never pops it.
      if (d < static_cast<uint32_t>(a.L) && n < a.budget) {
        const int slot = alloc++;
        if (lane == (slot & 31)) {
          s_key[slot] = score_key(__dadd_rn(__dadd_rn(s, lp(d, 0)), a.depth_bonus));
          s_cand[slot] = TreeId::pack(n, 0, d + 1, spine);
          rescan = true;
        }
      }
    }
    __syncwarp();  // node n is in s_node before a tie-break climbs through it
    if (rescan) lane_best(s_key, s_cand, s_node, slots_per_lane, bkey, bid, bslot);
    __syncwarp();
  }
  return count + 1;
}

__global__ void __launch_bounds__(kThreads) sglang_tree_kernel(TreeArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_count, s_scan[33];
  const int b = blockIdx.x, D = a.D, L = a.L, tid = threadIdx.x;
  const TreeLayout lay(a.budget, L, a.K, a.lp_in_smem);
  uint32_t* s_node = at_offset<uint32_t>(smem, lay.node);
  uint16_t* s_nchild = at_offset<uint16_t>(smem, lay.nchild);
  uint16_t* s_sib = at_offset<uint16_t>(smem, lay.sib);
  uint16_t* s_new = at_offset<uint16_t>(smem, lay.newi);  // pop order -> breadth-first index
  uint16_t* s_old = at_offset<uint16_t>(smem, lay.oldi);
  uint16_t* s_start = at_offset<uint16_t>(smem, lay.start);  // first child's new index
  uint16_t* s_pnew = at_offset<uint16_t>(smem, lay.pnew);  // by new index: parent, depth
  uint8_t* s_dnew = at_offset<uint8_t>(smem, lay.dnew);
  const float* g_lp = a.lp + static_cast<int64_t>(b) * L * a.K;

  int n;
  if (a.chain) {
    n = L + 1;
    for (int q = tid; q < n; q += blockDim.x) {
      s_node[q] = q ? TreeId::pack(q - 1, 0, q, true) : TreeId::pack(0, 0, 0, true);
      s_new[q] = s_old[q] = static_cast<uint16_t>(q);
    }
  } else {
    const float* lpt = g_lp;
    if (a.lp_in_smem) {  // the pop loop's loads are its critical path: keep them on chip
      float* s_lp = at_offset<float>(smem, lay.lp);
      for (int i = tid; i < L * a.K; i += blockDim.x) s_lp[i] = g_lp[i];
      lpt = s_lp;
    }
    __syncthreads();
    if (tid < 32) {
      const int count = replay_heap(a, lpt, at_offset<uint64_t>(smem, lay.region),
                                    at_offset<uint32_t>(smem, lay.region + sizeof(uint64_t) * 32 * lay.slots_per_lane),
                                    s_node, s_nchild, s_sib, lay.slots_per_lane);
      if (tid == 0) s_count = count;
    }
    __syncthreads();
    n = s_count;
    // Breadth-first relabel, a depth at a time: the children of the depth's nodes (in their
    // new order) follow one another, each parent's in creation order.
    if (tid == 0) s_new[0] = s_old[0] = 0;
    __syncthreads();
    int lo = 0, hi = 1;
    const int per = (D + kThreads - 1) / kThreads;
    for (int d = 1; d <= L && lo < hi; ++d) {
      const int c0 = min(hi, lo + tid * per), c1 = min(hi, c0 + per);
      int mine = 0;
      for (int q = c0; q < c1; ++q) mine += s_nchild[s_old[q]];
      int total;
      int at = hi + block_exclusive_scan(mine, s_scan, total);
      for (int q = c0; q < c1; ++q) {
        s_start[q] = static_cast<uint16_t>(at);
        at += s_nchild[s_old[q]];
      }
      __syncthreads();
      for (int i = tid + 1; i < n; i += blockDim.x) {
        const uint32_t u = s_node[i];
        if (TreeId::depth(u) == static_cast<uint32_t>(d)) {
          const int q = s_start[s_new[TreeId::parent(u)]] + s_sib[i];
          s_new[i] = static_cast<uint16_t>(q);
          s_old[q] = static_cast<uint16_t>(i);
        }
      }
      __syncthreads();
      lo = hi;
      hi += total;
    }
  }
  __syncthreads();

  const int64_t row0 = static_cast<int64_t>(b) * D;
  const int64_t* tok = a.tok + static_cast<int64_t>(b) * L * a.K;
  for (int q = tid; q < D; q += blockDim.x) {
    int64_t token = 0, depth = 0, parent = -1;
    if (q < n) {
      const uint32_t u = s_node[s_old[q]];
      depth = TreeId::depth(u);
      parent = q ? s_new[TreeId::parent(u)] : 0;
      s_pnew[q] = static_cast<uint16_t>(parent);
      s_dnew[q] = static_cast<uint8_t>(depth);
      if (q) token = tok[(depth - 1) * a.K + TreeId::rank(u)];
      if (!q) parent = -1;
    }
    a.parents[row0 + q] = parent;
    if (q) {
      a.node_tokens[row0 - b + q - 1] = token;  // [B, budget]: request b starts at b * (D - 1)
      a.node_depths[row0 - b + q - 1] = depth;
    }
  }
  if (tid == 0) a.tree_sizes[b] = n;
  __syncthreads();

  // Root paths (the heap's slots are dead now): s_path[q * (L + 1) + k] = q's ancestor at depth k.
  uint16_t* s_path = at_offset<uint16_t>(smem, lay.region);
  for (int q = tid; q < n; q += blockDim.x) {
    int node = q;
    for (int k = s_dnew[q]; k >= 0; --k) {
      s_path[q * (L + 1) + k] = static_cast<uint16_t>(node);
      node = s_pnew[node];
    }
  }
  __syncthreads();

  // Visibility, one warp per row; a lane writes one byte per step, so a step is 32 bytes in a row.
  const int lane = tid & 31;
  bool* vis = a.visibility + row0 * D;
  for (int q = tid >> 5; q < D; q += blockDim.x >> 5) {
    const int dq = q < n ? s_dnew[q] : -1;
    const uint16_t* path = s_path + q * (L + 1);
    bool* row = vis + static_cast<int64_t>(q) * D;
    for (int col = lane; col < D; col += 32) {
      const int dc = col < n ? s_dnew[col] : 255;
      row[col] = dc <= dq && path[dc] == col;
    }
  }
}

// ---- acceptance on EAGLE's retrieve arrays ----------------------------------------------------

__global__ void accept_retrieve_kernel(const int64_t* __restrict__ next_token,
                                       const int64_t* __restrict__ next_sibling,
                                       const int64_t* __restrict__ candidates,
                                       const int64_t* __restrict__ target, int D, int cols,
                                       int32_t* accepted, int32_t* accept_len, int64_t* bonus,
                                       int64_t* accepted_tokens) {
  extern __shared__ int32_t s_path[];  // [cols]
  __shared__ int s_len;
  const int b = blockIdx.x;
  const int64_t row0 = static_cast<int64_t>(b) * D;
  if (threadIdx.x == 0) {  // the walk is a chain of dependent loads: one thread
    int cur = 0, len = 1;
    s_path[0] = 0;
    while (len < cols) {
      const int64_t want = target[row0 + cur];
      int64_t child = next_token[row0 + cur];
      while (child >= 0 && child < D && candidates[row0 + child] != want) {
        child = next_sibling[row0 + child];
      }
      if (child < 0 || child >= D) break;  // no child carries the target's token
      cur = static_cast<int>(child);
      s_path[len++] = cur;
    }
    s_len = len;
    accept_len[b] = len;
    bonus[b] = target[row0 + cur];
  }
  __syncthreads();
  const int len = s_len;
  const int64_t last = target[row0 + s_path[len - 1]];
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    accepted[static_cast<int64_t>(b) * cols + j] = j < len ? s_path[j] : -1;
  }
  for (int k = threadIdx.x; k < D; k += blockDim.x) {
    accepted_tokens[row0 + k] = k < len ? target[row0 + s_path[k]] : last;
  }
}

// Request b's accepted slots go to [before_b, before_b + len_b) of the order, its other slots,
// ascending, to total + [b * D - before_b, ...).
__global__ void commit_order_kernel(const int32_t* __restrict__ accepted,
                                    const int32_t* __restrict__ accept_len, int B, int D, int cols,
                                    int64_t* order) {
  extern __shared__ uint8_t s_taken[];  // [D]
  __shared__ int s_scan[33];
  const int b = blockIdx.x, tid = threadIdx.x;
  int64_t before = 0, total = 0;
  for (int r = tid; r < B; r += blockDim.x) {
    const int64_t len = accept_len[r];
    total += len;
    before += r < b ? len : 0;
  }
  for (int o = 16; o > 0; o >>= 1) {
    before += __shfl_xor_sync(kFull, before, o);
    total += __shfl_xor_sync(kFull, total, o);
  }
  __shared__ int64_t s_sums[2][kThreads / 32];
  if ((tid & 31) == 0) {
    s_sums[0][tid >> 5] = before;
    s_sums[1][tid >> 5] = total;
  }
  for (int k = tid; k < D; k += blockDim.x) s_taken[k] = 0;
  __syncthreads();
  before = total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
    before += s_sums[0][w];
    total += s_sums[1][w];
  }
  const int64_t limit = static_cast<int64_t>(B) * D;
  const int len = min(accept_len[b], cols);
  for (int j = tid; j < len; j += blockDim.x) {
    const int node = accepted[static_cast<int64_t>(b) * cols + j];
    if (node >= 0 && node < D) {
      s_taken[node] = 1;
      if (before + j < limit) order[before + j] = static_cast<int64_t>(b) * D + node;
    }
  }
  __syncthreads();
  const int per = (D + blockDim.x - 1) / blockDim.x, c0 = min(D, tid * per), c1 = min(D, c0 + per);
  int mine = 0;
  for (int k = c0; k < c1; ++k) mine += !s_taken[k];
  int ignored;
  int64_t pos = total + static_cast<int64_t>(b) * D - before + block_exclusive_scan(mine, s_scan, ignored);
  for (int k = c0; k < c1; ++k) {
    if (!s_taken[k]) {
      if (pos < limit) order[pos] = static_cast<int64_t>(b) * D + k;
      ++pos;
    }
  }
}

// ---- host ------------------------------------------------------------------------------------

void sglang_build_tree(const at::Tensor& topk_logprobs, const at::Tensor& topk_tokens,
                       int64_t budget, double depth_bonus, double log_budget, double stop_margin,
                       bool chain, const at::Tensor& node_tokens, const at::Tensor& node_depths,
                       const at::Tensor& parents, const at::Tensor& visibility,
                       const at::Tensor& tree_sizes) {
  check_draft(topk_logprobs, topk_tokens, at::kLong, budget, INT32_MAX / kMaxDepth);
  const int64_t B = topk_logprobs.size(0), L = topk_logprobs.size(1), K = topk_logprobs.size(2);
  KD_CHECK(!chain || budget == L, "chain needs budget == L, got budget ", budget, ", L ", L);
  const int64_t D = budget + 1;
  check_out(node_tokens, "node_tokens", topk_logprobs, {B, budget}, at::kLong);
  check_out(node_depths, "node_depths", topk_logprobs, {B, budget}, at::kLong);
  check_out(parents, "parents", topk_logprobs, {B, D}, at::kLong);
  check_out(visibility, "visibility", topk_logprobs, {B, D, D}, at::kBool);
  check_out(tree_sizes, "tree_sizes", topk_logprobs, {B}, at::kLong);
  if (B == 0) return;

  const c10::cuda::CUDAGuard guard(topk_logprobs.device());
  TreeArgs a{};
  a.lp = topk_logprobs.data_ptr<float>();
  a.tok = topk_tokens.data_ptr<int64_t>();
  a.node_tokens = node_tokens.data_ptr<int64_t>();
  a.node_depths = node_depths.data_ptr<int64_t>();
  a.parents = parents.data_ptr<int64_t>();
  a.visibility = visibility.data_ptr<bool>();
  a.tree_sizes = tree_sizes.data_ptr<int64_t>();
  a.L = static_cast<int>(L);
  a.K = static_cast<int>(K);
  a.budget = static_cast<int>(budget);
  a.D = static_cast<int>(D);
  a.depth_bonus = depth_bonus;
  a.log_budget = log_budget;
  a.stop_margin = stop_margin;
  a.chain = chain;
  const size_t limit = dynamic_smem_limit(topk_logprobs);
  a.lp_in_smem = !chain && TreeLayout(a.budget, a.L, a.K, true).bytes <= limit;
  const size_t smem = TreeLayout(a.budget, a.L, a.K, a.lp_in_smem).bytes;
  KD_CHECK(smem <= limit, "a tree of budget ", budget, " and depth ", L, " needs ", smem,
           " bytes of shared memory, the GPU has ", limit);
  launch_kernel_optin(sglang_tree_kernel, static_cast<unsigned>(B), kThreads, smem, a);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> accept_retrieve(
    const at::Tensor& next_token, const at::Tensor& next_sibling, const at::Tensor& candidates,
    const at::Tensor& target_tokens, int64_t max_depth) {
  check_tree_arg(next_token, "next_token", next_token, at::kLong);
  check_tree_arg(next_sibling, "next_sibling", next_token, at::kLong);
  check_tree_arg(candidates, "candidates", next_token, at::kLong);
  check_tree_arg(target_tokens, "target_tokens", next_token, at::kLong);
  const int64_t B = next_token.size(0), D = next_token.size(1);
  KD_CHECK(D >= 1 && D <= 48 * 1024, "next_token must have 1 to ", 48 * 1024, " nodes (dim 1), got ", D);
  KD_CHECK(max_depth >= 0 && max_depth < 12 * 1024, "max_depth must be in [0, ", 12 * 1024, "), got ", max_depth);
  KD_CHECK(B * D < INT32_MAX, "next_token has too many nodes: ", next_token.sizes());

  const auto opts = next_token.options();
  const int64_t cols = max_depth + 1;
  at::Tensor accepted = at::empty({B, cols}, opts.dtype(at::kInt));
  at::Tensor accept_len = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor bonus = at::empty({B}, opts.dtype(at::kLong));
  at::Tensor accepted_tokens = at::empty({B, D}, opts.dtype(at::kLong));
  at::Tensor order = at::empty({B * D}, opts.dtype(at::kLong));
  if (B == 0) return {accepted, accept_len, bonus, accepted_tokens, order};
  const c10::cuda::CUDAGuard guard(next_token.device());
  launch_kernel(accept_retrieve_kernel, static_cast<unsigned>(B), 128, cols * sizeof(int32_t),
                next_token.data_ptr<int64_t>(), next_sibling.data_ptr<int64_t>(),
                candidates.data_ptr<int64_t>(), target_tokens.data_ptr<int64_t>(),
                static_cast<int>(D), static_cast<int>(cols), accepted.data_ptr<int32_t>(),
                accept_len.data_ptr<int32_t>(), bonus.data_ptr<int64_t>(),
                accepted_tokens.data_ptr<int64_t>());
  launch_kernel(commit_order_kernel, static_cast<unsigned>(B), kThreads, D,
                accepted.data_ptr<int32_t>(), accept_len.data_ptr<int32_t>(), static_cast<int>(B),
                static_cast<int>(D), static_cast<int>(cols), order.data_ptr<int64_t>());
  return {accepted, accept_len, bonus, accepted_tokens, order};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("sglang_build_tree_", &sglang_build_tree);
  m.impl("accept_retrieve", &accept_retrieve);
}

}  // namespace kdtree
