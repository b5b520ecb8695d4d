// DDTree verify metadata on the GPU: each node's position and EAGLE's retrieve arrays (first
// child, next sibling, global index), O(batch x nodes) work independent of context length.
#include "common.cuh"

namespace kdtree {
namespace {

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
    launch_kernel(verify_metadata_kernel<I>, B, 256, smem, depths.data_ptr<int32_t>(),
                  parents.data_ptr<int32_t>(), prefix_lens.data_ptr<I>(), static_cast<int>(B),
                  static_cast<int>(N), retrieve, positions.data_ptr<int64_t>(),
                  qo_indptr.data_ptr<int32_t>(), retrieve ? r_index.data_ptr<int64_t>() : nullptr,
                  retrieve ? r_next.data_ptr<int64_t>() : nullptr,
                  retrieve ? r_sibling.data_ptr<int64_t>() : nullptr);
  });
  return {positions, qo_indptr, r_index, r_next, r_sibling};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("verify_metadata", &verify_metadata); }

}  // namespace kdtree
