// DDTree's best-first tree build on the GPU (Ringel & Romano 2026, arXiv 2604.12989): the
// budget most probable prefixes of the drafter's per-position top-K, identical to the CPU
// reference node for node. One CTA per request; no allocation depends on device data, so the
// launch is capturable in a CUDA graph. Two builds with identical results: the depth-wise one
// (build_tree_levels.cuh) for budgets over 64, the heap replay (build_tree_replay.cuh) for the
// rest.
#include "build_tree_levels.cuh"

namespace kdtree {
namespace {

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
      for (int k = static_cast<int>(NodeId::depth(s_id[i])); k >= 0; --k) {
        s_path[i * lp1 + k] = static_cast<uint16_t>(node);
        node = NodeId::parent(s_id[node]);
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
      dep = static_cast<int32_t>(NodeId::depth(u));
      par = static_cast<int32_t>(NodeId::parent(u));
      t = static_cast<int64_t>(tok[(static_cast<int64_t>(b) * a.L + dep - 1) * a.K + NodeId::rank(u)]);
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
      const int d = static_cast<int>(NodeId::depth(s_id[row]));
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

template <int S, typename Tok>
void launch_build(const BuildArgs& a, int B, size_t smem) {
  launch_kernel_optin(build_tree_kernel<S, Tok>, B, kBuildThreads, smem, a);
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
  check_draft(topk_logprobs, topk_tokens, std::nullopt, budget, INT32_MAX);
  const int64_t B = topk_logprobs.size(0), L = topk_logprobs.size(1), K = topk_logprobs.size(2);
  check_per_request(root_tokens, "root_tokens", topk_logprobs, B, at::kLong);

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
  const size_t limit = dynamic_smem_limit(topk_logprobs);
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
  dispatch_index(topk_tokens.scalar_type(),
                 [&](auto tag) { dispatch_slots<decltype(tag)>(a, static_cast<int>(B), smem); });
  return {tokens, parents, depths, num_nodes, mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("build_tree", &build_tree); }

}  // namespace kdtree
