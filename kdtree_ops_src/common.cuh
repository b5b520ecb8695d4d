// Shared helpers for the kdtree CUDA ops. Schemas live in kdtree_ops.py; every .cu file
// only registers CUDA kernels with TORCH_LIBRARY_IMPL(kdtree, CUDA, m).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace kdtree {

// Argument checks that name the argument and what was expected; run on the host before any
// launch, so bad input raises instead of reading out of bounds.
#define KD_CHECK(cond, ...) TORCH_CHECK(cond, "kdtree: ", __VA_ARGS__)

// torch's Python names, so messages read like the Python API ("float32", not "Float").
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kBool: return "bool";
    case at::ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    default: return c10::toString(t);
  }
}

inline void check_cuda(const at::Tensor& t, const char* name, const at::Tensor& like) {
  KD_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  KD_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", got ",
           t.device());
}

inline void check_dim(const at::Tensor& t, const char* name, int64_t dim) {
  KD_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got shape ", t.sizes());
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  KD_CHECK(t.scalar_type() == dtype, name, " must be ", dtype_name(dtype), ", got ",
           dtype_name(t.scalar_type()));
}

inline void check_last_contiguous(const at::Tensor& t, const char* name) {
  KD_CHECK(t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1, name,
           " must be contiguous in its last dim, got strides ", t.strides());
}

inline void check_index(const at::Tensor& t, const char* name) {
  KD_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
           " must be int32 or int64, got ", dtype_name(t.scalar_type()));
}

// An int32 or int64 index tensor read as int64 on the device. SGLang hands the same index in
// either width (its CUDA-graph buffers hold qo_indptr and mask_indptr as int64, its eager
// metadata int32), and one uniform branch per read costs less than a kernel per combination.
struct IndexView {
  const void* ptr;
  bool wide;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(ptr)[i] : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[i]);
  }
};
inline IndexView index_view(const at::Tensor& t) { return {t.data_ptr(), t.scalar_type() == at::kLong}; }

// The tree ops' shared limits: a full warp's mask, and nodes per tree besides the root.
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kMaxBudget = 1024;
// The deepest tree the builds take: a node's root path fits one warp, its depth five bits.
constexpr int kMaxDepth = 31;

// A tree node or heap candidate of a tree build in 32 bits: parent (ParentBits), rank among
// its parent's children (RankBits), depth (5 bits), then FlagBits of the build's own. Each
// build sizes the fields to its tables; rank_tuple_less reads all of them the same way.
template <int ParentBits, int RankBits, int FlagBits = 0> struct PackedId {
  static constexpr int kDepthShift = ParentBits + RankBits, kFlagShift = kDepthShift + 5;
  static_assert(kFlagShift + FlagBits <= 32, "PackedId's fields must fit 32 bits");
  __device__ __forceinline__ static uint32_t pack(uint32_t parent, uint32_t rank, uint32_t depth,
                                                  uint32_t flags = 0) {
    return parent | rank << ParentBits | depth << kDepthShift | flags << kFlagShift;
  }
  __device__ __forceinline__ static uint32_t parent(uint32_t id) {
    return id & ((1u << ParentBits) - 1);
  }
  __device__ __forceinline__ static uint32_t rank(uint32_t id) {
    return (id >> ParentBits) & ((1u << RankBits) - 1);
  }
  __device__ __forceinline__ static uint32_t depth(uint32_t id) {
    if constexpr (FlagBits == 0) return id >> kDepthShift;  // the top field: nothing to mask
    else return (id >> kDepthShift) & 0x1Fu;
  }
  __device__ __forceinline__ static uint32_t flags(uint32_t id) {
    return (id >> kFlagShift) & ((1u << FlagBits) - 1);
  }
};

// True when candidate x's rank tuple precedes y's lexicographically (a proper prefix first):
// the order of a best-first heap among equal scores. x and y are distinct PackedId layouts of
// type Id; their parents and all their ancestors are built nodes, nodes[n] = node n's id.
template <typename Id>
__device__ __forceinline__ bool rank_tuple_less(uint32_t x, uint32_t y, const uint32_t* nodes) {
  uint32_t px = Id::parent(x), cx = Id::rank(x), dx = Id::depth(x);
  uint32_t py = Id::parent(y), cy = Id::rank(y), dy = Id::depth(y);
  bool y_longer = false;
  while (dx > dy) {  // x -> its ancestor at y's depth
    const uint32_t u = nodes[px];
    cx = Id::rank(u);
    px = Id::parent(u);
    --dx;
  }
  while (dy > dx) {
    const uint32_t u = nodes[py];
    cy = Id::rank(u);
    py = Id::parent(u);
    --dy;
    y_longer = true;
  }
  if (px == py) return cx != cy ? cx < cy : y_longer;  // equal up to here: the prefix is first
  for (;;) {  // distinct nodes at one depth >= 1: climb to the children of their common ancestor
    const uint32_t u = nodes[px], v = nodes[py];
    if (Id::parent(u) == Id::parent(v)) return Id::rank(u) < Id::rank(v);
    px = Id::parent(u);
    py = Id::parent(v);
  }
}

// A heap pop spread over a warp, each lane holding its best candidate `bid`: among the lanes
// whose best has the least key (`tied`), the one with the least rank tuple wins. Returns that
// lane and puts its candidate in wid. Every lane of the warp calls it.
template <typename Id>
__device__ __forceinline__ int pop_lane(bool tied, uint32_t bid, const uint32_t* nodes,
                                        uint32_t& wid) {
  const unsigned tie = __ballot_sync(kFull, tied);
  int w = __ffs(tie) - 1;
  wid = __shfl_sync(kFull, bid, w);
  for (unsigned rest = tie & (tie - 1); rest; rest &= rest - 1) {
    const int l = __ffs(rest) - 1;
    const uint32_t other = __shfl_sync(kFull, bid, l);
    if (rank_tuple_less<Id>(other, wid, nodes)) {
      w = l;
      wid = other;
    }
  }
  return w;
}


inline void check_contiguous(const at::Tensor& t, const char* name) {
  KD_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

// `dtype`, or nullopt for an index of either width (int32 or int64).
inline void check_dtype_or_index(const at::Tensor& t, const char* name,
                                 std::optional<at::ScalarType> dtype) {
  if (dtype.has_value()) check_dtype(t, name, *dtype);
  else check_index(t, name);
}

// A contiguous tensor of `dim` dims and `dtype` on like's device.
inline void check_dense(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t dim,
                        at::ScalarType dtype) {
  check_cuda(t, name, like);
  check_dim(t, name, dim);
  check_dtype(t, name, dtype);
  check_contiguous(t, name);
}

// A [B, N] tree tensor (depths, parents, tokens) shaped like `like`.
inline void check_tree_arg(const at::Tensor& t, const char* name, const at::Tensor& like,
                           at::ScalarType dtype) {
  check_dense(t, name, like, 2, dtype);
  KD_CHECK(t.sizes() == like.sizes(), name, " must have shape ", like.sizes(), ", got ",
           t.sizes());
}

// A contiguous [B] tensor, one value per request, on like's device; dtype nullopt: an index of
// either width.
inline void check_per_request(const at::Tensor& t, const char* name, const at::Tensor& like,
                              int64_t B, std::optional<at::ScalarType> dtype = std::nullopt) {
  check_cuda(t, name, like);
  check_dim(t, name, 1);
  check_dtype_or_index(t, name, dtype);
  check_contiguous(t, name);
  KD_CHECK(t.size(0) == B, name, " must have shape [", B, "], got ", t.sizes());
}

inline void check_prefix_lens(const at::Tensor& prefix_lens, const at::Tensor& like, int64_t B) {
  check_per_request(prefix_lens, "prefix_lens", like, B);
}

// A buffer an op writes into: contiguous, exactly `shape` and `dtype`, on like's device.
inline void check_out(const at::Tensor& t, const char* name, const at::Tensor& like,
                      at::IntArrayRef shape, at::ScalarType dtype) {
  check_cuda(t, name, like);
  check_dtype(t, name, dtype);
  KD_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  check_contiguous(t, name);
}

// The drafter's per-position top-K as the tree builds take it: [B, L, K] float32 log-probs,
// their tokens shaped alike (token_dtype nullopt: int32 or int64), 1 <= L <= kMaxDepth,
// 1 <= K <= max_k (what the build's index arithmetic allows), a budget in [1, kMaxBudget].
inline void check_draft(const at::Tensor& topk_logprobs, const at::Tensor& topk_tokens,
                        std::optional<at::ScalarType> token_dtype, int64_t budget, int64_t max_k) {
  check_dense(topk_logprobs, "topk_logprobs", topk_logprobs, 3, at::kFloat);
  check_cuda(topk_tokens, "topk_tokens", topk_logprobs);
  check_dtype_or_index(topk_tokens, "topk_tokens", token_dtype);
  KD_CHECK(topk_tokens.sizes() == topk_logprobs.sizes(), "topk_tokens must have shape ",
           topk_logprobs.sizes(), " like topk_logprobs, got ", topk_tokens.sizes());
  check_contiguous(topk_tokens, "topk_tokens");
  const int64_t L = topk_logprobs.size(1), K = topk_logprobs.size(2);
  KD_CHECK(budget >= 1 && budget <= kMaxBudget, "budget must be in [1, ", kMaxBudget, "], got ",
           budget);
  KD_CHECK(L >= 1 && L <= kMaxDepth, "topk_logprobs must have 1 to ", kMaxDepth,
           " positions (dim 1), got ", L);
  KD_CHECK(K >= 1 && K <= max_k, "topk_logprobs must have 1 to ", max_k, " ranks (dim 2), got ",
           K);
}

// Calls f with an int32_t or int64_t value for an index tensor's dtype (checked by the caller):
// the one way the ops dispatch on index width.
template <typename F> void dispatch_index(at::ScalarType dtype, F&& f) {
  if (dtype == at::kInt) f(int32_t{});
  else f(int64_t{});
}

inline int max_smem_optin(const at::Tensor& on) {
  int v = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, on.get_device()));
  return v;
}

// Dynamic shared memory a kernel may ask for beside up to 1 KB of its own static arrays.
inline size_t dynamic_smem_limit(const at::Tensor& on) {
  return static_cast<size_t>(max_smem_optin(on)) - 1024;
}

// A KDTREE_* variable as kdtree_ops reads it: surrounding blanks ignored, in lower case;
// nullopt when unset.
inline std::optional<std::string> env_setting(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return std::nullopt;
  std::string v(raw);
  const auto first = v.find_first_not_of(" \t\n\r"), last = v.find_last_not_of(" \t\n\r");
  v = first == std::string::npos ? "" : v.substr(first, last - first + 1);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return v;
}

// A KDTREE_* switch read exactly as kdtree_ops.env_flag reads it: 1/true/yes/on or
// 0/false/no/off in any case, surrounding blanks ignored; unset or anything else is `fallback`
// (Python also warns about the latter).
inline bool env_flag(const char* name, bool fallback) {
  const std::optional<std::string> v = env_setting(name);
  if (!v) return fallback;
  if (*v == "1" || *v == "true" || *v == "yes" || *v == "on") return true;
  if (v->empty() || *v == "0" || *v == "false" || *v == "no" || *v == "off") return false;
  return fallback;
}

// Graph-safe error reporting. Index and indptr values live on the device, so the host cannot
// check them without a sync (impossible under CUDA-graph capture). Kernels that meet an
// out-of-range value never read or write outside a tensor: they produce a defined result (NaN
// rows, skipped writes) and set their guard's word in this process-wide table of host memory
// (mapped, so kernels store to it directly and a captured graph replays the same pointer).
// The host reads it without synchronising through kdtree_guard_errors (kdtree_ops.guard_errors).
enum Guard : int {
  kGuardKvSlot = 0,       // verify_attn: a kv_indices value outside kv_cache's rows
  kGuardVerifyIndptr,     // verify_attn: qo_indptr/kv_indptr malformed, or nodes past the mask
  kGuardMaskIndptr,       // sglang_mask_to_packed: a row's bits outside custom_mask
  kGuardMoveSlot,         // move_kv: a slot outside the pool (the pair is skipped)
  kGuardFp8Range,         // verify_attn, fp8 pool: k_scale not a positive normal float, or a
                          // tree_k value beyond 65504 x k_scale (f16 in the pool's units)
  kGuardCount
};

// Allocated on first use (kdtree_ops.load() makes that use, before any graph capture).
inline int* guard_words() {
  static int* words = [] {
    void* w = nullptr;
    // Portable + mapped: one pointer valid in every device's kernels (UVA, every sm_80+ GPU).
    C10_CUDA_CHECK(cudaHostAlloc(&w, kGuardCount * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(w, 0, kGuardCount * sizeof(int));
    return static_cast<int*>(w);
  }();
  return words;
}

// A plain store, not an atomic: any nonzero value means "tripped", and PCIe does not promise
// atomics on host memory.
__device__ __forceinline__ void raise_guard(int* words, Guard g) {
  if (words != nullptr) *reinterpret_cast<volatile int*>(words + g) = 1;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Launches on the current stream, where a CUDA graph capture records it, and raises on a launch
// error; args convert to the kernel's parameter types as in a <<<>>> launch.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  kernel<<<grid, block, smem, current_stream()>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Lets `kernel` launch with up to `bytes` of dynamic shared memory (past the 48 KB default) on
// the current device. The limit only ever rises: the driver is asked when a kernel wants more
// than it was allowed on that device so far, not on every launch (and never lowered, which
// would fail a later launch of a larger size). Thread-safe; a call that throws is made again
// next time.
template <typename... Params>
void allow_dynamic_smem(void (*kernel)(Params...), int bytes) {
  static std::mutex mu;
  static std::map<std::pair<void (*)(Params...), int>, int> allowed;
  const std::pair<void (*)(Params...), int> key{kernel, c10::cuda::current_device()};
  {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = allowed.find(key);
    if (it != allowed.end() && it->second >= bytes) return;
  }
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const std::lock_guard<std::mutex> lock(mu);
  int& limit = allowed[key];
  limit = std::max(limit, bytes);
}

// launch_kernel for dynamic shared memory past the 48 KB default, which a kernel gets only
// after raising its own limit (smem varies with the arguments).
template <typename... Params, typename... Args>
void launch_kernel_optin(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         Args&&... args) {
  allow_dynamic_smem(kernel, static_cast<int>(smem));
  launch_kernel(kernel, grid, block, smem, std::forward<Args>(args)...);
}

// ask() for device `dev`, asked once per device and kept: a store per call site (each lambda
// is a type of its own). Thread-safe; an ask that throws is asked again next time.
template <typename Ask>
auto once_per_device(int dev, Ask ask) -> decltype(ask()) {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static decltype(ask()) known[kMaxDevices];
  if (dev < 0 || dev >= kMaxDevices) return ask();
  std::call_once(once[dev], [&] { known[dev] = ask(); });
  return known[dev];
}

// What the launchers ask of a device: asked of the driver once per device, not on every launch.
struct DeviceFacts {
  int sms = 0, major = 0, minor = 0;
};
inline DeviceFacts device_facts(int dev) {
  return once_per_device(dev, [dev] {
    DeviceFacts f;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, dev));
    return f;
  });
}
inline DeviceFacts device_facts(const at::Tensor& on) { return device_facts(on.get_device()); }

inline unsigned ceil_div(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

template <typename T> struct Vec;  // 16-byte vector of T and its float conversions
template <> struct Vec<float> {
  static constexpr int N = 4;
  __device__ static void to_float(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 from_float(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};
template <typename H, typename H2, H2 (*Pack)(float2), float2 (*Unpack)(H2)> struct Vec16 {
  static constexpr int N = 8;
  __device__ static void to_float(const uint4& v, float* f) {
    const H2* h = reinterpret_cast<const H2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 x = Unpack(h[i]);
      f[2 * i] = x.x; f[2 * i + 1] = x.y;
    }
  }
  __device__ static uint4 from_float(const float* f) {
    uint4 v;
    H2* h = reinterpret_cast<H2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = Pack(make_float2(f[2 * i], f[2 * i + 1]));
    return v;
  }
};
__device__ inline __nv_bfloat162 pack_bf16(float2 x) { return __float22bfloat162_rn(x); }
__device__ inline float2 unpack_bf16(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ inline __half2 pack_f16(float2 x) { return __float22half2_rn(x); }
__device__ inline float2 unpack_f16(__half2 x) { return __half22float2(x); }
template <> struct Vec<__nv_bfloat16>
    : Vec16<__nv_bfloat16, __nv_bfloat162, pack_bf16, unpack_bf16> {};
template <> struct Vec<__half> : Vec16<__half, __half2, pack_f16, unpack_f16> {};

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_float(__half x) { return __half2float(x); }
template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }

// Inclusive prefix sum over the 32 lanes of a full warp (lane i gets lanes 0..i).
template <typename T> __device__ __forceinline__ T warp_inclusive_scan(T x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// A typed pointer `off` bytes into a shared-memory carve-out.
template <typename T> __device__ __forceinline__ T* at_offset(unsigned char* base, size_t off) {
  return reinterpret_cast<T*>(base + off);
}

// Base of a shared-memory layout: each take(n) is the offset of the next array of n bytes,
// 16-byte aligned so any array can be read in vectors, and `bytes` the total so far. A layout
// built by one constructor on the host (to size the launch) and in the kernel (to find its
// arrays through at_offset) cannot disagree with itself.
struct Carve {
  size_t bytes = 0;
  __host__ __device__ size_t take(size_t n) {
    const size_t at = bytes;
    bytes += (n + 15) / 16 * 16;
    return at;
  }
};

// Exclusive prefix sum of one value per thread, in thread order, and the block's total; every
// thread must call it. s_scan holds 33 ints.
__device__ inline int block_exclusive_scan(int v, int* s_scan, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int x = warp_inclusive_scan(v);
  if (lane == 31) s_scan[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const int t = lane < warps ? s_scan[lane] : 0;
    const int w = warp_inclusive_scan(t);
    if (lane < warps) s_scan[lane] = w - t;
    if (lane == 31) s_scan[32] = w;
  }
  __syncthreads();
  const int r = s_scan[warp] + x - v;
  total = s_scan[32];
  __syncthreads();  // s_scan is reused by the next call
  return r;
}

// Calls f with a value of the CUDA element type matching `dtype` (fp32, bf16, fp16).
template <typename F> void dispatch_float(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    case at::kHalf: f(__half{}); break;
    default: KD_CHECK(false, name, " must be float32, bfloat16 or float16, got ", dtype_name(dtype));
  }
}

// Calls f with a value of the CUDA element type for 16-bit attention inputs (bf16, fp16).
template <typename F> void dispatch_half(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    case at::kHalf: f(__half{}); break;
    default: KD_CHECK(false, name, " must be bfloat16 or float16, got ", dtype_name(dtype));
  }
}

}  // namespace kdtree
