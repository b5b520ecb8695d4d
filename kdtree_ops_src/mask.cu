// Tree-mask packing: a bool node x node mask, or SGLang's flat per-request custom mask, to the
// packed int32 rows verify_attn reads (bit j % 32 of word j / 32 of row i: node i sees node j).
#include "common.cuh"

namespace kdtree {
namespace {

// One thread per (row, 32-bit word).
__global__ void pack_tree_mask_kernel(const uint8_t* __restrict__ mask, int64_t row_stride,
                                      int64_t rows, int64_t cols, int words, int32_t* out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * words) return;
  const int64_t row = idx / words;
  const int w = static_cast<int>(idx - row * words);
  uint32_t bits = 0;
  const uint8_t* src = mask + row * row_stride + w * 32;
  const int n = static_cast<int>(cols - w * 32 < 32 ? cols - w * 32 : 32);
  for (int j = 0; j < n; ++j) bits |= static_cast<uint32_t>(src[j] != 0) << j;
  out[idx] = static_cast<int32_t>(bits);
}

// Row i of request b (node n = i - qo_indptr[b]) reads the tree columns of its flat block:
// custom_mask[mask_indptr[b] + n * (prefix + nodes) + prefix + j]. A row whose columns would
// lie outside custom_mask (or not fit the words) reads nothing: it gets no bits and raises
// the guard.
__global__ void sglang_mask_kernel(const uint8_t* __restrict__ mask, int64_t mask_len,
                                   IndexView mask_indptr, IndexView qo_indptr, IndexView kv_indptr,
                                   int batch, int64_t rows, int words, int32_t* out, int* guard) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * words) return;
  const int64_t row = idx / words;
  const int w = static_cast<int>(idx - row * words);
  int lo = 0, hi = batch;  // last b with qo_indptr[b] <= row
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (qo_indptr[mid] <= row) lo = mid; else hi = mid;
  }
  uint32_t bits = 0;
  if (row >= qo_indptr[0] && row < qo_indptr[batch]) {
    const int b = lo;
    const int64_t node = row - qo_indptr[b], nodes = qo_indptr[b + 1] - qo_indptr[b];
    const int64_t prefix = kv_indptr[b + 1] - kv_indptr[b];
    // Checked in an order that keeps every product below 2^63.
    const int64_t first = mask_indptr[b];
    const int64_t start = first >= 0 && node < nodes && nodes <= 32 * words && prefix >= 0 && prefix <= mask_len
                              ? first + node * (prefix + nodes) + prefix : -1;
    if (start >= 0 && start <= mask_len - nodes) {
      const uint8_t* src = mask + start + w * 32;
      const int n = static_cast<int>(nodes - w * 32 < 32 ? nodes - w * 32 : 32);
      for (int j = 0; j < n; ++j) bits |= static_cast<uint32_t>(src[j] != 0) << j;
    } else {
      raise_guard(guard, kGuardMaskIndptr);
    }
  }
  out[idx] = static_cast<int32_t>(bits);
}

void check_mask_dtype(const at::Tensor& t, const char* name) {
  KD_CHECK(t.scalar_type() == at::kBool || t.scalar_type() == at::kByte, name,
           " must be bool or uint8, got ", dtype_name(t.scalar_type()));
}

at::Tensor pack_tree_mask(const at::Tensor& mask) {
  KD_CHECK(mask.is_cuda(), "mask must be a CUDA tensor, got device ", mask.device());
  check_dim(mask, "mask", 2);
  check_mask_dtype(mask, "mask");
  check_last_contiguous(mask, "mask");
  const int64_t rows = mask.size(0), cols = mask.size(1);
  const int words = static_cast<int>(std::max<int64_t>(1, (cols + 31) / 32));
  at::Tensor out = at::empty({rows, words}, mask.options().dtype(at::kInt));
  if (rows == 0) return out;
  const c10::cuda::CUDAGuard guard(mask.device());
  pack_tree_mask_kernel<<<ceil_div(rows * words, 256), 256, 0, current_stream()>>>(
      static_cast<const uint8_t*>(mask.data_ptr()), mask.stride(0), rows, cols, words,
      out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor sglang_mask_to_packed(const at::Tensor& custom_mask, const at::Tensor& mask_indptr,
                                 const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                                 int64_t num_rows, int64_t max_nodes) {
  KD_CHECK(custom_mask.is_cuda(), "custom_mask must be a CUDA tensor, got device ", custom_mask.device());
  check_dim(custom_mask, "custom_mask", 1);
  check_mask_dtype(custom_mask, "custom_mask");
  KD_CHECK(custom_mask.is_contiguous(), "custom_mask must be contiguous");
  for (auto [t, name] : {std::pair{&mask_indptr, "mask_indptr"}, {&qo_indptr, "qo_indptr"}, {&kv_indptr, "kv_indptr"}}) {
    check_cuda(*t, name, custom_mask);
    check_dim(*t, name, 1);
    KD_CHECK(t->is_contiguous(), name, " must be contiguous");
    KD_CHECK(t->size(0) == qo_indptr.size(0) && t->size(0) >= 1, name, " must have batch + 1 = ",
             qo_indptr.size(0), " entries, got ", t->size(0));
  }
  check_index(mask_indptr, "mask_indptr");
  check_index(qo_indptr, "qo_indptr");
  check_index(kv_indptr, "kv_indptr");
  KD_CHECK(num_rows >= 0 && max_nodes >= 1, "num_rows must be >= 0 and max_nodes >= 1, got ",
           num_rows, " and ", max_nodes);
  const int words = static_cast<int>((max_nodes + 31) / 32);
  at::Tensor out = at::empty({num_rows, words}, qo_indptr.options().dtype(at::kInt));
  if (num_rows == 0) return out;
  const c10::cuda::CUDAGuard guard(custom_mask.device());
  sglang_mask_kernel<<<ceil_div(num_rows * words, 256), 256, 0, current_stream()>>>(
      static_cast<const uint8_t*>(custom_mask.data_ptr()), custom_mask.numel(), index_view(mask_indptr),
      index_view(qo_indptr), index_view(kv_indptr),
      static_cast<int>(qo_indptr.size(0) - 1), num_rows, words, out.data_ptr<int32_t>(), guard_words());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("pack_tree_mask", &pack_tree_mask);
  m.impl("sglang_mask_to_packed", &sglang_mask_to_packed);
}

}  // namespace kdtree
