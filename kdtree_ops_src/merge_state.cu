// LSE merge of two partial attention results: v = (e^sa va + e^sb vb) / (e^sa + e^sb),
// s = log(e^sa + e^sb). Memory-bound: one 16-byte vector per thread.
#include "common.cuh"

namespace kdtree {
namespace {

struct RowLayout {  // element strides of a [T, H, D] value tensor and a [T, H] lse tensor
  int64_t vt, vh, st, sh;
};

template <typename T, bool kVec>
__global__ void merge_state_kernel(const T* __restrict__ va, const float* __restrict__ sa,
                                   RowLayout la, const T* __restrict__ vb,
                                   const float* __restrict__ sb, RowLayout lb, T* vo, float* so,
                                   RowLayout lo, int64_t heads, int64_t dim, int64_t rows) {
  constexpr int N = kVec ? Vec<T>::N : 1;
  const int64_t per_row = dim / N;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * per_row) return;
  const int64_t row = idx / per_row, col = (idx - row * per_row) * N;
  const int64_t t = row / heads, h = row - t * heads;

  const float a = sa[t * la.st + h * la.sh], b = sb[t * lb.st + h * lb.sh];
  // NaN or +inf in either lse: the row is NaN (never a silently dropped partial). -inf is an
  // empty partial: weight 0 and its values never read, so uninitialised ones cannot leak in.
  const bool invalid = isnan(a) || isnan(b) || a == INFINITY || b == INFINITY;
  const float m = fmaxf(a, b);
  const float wa = a == -INFINITY ? 0.f : __expf(a - m);
  const float wb = b == -INFINITY ? 0.f : __expf(b - m);
  const float sum = wa + wb;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;

  const T* pa = va + t * la.vt + h * la.vh + col;
  const T* pb = vb + t * lb.vt + h * lb.vh + col;
  T* po = vo + t * lo.vt + h * lo.vh + col;
  float fa[N], fb[N], fo[N];
  if constexpr (kVec) {
    Vec<T>::to_float(*reinterpret_cast<const uint4*>(pa), fa);
    Vec<T>::to_float(*reinterpret_cast<const uint4*>(pb), fb);
  } else {
    fa[0] = to_float(*pa);
    fb[0] = to_float(*pb);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float x = (wa > 0.f ? wa * fa[i] : 0.f) + (wb > 0.f ? wb * fb[i] : 0.f);
    fo[i] = invalid ? NAN : x * inv;
  }
  if constexpr (kVec) {
    *reinterpret_cast<uint4*>(po) = Vec<T>::from_float(fo);
  } else {
    *po = from_float<T>(fo[0]);
  }
  if (col == 0) so[t * lo.st + h * lo.sh] = invalid ? NAN : sum > 0.f ? m + __logf(sum) : -INFINITY;
}

void check_pair(const at::Tensor& v, const at::Tensor& s, const char* vname, const char* sname,
                const at::Tensor& like) {
  check_cuda(v, vname, like);
  check_cuda(s, sname, like);
  check_dim(v, vname, 3);
  check_dim(s, sname, 2);
  check_last_contiguous(v, vname);
  check_dtype(s, sname, at::kFloat);
  KD_CHECK(v.scalar_type() == like.scalar_type(), vname, " must be ", dtype_name(like.scalar_type()),
           " like v_a, got ", dtype_name(v.scalar_type()));
  KD_CHECK(v.sizes() == like.sizes(), vname, " must have shape ", like.sizes(), ", got ",
           v.sizes());
  KD_CHECK(s.size(0) == v.size(0) && s.size(1) == v.size(1), sname, " must have shape [",
           v.size(0), ", ", v.size(1), "], got ", s.sizes());
}

RowLayout layout(const at::Tensor& v, const at::Tensor& s) {
  return {v.stride(0), v.stride(1), s.stride(0), s.stride(1)};
}

bool aligned16(const at::Tensor& t, int64_t elem) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * elem) % 16 == 0 &&
         (t.stride(1) * elem) % 16 == 0;
}

void launch(const at::Tensor& va, const at::Tensor& sa, const at::Tensor& vb,
            const at::Tensor& sb, const at::Tensor& vo, const at::Tensor& so) {
  const int64_t rows = va.size(0) * va.size(1), dim = va.size(2);
  if (rows == 0 || dim == 0) return;
  const c10::cuda::CUDAGuard guard(va.device());
  const int64_t elem = va.element_size();
  dispatch_float(va.scalar_type(), "v_a", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = dim % Vec<T>::N == 0 && aligned16(va, elem) && aligned16(vb, elem) &&
                     aligned16(vo, elem);
    const int64_t threads = rows * (vec ? dim / Vec<T>::N : dim);
    constexpr int kBlock = 256;
    launch_kernel(vec ? merge_state_kernel<T, true> : merge_state_kernel<T, false>,
                  ceil_div(threads, kBlock), kBlock, 0, static_cast<const T*>(va.data_ptr()),
                  sa.data_ptr<float>(), layout(va, sa), static_cast<const T*>(vb.data_ptr()),
                  sb.data_ptr<float>(), layout(vb, sb), static_cast<T*>(vo.data_ptr()),
                  so.data_ptr<float>(), layout(vo, so), va.size(1), dim, rows);
  });
}

std::tuple<at::Tensor, at::Tensor> merge_state(const at::Tensor& v_a, const at::Tensor& s_a,
                                               const at::Tensor& v_b, const at::Tensor& s_b) {
  check_pair(v_a, s_a, "v_a", "s_a", v_a);
  check_pair(v_b, s_b, "v_b", "s_b", v_a);
  at::Tensor v = at::empty(v_a.sizes(), v_a.options());
  at::Tensor s = at::empty(s_a.sizes(), s_a.options());
  launch(v_a, s_a, v_b, s_b, v, s);
  return {v, s};
}

void merge_state_(const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b,
                  const at::Tensor& s_b) {
  check_pair(v_a, s_a, "v_a", "s_a", v_a);
  check_pair(v_b, s_b, "v_b", "s_b", v_a);
  launch(v_a, s_a, v_b, s_b, v_a, s_a);
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("merge_state", &merge_state);
  m.impl("merge_state_", &merge_state_);
}

}  // namespace kdtree
