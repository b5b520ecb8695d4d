// move_kv: kv[dst[i]] = kv[src[i]] for every layer of a KV pool, treating rows as bytes.
// Reads must all happen before writes when src and dst overlap, and a grid cannot order its
// own blocks, so the general path gathers every moved row into a scratch buffer and scatters
// it in a second launch; `disjoint=True` (caller knows src ∩ dst = ∅) copies in one launch
// and halves the traffic. Pairs with a negative slot are padding and skipped.
#include "common.cuh"


#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace kdtree {
namespace {

// Layer base pointers travel by value in the kernel's parameter space: uploading a pointer
// array would need a host->device copy per call, which a CUDA graph would freeze. 64 layers
// x 2 tables x 16 bytes stays well inside the 4 KB parameter limit of every sm_80+ part.
constexpr int kMaxLayers = 64;
constexpr int kWarps = 8;  // one warp per moved row, 8 rows per block
constexpr int kUnroll = 4;  // vectors in flight per lane before its stores
// The overlapping path stages whole layers in scratch; beyond this it stages fewer layers per
// launch pair instead of growing the buffer (61 layers x 4096 rows of 1152 bytes still fit).
constexpr int64_t kScratchBytes = int64_t{512} << 20;

struct LayerTable {
  char* base[kMaxLayers];
  int64_t stride[kMaxLayers];  // bytes between consecutive rows (slots)
};

// One warp copies one (layer, pair) row. in_indexed / out_indexed pick whether the row
// address comes from src/dst or from the pair number (the scratch buffer's dense layout).
template <typename V, typename I>
__global__ void __launch_bounds__(kWarps * 32)
    move_rows_kernel(const __grid_constant__ LayerTable in, const __grid_constant__ LayerTable out,
                     const I* __restrict__ src, const I* __restrict__ dst, int64_t pairs,
                     int64_t slots, int64_t row_vecs, bool in_indexed, bool out_indexed, int* guard) {
  const int64_t pair = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  if (pair >= pairs) return;
  const int64_t s = src[pair], d = dst[pair];
  const int layer = blockIdx.y;
  // Padding pairs are skipped; out-of-range ones too, so bad input can never touch memory
  // outside the pool: they raise the guard (check mode reports them as errors instead).
  if (s < 0 || d < 0) return;
  if (s >= slots || d >= slots) {
    if (layer == 0 && threadIdx.x % 32 == 0) raise_guard(guard, kGuardMoveSlot);
    return;
  }
  const V* from = reinterpret_cast<const V*>(in.base[layer] + (in_indexed ? s : pair) * in.stride[layer]);
  V* to = reinterpret_cast<V*>(out.base[layer] + (out_indexed ? d : pair) * out.stride[layer]);
  const int lane = threadIdx.x % 32;
  for (int64_t v0 = lane; v0 < row_vecs; v0 += 32 * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < row_vecs) r[u] = from[v0 + u * 32];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < row_vecs) to[v0 + u * 32] = r[u];
  }
}

// Check mode: bad[0] = first pair with a slot out of range, bad[1] = a pair whose dst repeats
// an earlier dst, bad[2] = a pair whose src is another pair's dst (only matters for disjoint).
enum : int { kOutOfRange, kDuplicateDst, kOverlap, kNumChecks };
constexpr unsigned long long kNone = ~0ull;

template <typename I>
__global__ void mark_dst_kernel(const I* src, const I* dst, int64_t pairs, int64_t slots,
                                unsigned* marks, unsigned long long* bad) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= pairs) return;
  const int64_t s = src[i], d = dst[i];
  if (s < 0 || d < 0) return;
  if (s >= slots || d >= slots) {
    atomicMin(&bad[kOutOfRange], static_cast<unsigned long long>(i));
    return;
  }
  const unsigned bit = 1u << (d % 32);
  if (atomicOr(&marks[d / 32], bit) & bit) atomicMin(&bad[kDuplicateDst], static_cast<unsigned long long>(i));
}

template <typename I>
__global__ void find_overlap_kernel(const I* src, const I* dst, int64_t pairs, int64_t slots,
                                    const unsigned* marks, unsigned long long* bad) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= pairs) return;
  const int64_t s = src[i], d = dst[i];
  if (s < 0 || d < 0 || s >= slots || d >= slots || s == d) return;
  if (marks[s / 32] & (1u << (s % 32))) atomicMin(&bad[kOverlap], static_cast<unsigned long long>(i));
}

bool check_mode() { return env_flag("KDTREE_CHECK", false); }

// Synchronises the host: only in check mode.
template <typename I>
void validate_slots(const at::Tensor& src, const at::Tensor& dst, int64_t slots, bool disjoint) {
  const int64_t pairs = src.numel();
  const auto opts = src.options();
  at::Tensor marks = at::empty({(slots + 31) / 32}, opts.dtype(at::kInt));
  at::Tensor bad = at::empty({kNumChecks}, opts.dtype(at::kLong));
  const cudaStream_t stream = current_stream();
  C10_CUDA_CHECK(cudaMemsetAsync(marks.data_ptr(), 0, marks.nbytes(), stream));
  C10_CUDA_CHECK(cudaMemsetAsync(bad.data_ptr(), 0xff, bad.nbytes(), stream));
  auto* m = reinterpret_cast<unsigned*>(marks.data_ptr());
  auto* b = reinterpret_cast<unsigned long long*>(bad.data_ptr());
  const I* s = src.data_ptr<I>();
  const I* d = dst.data_ptr<I>();
  constexpr int kBlock = 256;
  launch_kernel(mark_dst_kernel<I>, ceil_div(pairs, kBlock), kBlock, 0, s, d, pairs, slots, m, b);
  if (disjoint) {
    launch_kernel(find_overlap_kernel<I>, ceil_div(pairs, kBlock), kBlock, 0, s, d, pairs, slots,
                  m, b);
  }
  const at::Tensor host = bad.cpu();
  const auto* h = reinterpret_cast<const unsigned long long*>(host.data_ptr());
  auto at_host = [](const at::Tensor& t, unsigned long long i) {
    return t.select(0, static_cast<int64_t>(i)).cpu().item<int64_t>();
  };
  if (h[kOutOfRange] != kNone) {
    const auto i = h[kOutOfRange];
    KD_CHECK(false, "src_slots/dst_slots must lie in [0, ", slots, ") (negative marks padding), got src_slots[",
             i, "] = ", at_host(src, i), ", dst_slots[", i, "] = ", at_host(dst, i));
  }
  KD_CHECK(h[kDuplicateDst] == kNone, "dst_slots must be distinct, but dst_slots[",
           h[kDuplicateDst], "] = ", at_host(dst, h[kDuplicateDst]), " appears earlier too");
  KD_CHECK(h[kOverlap] == kNone, "disjoint=True needs src_slots and dst_slots to share no slot, but src_slots[",
           h[kOverlap], "] = ", at_host(src, h[kOverlap]), " is also a destination");
}

// The widest access (16, 8, 4, 2 or 1 bytes) that divides the row size, every base pointer
// and every row stride, so vector loads are always aligned.
int vector_bytes(int64_t row_bytes, std::initializer_list<const LayerTable*> tables, int layers) {
  uint64_t bits = static_cast<uint64_t>(row_bytes);
  for (const LayerTable* t : tables)
    for (int l = 0; l < layers; ++l)
      bits |= reinterpret_cast<uintptr_t>(t->base[l]) | static_cast<uint64_t>(t->stride[l]);
  for (int w = 16; w > 1; w /= 2)
    if (bits % w == 0) return w;
  return 1;
}

template <typename I>
void launch_rows(const LayerTable& in, const LayerTable& out, int layers, const at::Tensor& src,
                 const at::Tensor& dst, int64_t slots, int64_t row_bytes, bool in_indexed,
                 bool out_indexed) {
  const int64_t pairs = src.numel();
  const dim3 grid(ceil_div(pairs, kWarps), layers);
  auto go = [&](auto vec) {
    using V = decltype(vec);
    launch_kernel(move_rows_kernel<V, I>, grid, kWarps * 32, 0, in, out, src.data_ptr<I>(),
                  dst.data_ptr<I>(), pairs, slots, row_bytes / static_cast<int64_t>(sizeof(V)),
                  in_indexed, out_indexed, guard_words());
  };
  switch (vector_bytes(row_bytes, {&in, &out}, layers)) {
    case 16: go(uint4{}); break;
    case 8: go(uint2{}); break;
    case 4: go(uint32_t{}); break;
    case 2: go(uint16_t{}); break;
    default: go(uint8_t{}); break;
  }
}

// The buffers to move, each once: a tensor listed twice is one buffer (a second pass would
// move moved rows); buffers sharing memory any other way are refused by name.
std::vector<at::Tensor> distinct_layers(at::TensorList kv_layers) {
  std::vector<at::Tensor> out;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  std::vector<size_t> index;
  for (size_t i = 0; i < kv_layers.size(); ++i) {
    const at::Tensor& kv = kv_layers[i];
    bool same = false;
    for (const at::Tensor& o : out) {
      same = same || (o.data_ptr() == kv.data_ptr() && o.sizes() == kv.sizes() &&
                      o.strides() == kv.strides() && o.scalar_type() == kv.scalar_type());
    }
    if (same) continue;
    const auto lo = reinterpret_cast<uintptr_t>(kv.data_ptr());
    const uintptr_t hi = kv.dim() == 0 || kv.size(0) == 0 ? lo
        : lo + static_cast<uintptr_t>(((kv.size(0) - 1) * kv.stride(0) + kv[0].numel()) * kv.element_size());
    for (size_t j = 0; j < spans.size(); ++j) {
      KD_CHECK(!(lo < spans[j].second && spans[j].first < hi), "kv_layers[", i,
               "] shares memory with kv_layers[", index[j],
               "]; a buffer may appear twice only as the identical tensor");
    }
    spans.emplace_back(lo, hi);
    index.push_back(i);
    out.push_back(kv);
  }
  return out;
}

void move_kv(at::TensorList kv_layers, const at::Tensor& src_slots, const at::Tensor& dst_slots,
             bool disjoint) {
  check_index(src_slots, "src_slots");
  check_index(dst_slots, "dst_slots");
  check_dim(src_slots, "src_slots", 1);
  check_dim(dst_slots, "dst_slots", 1);
  KD_CHECK(dst_slots.scalar_type() == src_slots.scalar_type(), "dst_slots must be torch.",
           dtype_name(src_slots.scalar_type()), " like src_slots, got torch.",
           dtype_name(dst_slots.scalar_type()));
  KD_CHECK(dst_slots.numel() == src_slots.numel(), "dst_slots must have ", src_slots.numel(),
           " entries like src_slots, got ", dst_slots.numel());
  KD_CHECK(src_slots.is_cuda(), "src_slots must be a CUDA tensor, got device ", src_slots.device());
  check_cuda(dst_slots, "dst_slots", src_slots);
  if (kv_layers.empty()) return;
  const std::vector<at::Tensor> layers_once = distinct_layers(kv_layers);
  const at::Tensor& first = kv_layers[0];
  KD_CHECK(first.dim() >= 1, "kv_layers[0] must be [S, ...], got a scalar");
  const int64_t slots = first.size(0);
  int64_t row_bytes = first.element_size();
  for (int64_t d = 1; d < first.dim(); ++d) row_bytes *= first.size(d);
  for (size_t l = 0; l < kv_layers.size(); ++l) {
    const at::Tensor& kv = kv_layers[l];
    const std::string name = "kv_layers[" + std::to_string(l) + "]";
    check_cuda(kv, name.c_str(), src_slots);
    KD_CHECK(kv.dim() >= 1 && kv.size(0) == slots, name, " must have ", slots,
             " slots like kv_layers[0], got shape ", kv.sizes());
    int64_t expected = 1;
    for (int64_t d = kv.dim() - 1; d >= 1; --d) {
      KD_CHECK(kv.size(d) == 1 || kv.stride(d) == expected, name,
               " must have contiguous rows (only dim 0 may be strided), got strides ", kv.strides());
      expected *= kv.size(d);
    }
    const int64_t bytes = expected * kv.element_size();
    KD_CHECK(bytes == row_bytes, name, " must have rows of ", row_bytes,
             " bytes like kv_layers[0], got ", bytes, " (shape ", kv.sizes(), ", ", dtype_name(kv.scalar_type()), ")");
    KD_CHECK(slots <= 1 || kv.stride(0) * kv.element_size() >= row_bytes, name,
             " must not have overlapping rows, got strides ", kv.strides());
  }
  const at::Tensor src = src_slots.contiguous(), dst = dst_slots.contiguous();
  const int64_t pairs = src.numel();
  if (pairs == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());

  dispatch_index(src.scalar_type(), [&](auto tag) {
    using index_t = decltype(tag);
    if (check_mode()) validate_slots<index_t>(src, dst, slots, disjoint);
    if (row_bytes == 0 || slots == 0) return;
    const int64_t layers = static_cast<int64_t>(layers_once.size());
    const int64_t per_layer = pairs * row_bytes;
    const int64_t chunk = disjoint ? std::min<int64_t>(layers, kMaxLayers)
                                   : std::clamp<int64_t>(kScratchBytes / per_layer, 1,
                                                         std::min<int64_t>(layers, kMaxLayers));
    at::Tensor scratch;
    if (!disjoint) scratch = at::empty({chunk, pairs, row_bytes}, src.options().dtype(at::kByte));
    for (int64_t l0 = 0; l0 < layers; l0 += chunk) {
      const int n = static_cast<int>(std::min<int64_t>(layers - l0, chunk));
      LayerTable kv{}, tmp{};
      for (int l = 0; l < n; ++l) {
        const at::Tensor& t = layers_once[l0 + l];
        kv.base[l] = static_cast<char*>(t.data_ptr());
        kv.stride[l] = t.stride(0) * t.element_size();
        if (!disjoint) {
          tmp.base[l] = static_cast<char*>(scratch.data_ptr()) + l * per_layer;
          tmp.stride[l] = row_bytes;
        }
      }
      if (disjoint) {
        launch_rows<index_t>(kv, kv, n, src, dst, slots, row_bytes, true, true);
      } else {
        launch_rows<index_t>(kv, tmp, n, src, dst, slots, row_bytes, true, false);
        launch_rows<index_t>(tmp, kv, n, src, dst, slots, row_bytes, false, true);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("move_kv", &move_kv); }

}  // namespace kdtree
