// Hopper (sm_90a) tree-verify attention on wgmma: the work split, outputs and numerics of
// verify_attn.cu's kernel, which stays the path for every other GPU (sm_120 has no wgmma).
//
// CTA = 3 warpgroups over the same 64 (node, head) rows:
//  - WG0 computes S = Q K^T for a 32-key tile (wgmma m64n32k16, K from shared memory; Q's
//    first 384 dims from registers, loaded once, the rest from shared memory),
//    runs the online softmax and hands P and each row's rescale factor to the other two through
//    shared memory. S is double buffered: the next tile's product runs on the tensor cores
//    while this tile's softmax runs on the ALUs.
//  - WG1 and WG2 each own O[:, 256h, 256h + 256): 64 x 256 fp32 = 128 accumulators per thread
//    (all 512 dims in one warpgroup would not fit 255 registers). O += P V is wgmma m64n256k16
//    with V read transposed out of the same K tile. They also gather the K rows: page size 1
//    leaves 1,152 contiguous bytes per key, so 16-byte cp.async per row rather than TMA. Each
//    writes only the 64-dim column blocks its own P V reads (WG1 also the 64 rope dims), so a
//    block is refilled as soon as its one reader is done, with no handshake between the two.
// Shared memory (227 KB on sm_90): Q 72 KB + 4 K stages x 36 KB + 2 P buffers x 4 KB, rows
// stored as 128-byte-swizzled 64-dim column blocks (64-byte for P), the layouts wgmma reads
// without bank conflicts. Tiles stay 32 keys wide: 64-key stages would leave room for two, too
// few to cover the gather latency.
#include "verify_attn.cuh"
#include "verify_attn_sm90.cuh"

#include <cmath>

namespace kdtree {
namespace {

constexpr int kStages = 4;
constexpr int kWgThreads = 128, kThreads = 3 * kWgThreads;
constexpr int kColBlocks = kDqk / 64;  // 64-dim (128-byte) column blocks per row
constexpr int kQBlockBytes = kRows * 128, kKBlockBytes = kKeys * 128;
constexpr int kStageBytes = kColBlocks * kKBlockBytes;
constexpr int kPBytes = kRows * kKeys * 2;
constexpr int kOffK = kColBlocks * kQBlockBytes;
constexpr int kOffP = kOffK + kStages * kStageBytes;
constexpr int kOffScale = kOffP + 2 * kPBytes;       // [2][kRows] rescale factor per P buffer
constexpr int kOffStat = kOffScale + 2 * kRows * 4;  // [kRows] row max, then [kRows] row sum
constexpr int kOffBar = kOffStat + 2 * kRows * 4;    // mbarriers: K stage full x 4, Q full
constexpr int kOffTile = kOffBar + 8 * (kStages + 1);
// The dynamic shared window is only 16-byte aligned; swizzled blocks need 1024.
constexpr int kSmemBytes = kOffTile + 8 + 1024;
static_assert(kSmemBytes <= 227 * 1024, "must fit sm_90's 227 KB per block");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KD_SM90A 1

constexpr int kChunks = kDqk / 8;  // 16-byte chunks per row
// Q K^T steps (16 dims each, of 36) whose Q operand WG0 keeps in registers, 4 per step: 24 is
// the most that fits the 168-register budget without spills; the last 12 read Q from shared
// memory. (ptxas allocates one budget for all warpgroups, so setmaxnreg would not help.)
constexpr int kQRegSteps = 24;
// Named barriers (0 is __syncthreads): P buffer b full (+b), P buffer b empty (+b), row stats,
// the loaders' bad-slot OR.
constexpr int kBarPFull = 1, kBarPEmpty = 3, kBarStats = 5, kBarLoaded = 6;

#define KD_WGMMA_M64N32(TY)                                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " KD_REGS16                 \
               "%16, %17, p, 1, 1, 0, 0;\n}\n"                                                       \
               : KD_ACC8(0), KD_ACC8(8)                                                              \
               : "l"(a), "l"(b), "n"(int(ScaleD)))
// A from registers: the four 32-bit A fragments, then B's descriptor.
#define KD_WGMMA_M64N32_RS(TY)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " KD_REGS16                 \
               "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"                                         \
               : KD_ACC8(0), KD_ACC8(8)                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(int(ScaleD)))

#define KD_WGMMA_M64N256(TY)                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                         \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " KD_REGS128               \
               "%128, %129, p, 1, 1, 0, 1;\n}\n"                                                     \
               : KD_ACC32(0), KD_ACC32(32), KD_ACC32(64), KD_ACC32(96)                               \
               : "l"(a), "l"(b), "n"(int(ScaleD)))
// S (+)= Q K^T over 16 dims: A and B K-major.
template <typename T, bool ScaleD>
__device__ __forceinline__ void wgmma_qk(float (&d)[16], uint64_t a, uint64_t b) {
  KD_WGMMA_OF(T, KD_WGMMA_M64N32);
}
// The same with Q's 16 dims from registers (mma m16n8k16 A-fragment layout per warp): only
// K is read from shared memory.
template <typename T, bool ScaleD>
__device__ __forceinline__ void wgmma_qk_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  KD_WGMMA_OF(T, KD_WGMMA_M64N32_RS);
}
// O += P V over 16 keys: P K-major, V MN-major (the transpose bit).
template <typename T, bool ScaleD = true>
__device__ __forceinline__ void wgmma_pv(float (&d)[128], uint64_t a, uint64_t b) {
  KD_WGMMA_OF(T, KD_WGMMA_M64N256);
}
#undef KD_WGMMA_M64N32
#undef KD_WGMMA_M64N32_RS
#undef KD_WGMMA_M64N256

#endif  // sm_90a

template <typename T, typename Idx>
__global__ void __launch_bounds__(kThreads, 1) verify_attn_sm90_kernel(const VerifyParams<T> p) {
#ifdef KD_SM90A
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t s_base = smem_addr(smem);
  const uint32_t sQ = s_base, sK = s_base + kOffK, sP = s_base + kOffP;
  float* s_scale = reinterpret_cast<float*>(smem + kOffScale);
  float* s_max = reinterpret_cast<float*>(smem + kOffStat);
  float* s_sum = s_max + kRows;
  const uint32_t bar_full = s_base + kOffBar, bar_q = bar_full + 8 * kStages;
  int* s_tile = reinterpret_cast<int*>(smem + kOffTile);

  const int tid = threadIdx.x, wg = tid / kWgThreads, lt = tid % kWgThreads;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  // This thread's two rows in every m64 accumulator (and P row it writes or reads).
  const int rA = (lt >> 5) * 16 + g, rB = rA + 8;

  if (tid < 32) {
    int req, row0;
    find_row_tile(p, blockIdx.x, lane, req, row0);
    if (lane == 0) {
      s_tile[0] = req;
      s_tile[1] = row0;
    }
  }
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bar_full + 8 * s, 2 * kWgThreads);
    mbar_init(bar_q, kThreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int b = s_tile[0], row0 = s_tile[1];
  if (b == kNoWork) return;

  const int split = blockIdx.y;
  const auto [q_begin, nodes, rows_b, kv_begin, prefix, pre_begin, pre_end, pre_tiles, n_tiles] = cta_span(p, b, split);
  const bool direct = p.splits == 1;

  // ---- Q: every thread copies 16-byte chunks, consecutive threads along a row ----
  for (int i = tid; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i - r * kChunks, m = row0 + r;
    const T* src = p.kv;
    if (m < rows_b) {
      const int node = m / p.heads, head = m - node * p.heads;
      src = p.q + (q_begin + node) * p.q_st + head * p.q_sh + c * 8;
    }
    cp_async16(sQ + (c >> 3) * kQBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4), src, m < rows_b);
  }
  cp_async_arrive(bar_q);

  if (wg == 0) {
    // ================= WG0: S = Q K^T, online softmax, P =================
    const int mA = row0 + rA, mB = row0 + rB;
    const int nodeA = mA < rows_b ? mA / p.heads : 0, nodeB = mB < rows_b ? mB / p.heads : 0;
    const int32_t* maskA = p.mask ? p.mask + (q_begin + nodeA) * p.mask_stride : nullptr;
    const int32_t* maskB = p.mask ? p.mask + (q_begin + nodeB) * p.mask_stride : nullptr;
    auto visible = [&](const int32_t* mrow, int node, int key) {
      return mrow ? (key >> 5) < p.mask_words && ((mrow[key >> 5] >> (key & 31)) & 1) : key <= node;
    };
    // Running max (log2 domain) and sum of rows rA, rB; every lane of a quad holds them.
    float maxA = -INFINITY, maxB = -INFINITY, sumA = 0.f, sumB = 0.f;
    const uint64_t q_desc = make_desc(sQ, 16, 1024, 1);
    const uint64_t k_desc = make_desc(sK, 16, 1024, 1);

    // K-major 128-byte swizzle: a 16-dim step is +32 B inside a 64-dim block, then the next block.
    uint32_t q_reg[kQRegSteps][4];
    auto issue_qk = [&](float (&acc)[16], int stage) {
      const uint64_t kd = k_desc + ((stage * kStageBytes) >> 4);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kDqk / 16; ++ks) {
        const uint64_t kd_ks = kd + (((ks >> 2) * kKBlockBytes + (ks & 3) * 32) >> 4);
        if (ks < kQRegSteps) {
          if (ks == 0) wgmma_qk_rs<T, false>(acc, q_reg[0], kd_ks);
          else wgmma_qk_rs<T, true>(acc, q_reg[ks], kd_ks);
        } else {
          const uint64_t qd = q_desc + (((ks >> 2) * kQBlockBytes + (ks & 3) * 32) >> 4);
          if (ks == 0) wgmma_qk<T, false>(acc, qd, kd_ks);
          else wgmma_qk<T, true>(acc, qd, kd_ks);
        }
      }
      wgmma_commit();
    };

    auto softmax = [&](int t, float (&s)[16]) {
      const bool tree_tile = t >= pre_tiles;
      const int key0 = tree_tile ? (t - pre_tiles) * kKeys : pre_begin + t * kKeys;
      const int key_end = tree_tile ? nodes : pre_end;
      float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + j * 8 + t4 * 2 + e;
          float xa = s[4 * j + e] * p.scale_log2, xb = s[4 * j + 2 + e] * p.scale_log2;
          if (key >= key_end) xa = xb = -INFINITY;
          if (tree_tile) {  // the ancestor mask (or the causal chain) applies to tree keys only
            if (!visible(maskA, nodeA, key)) xa = -INFINITY;
            if (!visible(maskB, nodeB, key)) xb = -INFINITY;
          }
          s[4 * j + e] = xa;
          s[4 * j + 2 + e] = xb;
          mxA = fmaxf(mxA, xa);
          mxB = fmaxf(mxB, xb);
        }
      mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
      mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
      mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
      mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
      // -inf - -inf is NaN: a first visible max always counts as a move.
      auto rescale = [](float& run_max, float mx) {
        const bool moved = mx > run_max + kRescaleSlack || (run_max == -INFINITY && mx > -INFINITY);
        const float alpha = moved ? fast_exp2(run_max - mx) : 1.f;
        if (moved) run_max = mx;
        return alpha;
      };
      const float alphaA = rescale(maxA, mxA), alphaB = rescale(maxB, mxB);
      // A row with nothing visible yet keeps max -inf; subtract 0 then so exp gives 0.
      const float baseA = maxA == -INFINITY ? 0.f : maxA, baseB = maxB == -INFINITY ? 0.f : maxB;
      float lA = 0.f, lB = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[4 * j + e] = fast_exp2(s[4 * j + e] - baseA);
          s[4 * j + 2 + e] = fast_exp2(s[4 * j + 2 + e] - baseB);
          lA += s[4 * j + e];
          lB += s[4 * j + 2 + e];
        }
      lA += __shfl_xor_sync(0xffffffffu, lA, 1);
      lB += __shfl_xor_sync(0xffffffffu, lB, 1);
      lA += __shfl_xor_sync(0xffffffffu, lA, 2);
      lB += __shfl_xor_sync(0xffffffffu, lB, 2);
      sumA = sumA * alphaA + lA;
      sumB = sumB * alphaB + lB;

      // P buffer t % 2 was last read by the P V of tile t - 2.
      const int pb = t & 1;
      if (t >= 2) named_sync(kBarPEmpty + pb, kThreads);
      // K-major, 64-byte swizzle: row r is 64 B, its 16-byte chunk j sits at j ^ ((r >> 1) & 3).
      uint8_t* pbuf = smem + kOffP + pb * kPBytes + t4 * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<uint32_t*>(pbuf + rA * 64 + ((j ^ ((rA >> 1) & 3)) << 4)) = pack2<T>(s[4 * j], s[4 * j + 1]);
        *reinterpret_cast<uint32_t*>(pbuf + rB * 64 + ((j ^ ((rB >> 1) & 3)) << 4)) = pack2<T>(s[4 * j + 2], s[4 * j + 3]);
      }
      if (t4 == 0) {
        s_scale[pb * kRows + rA] = alphaA;
        s_scale[pb * kRows + rB] = alphaB;
      }
      fence_proxy_async();
      named_arrive(kBarPFull + pb, kThreads);
    };

    // Tile t: start the product of tile t + 1, then finish tile t while it runs. Past the end
    // the product reads a stale stage and is dropped: every wgmma stays unconditional, which
    // ptxas needs to keep them asynchronous.
    auto step = [&](int t, float (&cur)[16], float (&nxt)[16]) {
      const int u = t + 1;
      if (u < n_tiles) mbar_wait(bar_full + 8 * (u % kStages), (u / kStages) & 1);
      fence_proxy_async();
      issue_qk(nxt, u % kStages);
      wgmma_wait<1>();
      fence_regs(cur);
      if (t < n_tiles) softmax(t, cur);
    };

    mbar_wait(bar_q, 0);
    // Q's first kQRegSteps 16-dim steps into registers: K^T is then the only operand Q K^T
    // streams from shared memory there (an m64n32 step reads 2 KB of Q to 1 KB of K).
    {
      const int mi = lane >> 3, row = (lt >> 5) * 16 + (lane & 7) + (mi & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < kQRegSteps; ++ks) {
        const int chunk = (ks & 3) * 2 + (mi >> 1);
        const uint32_t addr = sQ + (ks >> 2) * kQBlockBytes + row * 128 + ((chunk ^ (row & 7)) << 4);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(q_reg[ks][0]), "=r"(q_reg[ks][1]), "=r"(q_reg[ks][2]), "=r"(q_reg[ks][3])
                     : "r"(addr));
      }
    }
    if (n_tiles > 0) {
      float s0[16], s1[16];
      mbar_wait(bar_full, 0);
      fence_proxy_async();
      issue_qk(s0, 0);
      // Two tiles per trip so S buffers swap statically; no wgmma may stay in flight across
      // the back edge (ptxas would serialize them all).
#pragma unroll 1
      for (int t = 0; t < n_tiles; t += 2) {
        step(t, s0, s1);
        step(t + 1, s1, s0);
        wgmma_wait<0>();
      }
    }

    if (t4 == 0) {
      s_max[rA] = maxA;
      s_sum[rA] = sumA;
      s_max[rB] = maxB;
      s_sum[rB] = sumB;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = half ? mB : mA;
        if (m >= rows_b) continue;
        const float l = half ? sumB : sumA, mx = half ? maxB : maxA;
        const float lse = l > 0.f ? (mx + __log2f(l)) * 0.69314718055994531f : -INFINITY;
        const int node = m / p.heads, head = m - node * p.heads;
        if (direct)
          p.lse[(q_begin + node) * p.lse_st + head * p.lse_sh] = lse;
        else
          p.part_lse[split * p.rows_total + static_cast<int64_t>(q_begin) * p.heads + m] = lse;
      }
    }
    named_arrive(kBarStats, kThreads);
  } else {
    // ================= WG1, WG2: K gathers, O[:, 256h, +256) += P V =================
    const int h = wg - 1;
    const Idx* kv_indices = static_cast<const Idx*>(p.kv_indices) + kv_begin;
    bool bad = false;  // met a prefix slot outside kv_cache (checked_slot)
    // Loader lanes: rows lr and lr + 16 of a tile, chunk lc of each of this warpgroup's blocks.
    const int lr = lt >> 3, lc = lt & 7;
    const uint32_t ld_off = lr * 128 + ((lc ^ (lr & 7)) << 4);  // (lr + 16) & 7 == lr & 7
    auto slot_of = [&](int u, int r) -> Idx {  // as loaded; -1 (unused) past this split's prefix keys
      const int pos = pre_begin + u * kKeys + r;
      return u < pre_tiles && pos < pre_end ? __ldg(kv_indices + pos) : Idx(-1);
    };
    auto row_src = [&](int u, int r, Idx slot) -> const T* {
      if (u < pre_tiles) {  // checked here, where the load has landed, not where it is issued
        const int pos = pre_begin + u * kKeys + r;
        return pos < pre_end ? p.kv + static_cast<int64_t>(checked_slot(p, slot, bad)) * p.kv_stride : nullptr;
      }
      const int key = (u - pre_tiles) * kKeys + r;
      return key < nodes ? p.tree_k + static_cast<int64_t>(q_begin + key) * p.tk_stride : nullptr;
    };
    auto load_tile = [&](int u, Idx slot0, Idx slot1) {
      const uint32_t dst = sK + (u % kStages) * kStageBytes + ld_off;
      const T* src0 = row_src(u, lr, slot0);
      const T* src1 = row_src(u, lr + 16, slot1);
      auto copy_block = [&](int cb) {
        cp_async16(dst + cb * kKBlockBytes, src0 ? src0 + cb * 64 + lc * 8 : p.kv, src0 != nullptr);
        cp_async16(dst + cb * kKBlockBytes + 16 * 128, src1 ? src1 + cb * 64 + lc * 8 : p.kv, src1 != nullptr);
      };
#pragma unroll
      for (int i = 0; i < 4; ++i) copy_block(h * 4 + i);
      if (h == 0) copy_block(kColBlocks - 1);
      cp_async_arrive(bar_full + 8 * (u % kStages));
    };

    for (int u = 0; u < kStages && u < n_tiles; ++u) load_tile(u, slot_of(u, lr), slot_of(u, lr + 16));

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const uint64_t p_desc = make_desc(sP, 16, 512, 2);
    // V = the K stage read MN-major: 64-dim blocks kKBlockBytes apart, 8-key groups 1 KB apart.
    const uint64_t v_desc = make_desc(sK + h * 4 * kKBlockBytes, kKBlockBytes, 1024, 1);
#pragma unroll 1
    for (int t = 0; t < n_tiles; ++t) {
      const int u = t + kStages;
      const Idx next0 = slot_of(u, lr), next1 = slot_of(u, lr + 16);  // loads in flight meanwhile
      const int pb = t & 1;
      named_sync(kBarPFull + pb, kThreads);
      const float aA = s_scale[pb * kRows + rA], aB = s_scale[pb * kRows + rB];
      if (aA != 1.f || aB != 1.f) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j] *= aA;
          o[4 * j + 1] *= aA;
          o[4 * j + 2] *= aB;
          o[4 * j + 3] *= aB;
        }
      }
      const uint64_t vd = v_desc + (((t % kStages) * kStageBytes) >> 4);
      const uint64_t pd = p_desc + ((pb * kPBytes) >> 4);
      wgmma_fence();
      wgmma_pv<T>(o, pd, vd);
      wgmma_pv<T>(o, pd + (32 >> 4), vd + ((16 * 128) >> 4));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      if (t + 2 < n_tiles) named_arrive(kBarPEmpty + pb, kThreads);
      if (u < n_tiles) load_tile(u, next0, next1);
    }

    named_sync(kBarStats, kThreads);
    // Whether either loading warpgroup met a slot outside kv_cache; WG0's lse is written by now
    // (kBarStats), so a bad CTA's NaN lse lands after it.
    const bool malformed = s_tile[0] == kMalformedBatch;  // rows to write NaN, no keys (find_row_tile)
    const bool bad_cta = named_sync_or(kBarLoaded, 2 * kWgThreads, bad) || malformed;
    if (bad_cta && h == 0 && lt == 0) raise_guard(p.guard, malformed ? kGuardVerifyIndptr : kGuardKvSlot);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half ? rB : rA, m = row0 + r;
      if (m >= rows_b) continue;
      const float l = s_sum[r];
      const float inv = bad_cta ? kNaN : l > 0.f ? 1.f / l : 0.f;
      const int node = m / p.heads, head = m - node * p.heads;
      if (bad_cta && h == 0 && t4 == 0) {
        if (direct)
          p.lse[(q_begin + node) * p.lse_st + head * p.lse_sh] = kNaN;
        else
          p.part_lse[split * p.rows_total + static_cast<int64_t>(q_begin) * p.heads + m] = kNaN;
      }
      if (direct) {
        T* dst = p.out + (q_begin + node) * p.out_st + head * p.out_sh + h * 256 + t4 * 2;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<T>(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
      } else {
        const int64_t grow = static_cast<int64_t>(q_begin) * p.heads + m;
        float* dst = p.part_o + (split * p.rows_total + grow) * kDv + h * 256 + t4 * 2;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
      }
    }
  }
#else
  __trap();
#endif
}

// Whether the current device runs the sm_90a kernels: an sm_90 GPU, and code built for
// sm_90a (kdtree_ops builds 9.0 as sm_90a) rather than JIT-compiled from older PTX, which
// would hold only the trap.
bool sm90_ready() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const DeviceFacts device = device_facts(dev);
  if (device.major != 9 || device.minor != 0) return false;
  static const bool built = [] {
    cudaFuncAttributes a{};
    if (cudaFuncGetAttributes(&a, verify_attn_sm90_kernel<__nv_bfloat16, int32_t>) != cudaSuccess) {
      (void)cudaGetLastError();  // no image for this device: not an error of the caller's
      return false;
    }
    return a.binaryVersion == 90 && a.ptxVersion >= 90;
  }();
  return built;
}

}  // namespace

VerifyKernel pick_verify_kernel(double sm_scale, bool fp8, bool fp8_small_rows) {
  if (!env_flag("KDTREE_VERIFY_WGMMA", true) || !sm90_ready()) return VerifyKernel::kPortable;
  // The seesaw kernel scales row maxima instead of every score: that needs a positive,
  // finite scale in the float the kernel gets.
  const float scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);
  if (!env_flag("KDTREE_VERIFY_SEESAW", true) || !(scale_log2 > 0.f) || !std::isfinite(scale_log2)) {
    return fp8 ? VerifyKernel::kPortable : VerifyKernel::kWgmma;  // no fp8 path in the wgmma kernel
  }
  // Over an fp8 pool, requests the portable kernel gives 16-row CTAs run faster there than on
  // the seesaw kernel's 64-row tiles, which pad them fourfold and widen every row for a
  // quarter of the work (H200: 64x16x1 @8k 0.162 against 0.230 ms, 16x8x1 @32k 0.172 against
  // 0.230). Over a bf16 pool the seesaw kernel stays ahead or even (0.185 against 0.185, 0.176
  // against 0.188).
  if (fp8_small_rows) return VerifyKernel::kPortable;
  // The keys-as-M fp8 kernel is opt-in: on an H200 it is still slower than the seesaw
  // kernel's fp8 path on most shapes (BENCHMARKS.md).
  return fp8 && env_flag("KDTREE_VERIFY_FP8_KERNEL", false) ? VerifyKernel::kFp8 : VerifyKernel::kSeesaw;
}

template <typename T>
void launch_verify_attn_sm90(VerifyKernel which, const VerifyParams<T>& p, bool idx32, bool boxes, dim3 grid,
                             cudaStream_t stream) {
  if (which == VerifyKernel::kSeesaw) {
    launch_verify_attn_seesaw(p, idx32, boxes, grid, stream);
    return;
  }
  if (which == VerifyKernel::kFp8) {
    launch_verify_attn_fp8(p, idx32, grid, stream);
    return;
  }
  auto kernel = idx32 ? verify_attn_sm90_kernel<T, int32_t> : verify_attn_sm90_kernel<T, int64_t>;
  allow_dynamic_smem(kernel, kSmemBytes);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_verify_attn_sm90<__nv_bfloat16>(VerifyKernel, const VerifyParams<__nv_bfloat16>&, bool, bool, dim3,
                                                     cudaStream_t);
template void launch_verify_attn_sm90<__half>(VerifyKernel, const VerifyParams<__half>&, bool, bool, dim3, cudaStream_t);

}  // namespace kdtree
