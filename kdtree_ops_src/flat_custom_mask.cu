// SGLang's flat TARGET_VERIFY custom mask from packed tree rows, on the GPU: prefix columns
// true, then each node's tree row; capturable (the capacity is a host int).
#include "common.cuh"

namespace kdtree {
namespace {

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
  check_dense(mask, "mask", mask, 3, at::kInt);
  const int64_t B = mask.size(0), N = mask.size(1), W = mask.size(2);
  KD_CHECK(N >= 1 && N <= kMaxBudget + 1, "mask must have 1 to ", kMaxBudget + 1,
           " nodes (dim 1), got ", N);
  KD_CHECK(W == (N + 31) / 32, "mask must have ", (N + 31) / 32, " words per row (dim 2), got ",
           W);
  check_prefix_lens(prefix_lens, mask, B);
  KD_CHECK(capacity >= 0, "capacity must be >= 0, got ", capacity);
  KD_CHECK(B * N + kTailBlocks < INT32_MAX, "mask has too many rows: ", mask.sizes());
  const at::Tensor* counts = num_nodes.has_value() ? &*num_nodes : nullptr;
  if (counts != nullptr) check_per_request(*counts, "num_nodes", mask, B);

  const auto opts = mask.options();
  at::Tensor custom_mask = at::empty({capacity}, opts.dtype(at::kBool));
  at::Tensor mask_indptr = at::empty({B + 1}, opts.dtype(at::kLong));
  const c10::cuda::CUDAGuard guard(mask.device());
  const at::ScalarType count_type = counts != nullptr ? counts->scalar_type() : at::kLong;
  dispatch_index(prefix_lens.scalar_type(), [&](auto tag) {
    using I = decltype(tag);
    const I* lens = prefix_lens.data_ptr<I>();
    launch_kernel(mask_indptr_kernel<I>, 1, 32, 0, lens, static_cast<int>(B), static_cast<int>(N),
                  mask_indptr.data_ptr<int64_t>());
    dispatch_index(count_type, [&](auto count_tag) {
      using J = decltype(count_tag);
      const unsigned blocks = static_cast<unsigned>(B * N + kTailBlocks);
      launch_kernel(flat_mask_kernel<I, J>, blocks, kFillThreads, 0, mask.data_ptr<int32_t>(), lens,
                    counts != nullptr ? counts->data_ptr<J>() : nullptr,
                    mask_indptr.data_ptr<int64_t>(), static_cast<int>(B), static_cast<int>(N),
                    static_cast<int>(W), capacity,
                    reinterpret_cast<uint8_t*>(custom_mask.data_ptr<bool>()));
    });
  });
  return {custom_mask, mask_indptr};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("flat_custom_mask", &flat_custom_mask); }

}  // namespace kdtree
