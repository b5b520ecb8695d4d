// DDTree's verify walk on the GPU: from the root, follow the child carrying the target's token
// while there is one; accepted nodes, their count and the bonus token per request.
#include "common.cuh"

namespace kdtree {
namespace {

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
  launch_kernel(accept_walk_kernel, B, 256, N * sizeof(int32_t), parents.data_ptr<int32_t>(),
                tokens.data_ptr<int64_t>(), target_tokens.data_ptr<int64_t>(), static_cast<int>(N),
                static_cast<int>(max_depth + 1), accepted.data_ptr<int32_t>(),
                accept_len.data_ptr<int32_t>(), bonus.data_ptr<int64_t>());
  return {accepted, accept_len, bonus};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("accept_walk", &accept_walk); }

}  // namespace kdtree
