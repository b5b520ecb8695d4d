// Shared by the verify-attention kernels: the portable one (verify_attn.cu) and the Hopper ones
// (verify_attn_sm90_seesaw.cu, verify_attn_sm90.cu, verify_attn_sm90_fp8.cu). All take the same grid (CTA = one
// request's kRows (node, head) rows x one split of its keys) and write the same direct or
// partial outputs, so the host's split heuristic and the split merge serve any of them; how a
// request's keys are split may differ between kernels (the merge is order-free). The seesaw
// kernel also runs the balanced schedule (BalancedWork), with a merge of its own layout.
#pragma once

#include "common.cuh"

#include <cuda_fp8.h>

#include <cfloat>
#include <type_traits>

namespace kdtree {

constexpr int kDqk = 576, kDv = 512;
constexpr int kRows = 64, kKeys = 32;
// A row's running max only moves when a tile beats it by this much (log2 units): P stays
// <= 2^8, and most tiles skip rescaling O.
constexpr float kRescaleSlack = 8.f;

template <typename T> struct VerifyParams {
  const T* q;
  int64_t q_st, q_sh;
  // The pool: rows of T, or (kv8 set: an fp8 pool) rows of e4m3 bytes standing for e4m3 x
  // k_scale (*k_scale_ptr when set, so a graph replays a changed scale; see Fp8Math); kv
  // then only gives zero-filling copies a valid address. kv_stride is in elements either way.
  const T* kv;
  const uint8_t* kv8;
  int64_t kv_stride;
  const float* k_scale_ptr;
  float k_scale;
  const T* tree_k;
  int64_t tk_stride;
  // int32 or int64 each, independently (SGLang's graph buffers pass an int64 qo_indptr beside
  // an int32 kv_indptr), read in place: no call converts them. Values fit int (the host checks
  // the row and key counts).
  IndexView kv_indptr;
  const void* kv_indices;
  IndexView qo_indptr;
  const int32_t* mask;  // null: causal chain
  int64_t mask_stride;
  int mask_words;
  int batch, heads, splits;
  // > 0: the balanced schedule over this many CTAs per plane, `planes` planes (BalancedWork),
  // instead of splits, in CTAs of tile_rows rows.
  int balanced, planes, tile_rows;
  float scale_log2;
  // direct output (splits == 1) or partials [splits][T*H][512] + [splits][T*H]; under the
  // balanced schedule [planes][G][2][64][512] + [planes][G][2][64] (BalancedWork, share_partial)
  T* out;
  int64_t out_st, out_sh;
  float* lse;
  int64_t lse_st, lse_sh;
  float* part_o;
  float* part_lse;
  int64_t rows_total;
  // For the device guards (common.cuh): kv_cache rows, kv_indices entries, rows of q.
  int64_t kv_rows, n_indices;
  int tokens;
  int* guard;
  // Set where an fp8 pool was widened beforehand (launch_widen_fp8_pool): kv then holds its rows
  // as f16 in the pool's units, tree_k the tree rows likewise (bits of f16 whatever T is), and
  // request b's rows come out NaN where req_bad[b] != 0 (the widening met a slot outside the
  // pool or a tree row beyond f16, and raised the guard itself).
  const int32_t* req_bad;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  // src-size 0 zero-fills: keys past the end read as zeros, never as NaN garbage.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x in one MUFU op (ex2.approx: ~2 ulp; exact 0 at -inf), as flash-attention kernels use.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  }
  return r;
}

// fp8 pools run float16 tensor-core math on the e4m3 values themselves, with k_scale applied
// in float32: folded into the softmax scale for the scores and into the epilogue for the
// output. e4m3 -> f16 is exact, so widening a row costs one conversion per pair of values and
// rounds nothing. q (bf16) enters f16 times a per-CTA power of two (exact; folded out with
// k_scale), and the tree's own rows (T, unscaled) enter f16 divided by k_scale, so that every
// key of a tile is in the pool's units (one rounding, 2^-11 relative: finer than T's own).
using Fp8Math = __half;

// Eight e4m3 values (8 bytes, first in the low byte) -> eight f16 values (16 bytes), exactly.
__device__ __forceinline__ uint4 widen_e4m3x8(uint2 v) {
  uint4 r;
  uint32_t* out = &r.x;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t word = k < 2 ? v.x : v.y;
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(word >> (16 * (k & 1))), __NV_E4M3);
    out[k] = static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
  }
  return r;
}

template <typename T> __device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}

// Eight T values (16 bytes) -> eight f16 values times `scale`. `beyond` is set where a product
// passes f16's largest finite value (65504), which would turn into inf.
template <typename T> __device__ __forceinline__ uint4 to_f16x8(uint4 v, float scale, bool& beyond) {
  uint32_t* w = &v.x;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = unpack2<T>(w[k]);
    const float lo = f.x * scale, hi = f.y * scale;
    beyond |= fabsf(lo) > 65504.f || fabsf(hi) > 65504.f;
    w[k] = pack2<__half>(lo, hi);
  }
  return v;
}

// The largest |x| of the 16-bit floats of `w`, as bits (NaN above every magnitude).
__device__ __forceinline__ uint32_t peak_bits(uint32_t acc, uint32_t w) { return __vmaxu2(acc, w & 0x7fff7fffu); }
__device__ __forceinline__ uint32_t peak_bits_fold(uint32_t acc) { return max(acc & 0xffffu, acc >> 16); }

// The power of two a bf16 q whose largest magnitude is bf16 bits `peak` is multiplied by on
// its way into f16: it puts that magnitude in [2^14, 2^15), far from f16's overflow, and keeps
// every bf16 significand bit of values down to 2^-28 of it. 1 for zero, inf or NaN.
__device__ __forceinline__ float q_f16_factor(uint32_t peak) {
  const float mag = __uint_as_float(peak << 16);
  if (!(mag > 0.f) || !(mag <= FLT_MAX)) return 1.f;
  int x;
  frexpf(mag, &x);  // mag in [2^(x - 1), 2^x)
  return __int_as_float((min(max(15 - x, -126), 126) + 127) << 23);
}

// k_scale as the fp8 math can use it: a positive normal float32 (its inverse is finite).
// The host checks a float k_scale with it; the kernels check a tensor's (kGuardFp8Range).
__host__ __device__ __forceinline__ bool k_scale_usable(float k_scale) {
  return k_scale >= FLT_MIN && k_scale <= FLT_MAX;
}

template <typename T> __device__ __forceinline__ float kv_scale(const VerifyParams<T>& p) {
  return p.k_scale_ptr ? *p.k_scale_ptr : p.k_scale;
}

// A prefix slot outside kv_cache never reaches memory: the loader reads row 0 in its place and
// notes it in `bad` (a register, so the loops carry no pointer for it); the CTA's writers learn
// of it through one barrier with an OR (named_sync_or) before the epilogue, make the CTA's rows NaN
// (out and lse, or the partials the merge turns into NaN rows) and raise the guard.
template <typename T, typename Idx>
__device__ __forceinline__ Idx checked_slot(const VerifyParams<T>& p, Idx slot, bool& bad) {
  const bool ok = static_cast<uint64_t>(slot) < static_cast<uint64_t>(p.kv_rows);
  bad |= !ok;
  return ok ? slot : Idx(0);
}

// Named barrier `id` (0 is __syncthreads) over `count` threads: wait, or arrive without waiting.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Named barrier `id` over `count` threads that also returns whether any of them passed true.
__device__ __forceinline__ bool named_sync_or(int id, int count, bool v) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred in, out;\nsetp.ne.u32 in, %1, 0;\nbar.red.or.pred out, %2, %3, in;\n"
      "selp.u32 %0, 1, 0, out;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(v)), "r"(id), "r"(count)
      : "memory");
  return any != 0;
}
constexpr float kNaN = __builtin_nanf("");

// Called by one full warp: the request and first row of row tile `tile` of Rows rows (the
// portable kernel also runs 48-row tiles), scanning the requests' tile counts 32 at a time
// (req = kNoWork: the tile is past the work). Every CTA also checks the whole batch's indptrs,
// which is what makes the casts to int below safe: req = kMalformedBatch when qo_indptr does
// not run from 0 to T without decreasing, kv_indptr does not run from 0 to at most
// len(kv_indices) without decreasing, or a request has more nodes than tree_mask's words hold.
// Such a CTA takes rows [Rows tile, Rows tile + Rows) of the flattened T x H output as a
// request without keys (cta_span) and its epilogue writes them NaN: every output row is
// defined, through the kernels' own write path.
constexpr int kNoWork = -1, kMalformedBatch = -2;
template <typename T>
__device__ __forceinline__ bool request_malformed(const VerifyParams<T>& p, int b, int64_t q0, int64_t q1, int64_t k0,
                                                  int64_t k1) {
  return q1 < q0 || k1 < k0 || (b == 0 && (q0 != 0 || k0 != 0)) ||
         (b == p.batch - 1 && (q1 != p.tokens || k1 > p.n_indices)) ||
         (p.mask != nullptr && q1 - q0 > 32 * static_cast<int64_t>(p.mask_words));
}
template <typename T, int Rows = kRows>
__device__ __forceinline__ void find_row_tile(const VerifyParams<T>& p, int tile, int lane, int& req, int& row0) {
  int base = 0;
  req = kNoWork;
  row0 = 0;
  bool bad = false;
  for (int b0 = 0; b0 < p.batch; b0 += 32) {
    const int b = b0 + lane;
    int n = 0;
    if (b < p.batch) {
      const int64_t q0 = p.qo_indptr[b], q1 = p.qo_indptr[b + 1], k0 = p.kv_indptr[b], k1 = p.kv_indptr[b + 1];
      bad |= request_malformed(p, b, q0, q1, k0, k1);
      if (!bad) n = static_cast<int>(q1 - q0) * p.heads;
    }
    const int cnt = (n + Rows - 1) / Rows;
    const int incl = warp_inclusive_scan(cnt);
    const int excl = base + incl - cnt;
    const bool mine = b < p.batch && tile >= excl && tile < excl + cnt;
    const unsigned who = __ballot_sync(0xffffffffu, mine);
    if (who) {
      const int src = __ffs(who) - 1;
      req = __shfl_sync(0xffffffffu, b, src);
      row0 = (tile - __shfl_sync(0xffffffffu, excl, src)) * Rows;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (__any_sync(0xffffffffu, bad)) {
    req = kMalformedBatch;
    row0 = tile * Rows;
  }
}

// The balanced schedule (the seesaw kernel; grid (p.planes, p.balanced = G)). Splitting every
// request into the same number of CTAs waits on the longest request where lengths differ, and
// leaves SMs idle or runs a second wave where the row tiles do not divide the SMs. Instead
// plane r (blockIdx.x) takes row tile r of every request (the last plane also every further
// row tile, one after the other: requests with more nodes than the host assumed), and lays
// their keys in 128-key chunks out in (request, row tile, chunk) order: W_r chunks, of which
// CTA c takes [c W_r / G, (c + 1) W_r / G). Equal shares, and the CTAs of one c read the same
// keys of a request's row tiles at the same time (L2 serves all but the first); the grid puts
// them side by side in launch order (planes first: on an H100 and an H200 the grid (G, planes)
// ran 1-7% slower). A share walks one or more segments (a run of chunks of one "unit"
// (request, row tile)); a segment that holds its whole unit writes the output. Only a share's
// first and last segments can hold part of a unit (the ones between are whole), so a CTA
// writes at most two partials: rows [64 id, +64) of id = 2 (r G + c) for its first segment and
// 2 (r G + c) + 1 for its last (share_partial); the merge sums a unit's partials over the CTAs
// whose shares meet it.
constexpr int kChunkKeys = 128;
struct BalancedWork {
  int b;          // the request found: kNoWork if none, kMalformedBatch for a bad batch (find_row_tile's test)
  int chunks;     // its chunks
  int keys;       // its keys (prefix + nodes)
  int nodes;
  int q_begin;    // its first node
  int kv_begin;   // its first prefix slot's place in kv_indices
  int64_t work0;  // its first chunk's place in the plane's work
  int64_t work;   // the plane's work W_r
};
// Called by one full warp: plane `plane`'s work, and the first request (in order) for which
// hit(q_begin, q_end, work0, its work in the plane) holds.
template <typename T, typename Hit>
__device__ __forceinline__ BalancedWork scan_work(const VerifyParams<T>& p, int lane, int plane, Hit hit) {
  BalancedWork w{kNoWork, 0, 0, 0, 0, 0, 0, 0};
  int64_t work_base = 0;
  bool bad = false;
  for (int b0 = 0; b0 < p.batch; b0 += 32) {
    const int b = b0 + lane;
    int64_t q0 = 0, q1 = 0, k0 = 0;
    int units = 0, chunks = 0, keys = 0;
    if (b < p.batch) {
      q0 = p.qo_indptr[b];
      q1 = p.qo_indptr[b + 1];
      k0 = p.kv_indptr[b];
      const int64_t k1 = p.kv_indptr[b + 1];
      bad |= request_malformed(p, b, q0, q1, k0, k1);
      if (!bad) {
        const int nodes = static_cast<int>(q1 - q0);
        const int tiles = (nodes * p.heads + p.tile_rows - 1) / p.tile_rows;
        units = plane < p.planes - 1 ? (plane < tiles ? 1 : 0) : max(tiles - plane, 0);
        keys = static_cast<int>(k1 - k0) + nodes;
        chunks = (keys + kChunkKeys - 1) / kChunkKeys;
      }
    }
    const int64_t work = static_cast<int64_t>(units) * chunks;
    const int64_t work_incl = warp_inclusive_scan(work);
    const int64_t work0 = work_base + work_incl - work;
    const unsigned who = __ballot_sync(0xffffffffu, b < p.batch && !bad && hit(q0, q1, work0, work));
    if (who && w.b == kNoWork) {
      const int src = __ffs(who) - 1;
      w.b = __shfl_sync(0xffffffffu, b, src);
      w.chunks = __shfl_sync(0xffffffffu, chunks, src);
      w.keys = __shfl_sync(0xffffffffu, keys, src);
      w.nodes = __shfl_sync(0xffffffffu, static_cast<int>(q1 - q0), src);
      w.q_begin = __shfl_sync(0xffffffffu, static_cast<int>(q0), src);
      w.kv_begin = __shfl_sync(0xffffffffu, static_cast<int>(k0), src);
      w.work0 = __shfl_sync(0xffffffffu, work0, src);
    }
    work_base += __shfl_sync(0xffffffffu, work_incl, 31);
  }
  w.work = work_base;
  if (__any_sync(0xffffffffu, bad)) w.b = kMalformedBatch;
  return w;
}
// The first chunk of CTA c's share, and the CTA whose share holds chunk x (shares may be
// empty where W_r < G; the last CTA whose share starts at or before x).
__device__ __forceinline__ int64_t share_begin(int64_t work, int ctas, int c) { return c * work / ctas; }
__device__ __forceinline__ int share_of(int64_t work, int ctas, int64_t x) {
  return static_cast<int>(((x + 1) * ctas + work - 1) / work) - 1;
}
// The first partial row of CTA c of plane r: that of its share's first segment, or + tile
// rows that of its last.
template <typename T> __device__ __forceinline__ int64_t share_partial(const VerifyParams<T>& p, int plane, int c, bool last) {
  return ((static_cast<int64_t>(plane) * p.balanced + c) * 2 + last) * p.tile_rows;
}

// A run of one CTA's work: rows [row0, row0 + tile rows) of request b and its keys
// [key_begin, key_end) (prefix slots, then tree nodes), n_chunks 128-key chunks; the output if
// `direct`, else partial rows part + r. A CTA has one segment (its split of one request) or,
// under the balanced schedule, one or more.
struct Segment {
  int b, row0, q_begin, rows_b, kv_begin, prefix, key_begin, key_end, n_chunks;
  bool direct;
  int64_t part;
  int64_t next;  // balanced: the next segment's first chunk (a bad batch: its row tile)
};
// Called by one full warp under the balanced schedule: this CTA's segment after `prev`
// (null: its first), b = kNoWork past its share. A malformed batch has each CTA write NaN
// rows straight out, row tiles blockIdx.x G + blockIdx.y, + G planes, ...
template <typename T>
__device__ __forceinline__ Segment balanced_segment(const VerifyParams<T>& p, int lane, const Segment* prev) {
  const int c = blockIdx.y, plane = blockIdx.x, ctas = p.balanced;
  Segment s{};
  s.b = kNoWork;
  auto bad_batch_tile = [&](int64_t tile) {
    if (tile * p.tile_rows < p.rows_total) {
      s.b = kMalformedBatch;
      s.row0 = static_cast<int>(tile * p.tile_rows);
      s.rows_b = static_cast<int>(p.rows_total);
      s.direct = true;
      s.next = tile + static_cast<int64_t>(ctas) * p.planes;
    }
    return s;
  };
  if (prev && prev->b == kMalformedBatch) return bad_batch_tile(prev->next);
  int64_t pos = prev ? prev->next : -1;
  auto at_pos = [&](int64_t, int64_t, int64_t work0, int64_t work) { return pos >= work0 && pos < work0 + work; };
  BalancedWork w = scan_work(p, lane, plane, at_pos);
  if (w.b == kMalformedBatch) return bad_batch_tile(static_cast<int64_t>(plane) * ctas + c);
  if (!prev) {
    pos = share_begin(w.work, ctas, c);
    w = scan_work(p, lane, plane, at_pos);
  }
  const int64_t end = share_begin(w.work, ctas, c + 1);
  if (pos >= end || w.b < 0) return s;
  const int unit = static_cast<int>((pos - w.work0) / w.chunks);  // of this request's in the plane
  const int64_t unit_start = w.work0 + static_cast<int64_t>(unit) * w.chunks;
  const int c0 = static_cast<int>(pos - unit_start);
  const int c1 = static_cast<int>(min(end - unit_start, static_cast<int64_t>(w.chunks)));
  s.b = w.b;
  s.row0 = (plane + unit) * p.tile_rows;
  s.q_begin = w.q_begin;
  s.rows_b = w.nodes * p.heads;
  s.kv_begin = w.kv_begin;
  s.prefix = w.keys - w.nodes;
  s.key_begin = c0 * kChunkKeys;
  s.key_end = min(c1 * kChunkKeys, w.keys);
  s.n_chunks = c1 - c0;
  s.direct = c0 == 0 && c1 == w.chunks;
  s.part = share_partial(p, plane, c, prev != nullptr);
  s.next = unit_start + c1;
  return s;
}

// Split `split` of row tile row0 of request b: an equal, 128-key (chunk) aligned share of its
// keys (the equal-split schedule of the Hopper kernels).
template <typename T>
__device__ __forceinline__ Segment split_segment(const VerifyParams<T>& p, int b, int row0, int split) {
  Segment c{};
  c.b = b;
  c.row0 = row0;
  c.direct = p.splits == 1;
  if (b == kNoWork) return c;  // a tile past the work: the CTA returns (and reads no indptr)
  if (b == kMalformedBatch) {  // rows to write NaN, no keys (find_row_tile)
    c.rows_b = static_cast<int>(p.rows_total);
    c.part = split * p.rows_total + row0;
    return c;
  }
  c.q_begin = static_cast<int>(p.qo_indptr[b]);
  const int nodes = static_cast<int>(p.qo_indptr[b + 1]) - c.q_begin;
  c.rows_b = nodes * p.heads;
  c.kv_begin = static_cast<int>(p.kv_indptr[b]);
  c.prefix = static_cast<int>(p.kv_indptr[b + 1]) - c.kv_begin;
  const int64_t total = static_cast<int64_t>(c.prefix) + nodes;
  const int64_t pairs = (total + kChunkKeys - 1) / kChunkKeys;
  const int64_t chunk = (pairs + p.splits - 1) / p.splits * kChunkKeys;
  const int64_t begin = split * chunk < total ? split * chunk : total;
  c.key_begin = static_cast<int>(begin);
  c.key_end = static_cast<int>(begin + chunk < total ? begin + chunk : total);
  c.n_chunks = (c.key_end - c.key_begin + kChunkKeys - 1) / kChunkKeys;
  c.part = split * p.rows_total + static_cast<int64_t>(c.q_begin) * p.heads + row0;
  return c;
}

// Called by one full warp: the CTA's first segment, under the balanced schedule or its equal
// split of the row tile (of Rows rows) blockIdx.x.
template <int Rows, bool Balanced, typename T>
__device__ __forceinline__ Segment first_segment(const VerifyParams<T>& p, int lane) {
  if constexpr (Balanced) {
    return balanced_segment(p, lane, nullptr);
  } else {
    int req, row0;
    find_row_tile<T, Rows>(p, blockIdx.x, lane, req, row0);
    return split_segment(p, req, row0, blockIdx.y);
  }
}

// What one CTA covers of request b: its rows, and its split of the prefix (an equal, 32-key
// aligned chunk; the last split also takes the tree's own keys), in 32-key tiles.
struct CtaSpan {
  int q_begin, nodes, rows_b, kv_begin, prefix, pre_begin, pre_end, pre_tiles, n_tiles;
};
template <typename T>
__device__ __forceinline__ CtaSpan cta_span(const VerifyParams<T>& p, int b, int split) {
  CtaSpan c{};
  if (b == kMalformedBatch) {
    c.rows_b = static_cast<int>(p.rows_total);
    return c;
  }
  c.q_begin = static_cast<int>(p.qo_indptr[b]);
  c.nodes = static_cast<int>(p.qo_indptr[b + 1]) - c.q_begin;
  c.rows_b = c.nodes * p.heads;
  c.kv_begin = static_cast<int>(p.kv_indptr[b]);
  c.prefix = static_cast<int>(p.kv_indptr[b + 1]) - c.kv_begin;
  const int chunk = ((c.prefix + p.splits - 1) / p.splits + kKeys - 1) / kKeys * kKeys;
  c.pre_begin = min(c.prefix, split * chunk);
  c.pre_end = min(c.prefix, c.pre_begin + chunk);
  c.pre_tiles = (c.pre_end - c.pre_begin + kKeys - 1) / kKeys;
  const bool has_tree = split == p.splits - 1;
  c.n_tiles = c.pre_tiles + (has_tree ? (c.nodes + kKeys - 1) / kKeys : 0);
  return c;
}

// f(std::true_type{}) or f(std::false_type{}) as `flag` says: a launcher's runtime choice
// turned into the template argument of the kernel instance it takes.
template <typename F> decltype(auto) with_flag(bool flag, F&& f) {
  return flag ? f(std::true_type{}) : f(std::false_type{});
}
// The slot index type of kv_indices (int32 or int64).
template <typename I32> using SlotIndex = std::conditional_t<I32::value, int32_t, int64_t>;

// The kernel that serves verify_attn on grid (row tiles, splits).
enum class VerifyKernel {
  kPortable,  // verify_attn.cu, mma.sync: every GPU but sm_90; on sm_90+ lets the split merge
              // start early (programmatic dependent launch)
  kWgmma,     // verify_attn_sm90.cu; the merge an ordinary launch behind it
  kSeesaw,    // verify_attn_sm90_seesaw.cu; lets the split merge start early, as kPortable
  kFp8,       // verify_attn_sm90_fp8.cu: fp8 pools, in kFp8CtaRows-row CTAs; the merge as kSeesaw
};
// Rows per CTA of the kFp8 kernel (its wgmma N).
constexpr int kFp8CtaRows = 48;

// kSeesaw (over an fp8 pool kFp8 where KDTREE_VERIFY_FP8_KERNEL=1) when the current device
// is sm_90 and this build carries its sm_90a code, unless
// KDTREE_VERIFY_WGMMA=0 (kPortable) or KDTREE_VERIFY_SEESAW=0 (kWgmma); the seesaw kernel
// takes a positive, finite scale only (kWgmma otherwise). Over an fp8 pool kPortable instead
// of kWgmma (no fp8 path there) and for requests the portable kernel gives 16-row CTAs
// (fp8_small_rows). Read at every call.
VerifyKernel pick_verify_kernel(double sm_scale, bool fp8, bool fp8_small_rows);

// Launches the wgmma or the seesaw kernel (not kPortable). boxes: the seesaw kernel may load
// a 16-bit pool's consecutive slots as tensor-map boxes (the instance with the boxed producer).
template <typename T>
void launch_verify_attn_sm90(VerifyKernel kernel, const VerifyParams<T>& p, bool idx32, bool boxes, dim3 grid,
                             cudaStream_t stream);
template <typename T>
void launch_verify_attn_seesaw(const VerifyParams<T>& p, bool idx32, bool boxes, dim3 grid, cudaStream_t stream);
template <typename T>
void launch_verify_attn_fp8(const VerifyParams<T>& p, bool idx32, dim3 grid, cudaStream_t stream);
// The widened route for an fp8 pool (sm_90a): every prefix row of the batch (kv_indices
// position i) as f16 in the pool's units into ws row i, every tree row divided by k_scale into
// ws_tree, and req_bad[b] (zeroed by the caller) set for a request whose slots or tree rows the
// seesaw kernel's fp8 path would have met as bad. p describes the fp8 pool.
template <typename T>
void launch_widen_fp8_pool(const VerifyParams<T>& p, bool idx32, __half* ws, __half* ws_tree, int32_t* req_bad,
                           int sms, cudaStream_t stream);

}  // namespace kdtree
