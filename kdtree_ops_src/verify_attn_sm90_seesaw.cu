// Hopper (sm_90a) tree-verify attention with the "seesaw" schedule. Same rows per CTA as the
// other kernels (64 (node, head) rows of one request), same outputs and split merge; keys in
// 64-key tiles taken two at a time.
//
// CTA = 3 warpgroups:
//  - WG2, the producer (few registers): gathers Q, then the keys' 1,152-byte rows by slot index
//    with 16-byte cp.async into two K buffers, each in two halves (dims 0-255; dims 256-575)
//    with their own ready/free mbarriers, so a half is refilled as soon as its last reader is
//    done. Slot indices are loaded a pair ahead of the rows they address, so no gather waits
//    on an index load. A 16-bit pool's tile of 64 consecutive slots (page size 1 does not
//    promise them, but paged pools and long prompts give them) lands as tensor-map boxes,
//    each 64-dim column block on a barrier of its own, which the consumers wait for block by
//    block. Where three or more row tiles of a request read the same keys, the first one's
//    CTA also asks L2 for the next pair's boxes (tensor-map prefetch), so that its CTAs meet
//    L2 rather than HBM (H100: 1x16x9 and 8x16x9 2-5% faster, 18 or more row tiles within
//    noise; with two row tiles, 64x128x1 @8k, 6-10% slower, so not there). An fp8 pool's
//    tile of 64 consecutive slots lands as boxes of e4m3 bytes, which the producer widens
//    before the half is ready (H100: 11-12% fewer cycles than its 16-byte copies). An fp8 pool
//    widened beforehand into an f16 workspace (launch_widen_fp8_pool: requests of 9 row tiles
//    and more) lands as a 16-bit pool does and is computed as an fp8 one.
//  - WG0 and WG1, the consumers: WG0 computes S = Q K^T for the even tile of each pair (K
//    buffer 0), WG1 for the odd tile (buffer 1), each with the full 64 x 64 x 576 product.
//    WG0 owns O[:, 0:256), WG1 O[:, 256:512). Each runs the softmax of its own tile and
//    multiplies its P into its own O half from registers (wgmma RS) and, through shared
//    memory, into the other's half (wgmma SS): while one runs its softmax on the ALUs the
//    tensor cores run the other's products. The running max goes WG0 -> WG1 -> WG0 through
//    shared memory; WG0 rescales its P and O once WG1 has seen the odd tile.
// Keys: request b's keys are its prefix slots followed by its tree nodes; a CTA takes an
// equal, 128-key aligned share of them (its prefix split), or under the balanced schedule its
// share of the whole batch's, one segment after another. Only a tile that reaches the tree
// (or the end) runs mask code; every prefix tile is unmasked. An odd tile count leaves the
// last pair's odd tile past the end: zero-filled and fully masked.
// Shared memory (226 KB): Q 72 KB + 2 K buffers x 72 KB + P of the odd tile 8 KB; the even
// tile's P takes K buffer 0's rope block, dead once that tile's Q K^T is done.
#include "verify_attn.cuh"
#include "verify_attn_sm90.cuh"

#include <cuda.h>  // CUtensorMap; the encoder is fetched from the driver at run time
#include <cudaTypedefs.h>

#include <utility>  // declval

namespace kdtree {
namespace {

constexpr int kWgThreads = 128, kThreads = 3 * kWgThreads, kConsumers = 2 * kWgThreads;
constexpr int kCols = kDqk / 64;                 // 64-dim (128-byte) column blocks per row
constexpr int kBlockBytes = 64 * 128;            // one column block of 64 rows or 64 keys
constexpr int kTileBytes = kCols * kBlockBytes;  // Q, or one K buffer: 72 KB
constexpr int kOffK = kTileBytes;
constexpr int kOffS1 = kOffK + 2 * kTileBytes;
constexpr int kOffMax = kOffS1 + kBlockBytes;    // [64] running max, handed WG0 -> WG1 -> WG0
constexpr int kOffSum = kOffMax + kRows * 4;     // [2][64] each consumer's row sums
// mbarriers: Q full, K ready [buf][half], K free [buf][half], K landed [buf][half] (fp8 pools),
// K ready [buf][column block] (the boxable instance: a box lands, and is read, block by block)
constexpr int kOffBar = kOffSum + 2 * kRows * 4;
constexpr int kBars = 13 + 2 * kCols;
constexpr int kOffSeg = kOffBar + 8 * kBars;  // [2] Segment: this one and the next
constexpr int kSegBytes = 64;
// The dynamic shared window is only 16-byte aligned; swizzled blocks need 1024.
constexpr int kSmemBytes = kOffSeg + 2 * kSegBytes + 1024;
static_assert(kSmemBytes <= 227 * 1024, "must fit sm_90's 227 KB per block");
static_assert(kRows == 64, "one wgmma M tile of rows per CTA");
constexpr int kTileKeys = 64;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KD_SM90A 1

constexpr int kPairKeys = 2 * kTileKeys;

// setmaxnreg budgets: 2 x 128 x 224 + 128 x 56 of the 64K registers.
constexpr int kConsumerRegs = 224, kProducerRegs = 56;
// The first max of a row: finite, so that no -inf - -inf appears; below every real score.
constexpr float kMaxInit = -1e30f;
// The K mbarriers' addresses (the layout at kOffBar; bar_q = the first, Q full).
__device__ __forceinline__ uint32_t k_ready_bar(uint32_t bar_q, int buf, int half) { return bar_q + 8 * (1 + 2 * buf + half); }
__device__ __forceinline__ uint32_t k_free_bar(uint32_t bar_q, int buf, int half) { return bar_q + 8 * (5 + 2 * buf + half); }
__device__ __forceinline__ uint32_t k_block_bar(uint32_t bar_q, int buf, int cb) { return bar_q + 8 * (13 + kCols * buf + cb); }
// Named barriers between the two consumers (256 threads; 0 is __syncthreads).
constexpr int kBarMax0 = 1, kBarMax1 = 2, kBarP0 = 3, kBarP1 = 4, kBarSum = 5;
// The producer's last copy issued -> the consumers' epilogue, with whether it met a slot
// outside kv_cache (named_sync_or over all three warpgroups).
constexpr int kBarLoaded = 6;
// The producer warpgroup (128 threads) agreeing on whether a tile's slots run consecutively.
constexpr int kBarRun = 7;

#define KD_WGMMA_QK(TY)                                                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " KD_REGS32                 \
               "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                       \
               : KD_ACC32(0)                                                                         \
               : "l"(a), "l"(b), "n"(int(Accumulate)))
#define KD_WGMMA_PV_RS(TY)                                                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                            \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " KD_REGS128               \
               "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                                    \
               : KD_ACC32(0), KD_ACC32(32), KD_ACC32(64), KD_ACC32(96)                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
#define KD_WGMMA_PV_SS(TY)                                                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                            \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " KD_REGS128               \
               "%128, %129, p, 1, 1, 0, 1;\n}\n"                                                     \
               : KD_ACC32(0), KD_ACC32(32), KD_ACC32(64), KD_ACC32(96)                               \
               : "l"(a), "l"(b))

// S (+)= Q K^T over 16 dims: 64 rows x 64 keys, Q and K K-major.
template <typename T, bool Accumulate>
__device__ __forceinline__ void wgmma_qk(float (&d)[32], uint64_t a, uint64_t b) {
  KD_WGMMA_OF(T, KD_WGMMA_QK);
}
// O += P V over 16 keys, P from registers (the S accumulator layout is wgmma's A layout).
template <typename T>
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[128], const uint32_t* a, uint64_t b) {
  KD_WGMMA_OF(T, KD_WGMMA_PV_RS);
}
// O += P V over 16 keys, P from shared memory (the other consumer's tile).
template <typename T>
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[128], uint64_t a, uint64_t b) {
  KD_WGMMA_OF(T, KD_WGMMA_PV_SS);
}
#undef KD_WGMMA_QK
#undef KD_WGMMA_PV_RS
#undef KD_WGMMA_PV_SS

// S = Q K^T over column blocks [Cb0, Cb1) of K buffer `kbuf` (Zero: the batch's first op
// overwrites S). A 16-dim step is +32 B inside a 128-byte swizzled block, then the next block.
// wait_block(cb) runs before the products of every block after the first (which the caller
// has waited for).
template <typename T, int Cb0, int Cb1, bool Zero, typename WaitBlock>
__device__ __forceinline__ void issue_qk(float (&s)[32], uint32_t sQ, uint32_t kbuf, WaitBlock wait_block) {
  const uint64_t qd = make_desc(sQ, 16, 1024), kd = make_desc(kbuf, 16, 1024);
#pragma unroll
  for (int cb = Cb0; cb < Cb1; ++cb) {
    if (cb > Cb0) wait_block(cb);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t off = (cb * kBlockBytes + kk * 32) >> 4;
      if (Zero && cb == Cb0 && kk == 0) wgmma_qk<T, false>(s, qd + off, kd + off);
      else wgmma_qk<T, true>(s, qd + off, kd + off);
    }
  }
}
// O += P V for one 64-key tile: V = dims [256h, 256h + 256) of a K buffer, 16 keys (2 KB of
// 8-key groups) per step.
template <typename T>
__device__ __forceinline__ void issue_pv_rs(float (&o)[128], const uint32_t (&ps)[16], uint64_t vd) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_pv_rs<T>(o, ps + 4 * kk, vd + ((kk * 2048) >> 4));
}
template <typename T>
__device__ __forceinline__ void issue_pv_ss(float (&o)[128], uint32_t sP, uint64_t vd) {
  const uint64_t pd = make_desc(sP, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_pv_ss<T>(o, pd + ((kk * 32) >> 4), vd + ((kk * 2048) >> 4));
}
__device__ __forceinline__ uint64_t v_desc(uint32_t kbuf, int half) {
  return make_desc(kbuf + half * 4 * kBlockBytes, kBlockBytes, 1024);
}

static_assert(kChunkKeys == kPairKeys, "the balanced schedule's chunk is a tile pair");
static_assert(sizeof(Segment) <= kSegBytes && kOffSeg % alignof(Segment) == 0);

// Loads of K rows in 2D tensor-map boxes (cp.async.bulk.tensor) of 64 slots x 128 bytes (64
// dims of a 16-bit pool, 128 of an fp8 one), landing in the 128-byte swizzle the K buffers use,
// completing on `bar` by bytes.
__device__ __forceinline__ void mbar_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void box_load(uint32_t dst, const CUtensorMap* map, int dim, int slot, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(dim), "r"(slot), "r"(bar)
      : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// A request's prefix slots, key by key: a pointer into kv_indices, or over a widened pool a
// PositionSlots, which stands for the kv_indices positions themselves (launch_widen_fp8_pool
// put position i's row at workspace row i) and reads no index. load_slot reads any of them as
// an int32: the producer holds eight slots and the lead prefetch's edge slots in registers,
// which as 64-bit values spilled and kept the prefetch off over SGLang's int64 kv_indices. An
// int64 slot outside int32 becomes -1, which checked_slot finds bad as it would the slot itself
// (kv_cache has fewer than 2^31 rows: verify_attn_out refuses more).
struct PositionSlots {
  int32_t position;
  __device__ __forceinline__ PositionSlots operator+(int keys) const { return {position + keys}; }
  __device__ __forceinline__ PositionSlots operator-(int keys) const { return {position - keys}; }
};
__device__ __forceinline__ int32_t load_slot(const int32_t* at) { return __ldg(at); }
__device__ __forceinline__ int32_t load_slot(const int64_t* at) {
  const int64_t slot = __ldg(at);
  return static_cast<uint64_t>(slot) <= static_cast<uint64_t>(INT32_MAX) ? static_cast<int32_t>(slot) : -1;
}
__device__ __forceinline__ int32_t load_slot(PositionSlots at) { return at.position; }

// The producer over an fp8 pool (Fp8Math). Thread lt owns a row r of each tile and dims
// [16 hh, +16) and [32 + 16 hh, +16) (hh = 0 or 1) of each 64-dim column block: four 16-byte
// chunks of the swizzled K buffer, so that the two threads of a row copy whole 32-byte
// sectors of it. A prefix row's 16 e4m3 bytes of each pair of chunks land by cp.async in the
// second chunk and the same thread widens them in place to f16 once they are there, so no
// thread waits on another's copies and no barrier joins them; a tree row (T) lands in all
// four and the same thread turns it into f16 in the pool's units (divided by k_scale;
// `beyond` if that passes f16's range); a key past the end lands as zeros. A half is ready
// once it is converted.
// The producer polls two things and does whichever is possible: issue the next half's
// copies (its buffer freed) or widen the oldest half in flight (landed). Widening a half
// only after the next one's buffer is free would chain each odd tile's S to the even
// tile's P V and undo the seesaw.
// Boxed (kv_map set): a prefix tile whose 64 slots are consecutive rows of the pool lands as
// tensor-map boxes of 64 rows x 128 bytes (two column blocks' e4m3 bytes; the last box's second
// half is past the row, zeros), each in the first of its two column blocks with the K buffers'
// 128-byte swizzle: 5 instructions instead of 2,304 16-byte copies. Each warp widens 16 rows
// of a box into its two column blocks (see widen). Every warp votes on the tile's 64 slots by
// itself, so the warps agree without a barrier; in this loop the producer's polls are
// warp-uniform, so a warp stays converged for the widening's syncwarp.
template <bool Boxed, typename T, typename Slots, typename SlotOf>
__device__ __forceinline__ void produce_fp8(const VerifyParams<T>& p, const CUtensorMap* kv_map, uint32_t sK,
                                            uint8_t* k_smem, SlotOf slot_of, Slots slots, int q_begin,
                                            int prefix, int key_begin, int key_end, int n_pairs, uint32_t pair_base,
                                            int lt, uint32_t bar_q, bool& bad, bool& beyond) {
  // Lanes 0-7 of a warp: rows 8 w' .. 8 w' + 7 with hh = 0, lanes 8-15 the same rows with hh = 1
  // (w' = 2 warp + lane / 16): each 16-byte access phase of 8 lanes meets 8 distinct swizzled
  // chunks, and one copy instruction reads whole sectors.
  const int r = (lt & 7) + 8 * (lt >> 4), hh = (lt >> 3) & 1;
  const float tree_to_pool = 1.f / kv_scale(p);
  // ready [buf][half] at bars + 8 (2 buf + half); free 32 bytes further, landed 64
  const uint32_t bars = bar_q + 8;
  auto chunk = [&](int i) { return r * 128 + ((((i & 1) + 2 * hh + 4 * (i >> 1)) ^ (r & 7)) << 4); };
  auto key_of = [&](int pair, int tl) { return key_begin + pair * kPairKeys + tl * kTileKeys + r; };
  // The halves in the order the consumers read them (see the bf16 producer).
  // Half h of a pair: tile h % 2; dims 0-255 for h = 0, 3, dims 256-575 for h = 1, 2.
  auto tile_of = [](int h) { return h & 1; };
  auto half_of = [](int h) { return (h ^ (h >> 1)) & 1; };
  int32_t slot0 = slot_of(key_of(0, 0)), slot1 = slot_of(key_of(0, 1));  // scalars: no runtime-indexed array
  // Boxed: whether each tile of the pair has its 64 slots running consecutively inside the
  // pool; found as a tile's first half is issued and kept for its second half and both
  // widenings (a tile's next first half is issued only after both are ready). Thread 0, which
  // issues the boxes, holds row 0's slot: the run's first.
  bool run0 = false, run1 = false;
  const int unmasked_end = min(prefix, key_end);
  auto find_run = [&](int pr, int tl) {
    const int key0 = key_begin + pr * kPairKeys + tl * kTileKeys;
    if (key0 + kTileKeys > unmasked_end) return false;  // CTA-uniform
    // In L1: the rows' own slots were loaded from these lines half a pair ago.
    const int lane = lt & 31;
    const int32_t lo = load_slot(slots + key0 + lane), hi = load_slot(slots + key0 + 32 + lane);
    const int32_t first = __shfl_sync(0xffffffffu, lo, 0);
    const bool ok = first >= 0 && static_cast<uint64_t>(first) + kTileKeys <= static_cast<uint64_t>(p.kv_rows) &&
                    lo == first + lane && hi == first + 32 + lane;
    return __all_sync(0xffffffffu, ok) != 0;
  };
  auto issue = [&](int pr, int h) {
    const int tl = tile_of(h), cb0 = half_of(h) ? 4 : 0, cb1 = half_of(h) ? kCols : 4;
    const int key = key_of(pr, tl);
    const uint32_t base = sK + tl * kTileBytes;
    const uint32_t landed = bars + 64 + 8 * (2 * tl + half_of(h));
    if constexpr (Boxed) {
      if (h < 2) (tl ? run1 : run0) = find_run(pr, tl);
      if (tl ? run1 : run0) {
        if (lt == 0) {
          const int first = static_cast<int>(tl ? slot1 : slot0);
          mbar_expect_bytes(landed, (cb1 - cb0 + 1) / 2 * kBlockBytes);  // a box is a block's bytes
          for (int cb = cb0; cb < cb1; cb += 2) box_load(base + cb * kBlockBytes, kv_map, cb * 64, first, landed);
        } else {
          mbar_arrive(landed);
        }
        return;
      }
    }
    if (key < prefix && key < key_end) {
      const uint8_t* src = p.kv8 + static_cast<int64_t>(checked_slot(p, tl ? slot1 : slot0, bad)) * p.kv_stride + hh * 16;
#pragma unroll
      for (int cb = cb0; cb < cb1; ++cb) {
        cp_async16(base + cb * kBlockBytes + chunk(1), src + cb * 64, true);
        cp_async16(base + cb * kBlockBytes + chunk(3), src + cb * 64 + 32, true);
      }
    } else {
      const bool valid = key < key_end;
      const T* src = p.tree_k + (valid ? static_cast<int64_t>(q_begin + key - prefix) * p.tk_stride : 0) + hh * 16;
#pragma unroll
      for (int cb = cb0; cb < cb1; ++cb)
#pragma unroll
        for (int i = 0; i < 4; ++i) cp_async16(base + cb * kBlockBytes + chunk(i), src + cb * 64 + (i & 1) * 8 + (i >> 1) * 32, valid);
    }
    cp_async_arrive(landed);
  };
  auto widen = [&](int pr, int h) {
    const int tl = tile_of(h), cb0 = half_of(h) ? 4 : 0, cb1 = half_of(h) ? kCols : 4;
    const int key = key_of(pr, tl);
    uint8_t* base = k_smem + tl * kTileBytes;
    if (Boxed && (tl ? run1 : run0)) {
      // A box sits in column block cb (the first of its two): its 128 bytes of row `row` are 8
      // chunks, e4m3 dims 0-63 of the pair in chunks 0-3, 64-127 in 4-7. Lane part 0 takes
      // chunks 0-1 and 4-5 of the row, part 1 chunks 2-3 and 6-7. Chunks 4-7 are widened first,
      // into block cb + 1 (free); then chunks 0-3 in place, after the warp's syncwarp: the
      // in-place stores of part 1 overwrite chunks 4-7, which its rows' part 0 lanes read too.
      const int row = 16 * (lt >> 5) + (lt & 15), part = (lt >> 4) & 1;
      // Chunk c of a row's swizzled 128-byte line: the line's address (with the row's swizzle
      // added) ^ 16 c; 32-bit shared addresses keep the producer inside its 56 registers.
      const uint32_t row_base = sK + tl * kTileBytes + row * 128 + ((row & 7) << 4);
      auto put = [&](uint32_t line, uint4 v0, uint4 v1) {  // 16 e4m3 values -> f16 chunks 4 part .. + 3
        sts128(line ^ ((4 * part) << 4), widen_e4m3x8(make_uint2(v0.x, v0.y)));
        sts128(line ^ ((4 * part + 1) << 4), widen_e4m3x8(make_uint2(v0.z, v0.w)));
        sts128(line ^ ((4 * part + 2) << 4), widen_e4m3x8(make_uint2(v1.x, v1.y)));
        sts128(line ^ ((4 * part + 3) << 4), widen_e4m3x8(make_uint2(v1.z, v1.w)));
      };
#pragma unroll
      for (int cb = cb0; cb < cb1; cb += 2) {
        const uint32_t line = row_base + cb * kBlockBytes;
        if (cb + 1 < kCols) put(line + kBlockBytes, lds128(line ^ ((4 + 2 * part) << 4)), lds128(line ^ ((5 + 2 * part) << 4)));
        const uint4 v0 = lds128(line ^ ((2 * part) << 4)), v1 = lds128(line ^ ((2 * part + 1) << 4));
        __syncwarp();
        put(line, v0, v1);
      }
    } else if (key < prefix && key < key_end) {
#pragma unroll
      for (int cb = cb0; cb < cb1; ++cb) {
        uint8_t* blk = base + cb * kBlockBytes;
        const uint4 a = *reinterpret_cast<const uint4*>(blk + chunk(1));
        const uint4 b = *reinterpret_cast<const uint4*>(blk + chunk(3));
        *reinterpret_cast<uint4*>(blk + chunk(0)) = widen_e4m3x8(make_uint2(a.x, a.y));
        *reinterpret_cast<uint4*>(blk + chunk(1)) = widen_e4m3x8(make_uint2(a.z, a.w));
        *reinterpret_cast<uint4*>(blk + chunk(2)) = widen_e4m3x8(make_uint2(b.x, b.y));
        *reinterpret_cast<uint4*>(blk + chunk(3)) = widen_e4m3x8(make_uint2(b.z, b.w));
      }
    } else if (key < key_end) {
#pragma unroll
      for (int cb = cb0; cb < cb1; ++cb)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint4* c = reinterpret_cast<uint4*>(base + cb * kBlockBytes + chunk(i));
          *c = to_f16x8<T>(*c, tree_to_pool, beyond);
        }
    }
    // No proxy fence here: the consumers fence after their wait on this barrier, as for rows
    // copied by cp.async. A fence of its own held up the producer, the fp8 path's serial step
    // (fp8 pools 1-2% slower on an H200 with it).
    mbar_arrive(bars + 8 * (2 * tl + half_of(h)));
  };
  auto poll = [](uint32_t bar, uint32_t parity) {
    if constexpr (Boxed) return __all_sync(0xffffffffu, mbar_test(bar, parity)) != 0;
    else return mbar_test(bar, parity);
  };
  const int total = 4 * n_pairs;  // halves, in consumer order
  int issued = 0, widened = 0;
  while (widened < total) {
    bool progressed = false;
    if (issued < total) {
      const int pr = issued >> 2, h = issued & 3, sidx = 2 * tile_of(h) + half_of(h);
      if (poll(bars + 32 + 8 * sidx, ((pair_base + pr) & 1) ^ 1)) {  // a fresh barrier's "previous phase" is complete
        issue(pr, h);
        if (h == 2) slot0 = slot_of(key_of(pr + 1, 0));
        if (h == 3) slot1 = slot_of(key_of(pr + 1, 1));
        ++issued;
        progressed = true;
      }
    }
    if (widened < issued) {
      const int pr = widened >> 2, h = widened & 3;
      if (poll(bars + 64 + 8 * (2 * tile_of(h) + half_of(h)), (pair_base + pr) & 1)) {
        widen(pr, h);
        ++widened;
        progressed = true;
      }
    }
    if (!progressed) __nanosleep(20);
  }
}

__device__ __forceinline__ void box_prefetch(const CUtensorMap* map, int dim, int slot) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
               "r"(dim), "r"(slot)
               : "memory");
}

// Whether a tile of prefix slots first .. last looks like 64 consecutive pool rows (only its
// ends read: a hint, which the boxed producer checks in full before it issues boxes).
__device__ __forceinline__ bool looks_consecutive(int32_t first, int32_t last) {
  return first >= 0 && static_cast<uint64_t>(last) - static_cast<uint64_t>(first) == kTileKeys - 1;
}
// Whether this CTA's first tile looks consecutive: the CTA then takes the boxed producer.
template <typename Slots>
__device__ __forceinline__ bool kv_runs(Slots slots, int prefix, int key_begin, int key_end) {
  if (key_begin + kTileKeys > min(prefix, key_end)) return false;
  return looks_consecutive(load_slot(slots + key_begin), load_slot(slots + key_begin + kTileKeys - 1));
}

// The producer over a bf16/fp16 pool. Thread (group grp, chunk ck) copies rows grp + 16 j
// (j < 4) of a tile, 16-byte chunk ck of each of their 128-byte column blocks, by cp.async:
// eight threads read 128 contiguous bytes of a row. Boxed (kv_map set): a prefix tile whose
// 64 slots are consecutive rows of the pool instead lands as one box per column block, issued
// by one thread: 9 instructions for the 2,304 16-byte copies and their addresses. A CTA whose
// first tile looks like a run (kv_runs) takes a copy loop that tests every tile; any other
// runs one without the test: with both paths in one loop, scattered slots ran 7-13% slower
// on an H200 even with the boxes switched off. Boxable = false compiles the second alone.
template <bool Boxable, typename T, typename Slots, typename SlotOf>
__device__ __forceinline__ void produce_rows(const VerifyParams<T>& p, const CUtensorMap* kv_map, uint32_t sK,
                                             SlotOf slot_of, Slots slots, int q_begin, int prefix,
                                             int key_begin, int key_end, int n_pairs, uint32_t pair_base, int lt,
                                             uint32_t bar_q, bool& bad, bool lead) {
  const int grp = lt >> 3, ck = lt & 7;
  const uint32_t dst = grp * 128 + ((ck ^ (grp & 7)) << 4);  // (grp + 16 j) & 7 == grp & 7
  auto bar_ready = [&](int buf, int half) { return k_ready_bar(bar_q, buf, half); };
  auto bar_free = [&](int buf, int half) { return k_free_bar(bar_q, buf, half); };
  auto bar_block = [&](int buf, int cb) { return k_block_bar(bar_q, buf, cb); };
  // Key of this thread's row i (tile i / 4, row grp + 16 (i % 4)) of a pair; the prefix slot
  // behind it (0 for a tree key or past the end), as loaded: checked only where a copy uses
  // it, half a pair later, so no instruction waits on the load before then.
  auto key_of = [&](int pair, int i) { return key_begin + pair * kPairKeys + (i >> 2) * kTileKeys + grp + 16 * (i & 3); };
  // Row `key`'s first byte (row 0 of the pool past this CTA's keys, read as zeros).
  auto row_of = [&](int key, int32_t slot) -> const T* {
    if (key >= key_end) return p.kv;
    if (key < prefix) return p.kv + static_cast<int64_t>(checked_slot(p, slot, bad)) * p.kv_stride;
    return p.tree_k + static_cast<int64_t>(q_begin + key - prefix) * p.tk_stride;
  };
  // This thread's 8 row slots of a pair; each tile's 4 are loaded as soon as that tile's rows
  // of the previous pair are copied, half a pair before their own copies: no copy waits for
  // an index load.
  int32_t slot[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) slot[i] = slot_of(key_of(0, i));
  // The test's two loads go out behind the slots' loads: one memory latency before the first copy.
  const bool boxed = Boxable && kv_runs(slots, prefix, key_begin, key_end);
  // Boxed: the first slot of each tile of the pair where its slots run consecutively inside
  // the pool, else -1. All 128 threads agree (one barrier), so one of them issues the boxes.
  int run[2] = {-1, -1};
  const int unmasked_end = min(prefix, key_end);
  auto find_run = [&](int pr, int tl) {
    const int key0 = key_begin + pr * kPairKeys + tl * kTileKeys;
    if (key0 + kTileKeys > unmasked_end) return -1;  // CTA-uniform
    const int32_t first = load_slot(slots + key0);  // cached: warp 0 just loaded it as its slot
    bool mine = first >= 0 && static_cast<uint64_t>(first) + kTileKeys <= static_cast<uint64_t>(p.kv_rows);
#pragma unroll
    for (int j = 0; j < 4; ++j) mine &= slot[4 * tl + j] == first + grp + 16 * j;
    return named_sync_or(kBarRun, kWgThreads, !mine) ? -1 : static_cast<int>(first);
  };

  // Lead: this CTA asks L2 for the boxes of the pair after the one it copies (lane 0 of warp
  // 1, so thread 0's boxes never wait behind it), their edge slots loaded a pair earlier.
  const bool pf_lane = lead && lt == 32;
  int pf_first[2] = {-1, -1}, pf_last[2] = {0, 0};
  auto pf_load = [&](int pr) {
#pragma unroll
    for (int tl = 0; tl < 2; ++tl) {
      const int key0 = key_begin + pr * kPairKeys + tl * kTileKeys;
      const bool in = key0 + kTileKeys <= unmasked_end;
      pf_first[tl] = in ? static_cast<int>(load_slot(slots + key0)) : -1;
      pf_last[tl] = in ? static_cast<int>(load_slot(slots + key0 + kTileKeys - 1)) : 0;
    }
  };
  if (Boxable && pf_lane) pf_load(1);
  auto copy_loop = [&](auto boxed_loop) {
    constexpr bool Boxed = decltype(boxed_loop)::value;
    // The phase before a barrier's first counts as complete; the phases run on across segments.
    uint32_t free_parity = (pair_base & 1) ^ 1;
#pragma unroll 1
    for (int pr = 0; pr < n_pairs; ++pr) {
      // Half `half` (dims 0-255: column blocks 0-3; 256-575: 4-8) of tile tl. In the boxed
      // loop each column block completes on a barrier of its own: a boxed half's blocks land one
      // by one and the consumers start on each as soon as it is there (from HBM, a half's 32-40
      // KB take about a thousand clocks to stream in); a copied half arrives on all its blocks'
      // barriers once the whole half has landed, so the consumers' one proxy fence per half
      // covers every block.
      auto copy = [&](int tl, int half) {
        const int cb0 = half ? 4 : 0, cb1 = half ? kCols : 4;
        if (Boxed && run[tl] >= 0) {
          for (int cb = cb0; cb < cb1; ++cb) {
            if (lt == 0) {
              mbar_expect_bytes(bar_block(tl, cb), kBlockBytes);
              box_load(sK + tl * kTileBytes + cb * kBlockBytes, kv_map, cb * 64, run[tl], bar_block(tl, cb));
            } else {
              mbar_arrive(bar_block(tl, cb));
            }
          }
          return;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = key_of(pr, 4 * tl + j);
          const T* src = row_of(key, slot[4 * tl + j]) + ck * 8;
#pragma unroll
          for (int cb = 0; cb < kCols; ++cb)
            if (cb >= cb0 && cb < cb1)
              cp_async16(sK + tl * kTileBytes + cb * kBlockBytes + 2048 * j + dst, src + cb * 64, key < key_end);
        }
        if constexpr (Boxed) {  // the consumers wait as kv_runs tells them which loop runs
          for (int cb = cb0; cb < cb1; ++cb) cp_async_arrive(bar_block(tl, cb));
        } else {
          cp_async_arrive(bar_ready(tl, half));
        }
      };
      if (Boxed && pf_lane) {
#pragma unroll
        for (int tl = 0; tl < 2; ++tl)
          if (looks_consecutive(pf_first[tl], pf_last[tl]))
            for (int cb = 0; cb < kCols; ++cb) box_prefetch(kv_map, cb * 64, pf_first[tl]);
        pf_load(pr + 2);
      }
      // The order the consumers read them: WG0 dims 0-255 then 256-575 of the even tile; WG1
      // 256-575 then 0-255 of the odd one (its dims 0-255 are freed last, by WG0's P V).
      if constexpr (Boxed) run[0] = find_run(pr, 0);
      mbar_wait(bar_free(0, 0), free_parity);
      copy(0, 0);
      if constexpr (Boxed) run[1] = find_run(pr, 1);
      mbar_wait(bar_free(1, 1), free_parity);
      copy(1, 1);
      mbar_wait(bar_free(0, 1), free_parity);
      copy(0, 1);
#pragma unroll
      for (int i = 0; i < 4; ++i) slot[i] = slot_of(key_of(pr + 1, i));
      mbar_wait(bar_free(1, 0), free_parity);
      copy(1, 0);
#pragma unroll
      for (int i = 4; i < 8; ++i) slot[i] = slot_of(key_of(pr + 1, i));
      free_parity ^= 1;
    }
  };
  if (boxed) {
    copy_loop(std::true_type{});
  } else {
    copy_loop(std::false_type{});
  }
}

#endif  // sm_90a

// What the kernel's K rows are: the 16-bit pool of q's type; an fp8 pool, whose e4m3 rows land
// and are widened to f16 here; or an fp8 pool widened beforehand (launch_widen_fp8_pool), whose
// f16 rows land as a 16-bit pool's do. The last two compute alike (Fp8Math).
enum class Pool { k16, kFp8, kWidened };

// Boxable: a pool with kv_map describing it (see launch_verify_attn_seesaw). Balanced:
// the balanced schedule (p.balanced > 0), segment after segment; otherwise the CTA's one split,
// and none of that schedule's code: in the equal-split instances it cost batch-1 launches
// (which never run it) up to a fifth of their time on an H200.
template <typename T, typename Idx, Pool kPool, bool Boxable, bool Balanced>
__global__ void __launch_bounds__(kThreads, 1)
    verify_attn_seesaw_kernel(const VerifyParams<T> p, const __grid_constant__ CUtensorMap kv_map) {
#ifdef KD_SM90A
  constexpr bool Fp8 = kPool != Pool::k16;        // Fp8Math: the pool's units, k_scale in float32
  constexpr bool Lands8 = kPool == Pool::kFp8;    // e4m3 rows land and are widened by the producer
  using M = std::conditional_t<Fp8, Fp8Math, T>;  // the tensor-core operands
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t s_base = smem_addr(smem);
  const uint32_t sQ = s_base, sK = s_base + kOffK, sP1 = s_base + kOffS1;
  const uint32_t sP0 = sK + (kCols - 1) * kBlockBytes;
  float* s_max = reinterpret_cast<float*>(smem + kOffMax);
  float* s_sum = reinterpret_cast<float*>(smem + kOffSum);
  const uint32_t bar_q = s_base + kOffBar;
  auto bar_ready = [&](int buf, int half) { return k_ready_bar(bar_q, buf, half); };
  auto bar_free = [&](int buf, int half) { return k_free_bar(bar_q, buf, half); };
  auto bar_block = [&](int buf, int cb) { return k_block_bar(bar_q, buf, cb); };
  Segment* s_seg = reinterpret_cast<Segment*>(smem + kOffSeg);
  // The prefix slots of the request whose first kv_indices entry is kv_begin.
  auto slots_from = [&](int kv_begin) {
    if constexpr (kPool == Pool::kWidened) {
      return PositionSlots{kv_begin};
    } else {
      return static_cast<const Idx*>(p.kv_indices) + kv_begin;
    }
  };

  const int tid = threadIdx.x, wg = tid / kWgThreads, lt = tid % kWgThreads;
  const bool has_work = start_segments<kRows, Balanced>(p, s_seg, tid, [&] {
    for (int i = 0; i < kBars; ++i) mbar_init(bar_q + 8 * i, kWgThreads);
  });
  if (!has_work) return;

  // Segment k's Q lands on bar_q's phase k; the K barriers' phases run on over the tile pairs
  // of all segments (pair_base: those of the earlier ones), a K-ready barrier's over the pairs
  // of the segments that used its kind (half or column block). The producer finds segment k + 1
  // while the consumers finish k and publishes it through the barrier that ends k (kBarLoaded),
  // after which Q and both K buffers are free.
  if (wg == 2) {
    // ================= producer: Q, then K tiles by slot =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    // Thread (group grp, chunk ck): rows grp + 16 j (j < 4) of a tile, 16-byte chunk ck of each
    // of their 128-byte column blocks; eight threads read 128 contiguous bytes of a row.
    const int grp = lt >> 3, ck = lt & 7;
    const uint32_t dst = grp * 128 + ((ck ^ (grp & 7)) << 4);  // (grp + 16 j) & 7 == grp & 7
    uint32_t pair_base = 0;
    for (int k = 0;; ++k) {
      const Segment sg = s_seg[k & 1];
      if (sg.b == kNoWork) break;
      const auto [b, row0, q_begin, rows_b, kv_begin, prefix, key_begin, key_end, n_pairs, direct, part, next] = sg;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // A row past the request reads nothing (src-size 0: zeros) from row 0 of q.
        const int m = row0 + grp + 16 * j;
        const T* src = p.q + ck * 8;
        if (m < rows_b) {
          const int node = m / p.heads, head = m - node * p.heads;
          src += (q_begin + node) * p.q_st + head * p.q_sh;
        }
#pragma unroll
        for (int cb = 0; cb < kCols; ++cb)
          cp_async16(sQ + cb * kBlockBytes + 2048 * j + dst, src + cb * 64, m < rows_b);
      }
      cp_async_arrive(bar_q);

      const auto slots = slots_from(kv_begin);
      bool bad = false;     // met a prefix slot outside kv_cache (checked_slot)
      bool beyond = false;  // fp8: a tree row beyond f16 in the pool's units (kGuardFp8Range)
      auto slot_of = [&](int key) {
        return key < prefix && key < key_end ? load_slot(slots + key) : 0;
      };
      if constexpr (Lands8) {
        auto produce = [&](auto boxed) {
          produce_fp8<decltype(boxed)::value>(p, &kv_map, sK, smem + kOffK, slot_of, slots, q_begin, prefix,
                                              key_begin, key_end, n_pairs, pair_base, lt, bar_q, bad, beyond);
        };
        // As for 16-bit pools: scattered slots get a loop without the boxes' tests.
        if (Boxable && kv_runs(slots, prefix, key_begin, key_end)) {
          if constexpr (Boxable) produce(std::true_type{});
        } else {
          produce(std::false_type{});
        }
      } else {
        produce_rows<Boxable>(p, &kv_map, sK, slot_of, slots, q_begin, prefix, key_begin, key_end, n_pairs,
                              pair_base, lt, bar_q, bad, row0 == 0 && rows_b > 2 * kRows);
      }
      if constexpr (Balanced) {
        if (lt < 32) {
          const Segment after = balanced_segment(p, lt, &sg);
          if (lt == 0) s_seg[(k + 1) & 1] = after;
        }
      }
      named_sync_or(kBarLoaded, kThreads, bad);
      if constexpr (Lands8) named_sync_or(kBarLoaded, kThreads, beyond);
      if constexpr (!Balanced) break;  // one segment: the barrier phases stay compile-time
      pair_base += n_pairs;
    }
  } else {
    // ================= consumers =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    // This thread's two rows of every m64 accumulator: columns 8 i + 2 t4 + {0, 1} of row rA
    // in d[4 i], d[4 i + 1] and of row rB in d[4 i + 2], d[4 i + 3].
    const int rA = (lt >> 5) * 16 + g, rB = rA + 8;
    uint32_t half_pairs = 0, block_pairs = 0;  // pairs of earlier segments that waited on each kind
    for (int k = 0;; ++k) {
      const Segment sg = s_seg[k & 1];
      if (sg.b == kNoWork) break;
      const auto [b, row0, q_begin, rows_b, kv_begin, prefix, key_begin, key_end, n_pairs, direct, part, next] = sg;
      const int mA = row0 + rA, mB = row0 + rB;
      const int nodeA = mA < rows_b ? mA / p.heads : 0, nodeB = mB < rows_b ? mB / p.heads : 0;
      const int32_t* maskA = p.mask ? p.mask + (q_begin + nodeA) * p.mask_stride : nullptr;
      const int32_t* maskB = p.mask ? p.mask + (q_begin + nodeB) * p.mask_stride : nullptr;
      // fp8 pool: k_scale, and 1 / the power of two a bf16 q takes into f16, scale the scores in
      // float32 and k_scale the output (Fp8Math). The consumers convert Q in place once it lands.
      const float k_scale = Fp8 ? kv_scale(p) : 1.f;
      float q_factor = 1.f;
      // Which copy loop the producer runs (the same test): its two loads go out before Q's wait.
      const bool block_bars =  // an fp8 pool's boxes are widened, so ready by halves as its copies
          Boxable && !Lands8 && kv_runs(slots_from(kv_begin), prefix, key_begin, key_end);
      const uint32_t pair_base = block_bars ? block_pairs : half_pairs;
      mbar_wait(bar_q, k & 1);
      if constexpr (Fp8 && std::is_same_v<T, __nv_bfloat16>) {
        constexpr int kPerThread = kTileBytes / 16 / (2 * kWgThreads);
        uint4* q16 = reinterpret_cast<uint4*>(smem) + tid;
        uint32_t peak = 0;
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          const uint4 v = q16[j * 2 * kWgThreads];
          peak = peak_bits(peak_bits(peak_bits(peak_bits(peak, v.x), v.y), v.z), v.w);
        }
        peak = __reduce_max_sync(0xffffffffu, peak_bits_fold(peak));
        uint32_t* s_peak = reinterpret_cast<uint32_t*>(s_max);  // free until the first softmax
        if (lane == 0) s_peak[tid >> 5] = peak;
        named_sync(kBarSum, kConsumers);
#pragma unroll
        for (int w = 0; w < 2 * kWgThreads / 32; ++w) peak = max(peak, s_peak[w]);
        q_factor = q_f16_factor(peak);
        bool unused = false;  // |q| x q_factor < 2^15
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) q16[j * 2 * kWgThreads] = to_f16x8<T>(q16[j * 2 * kWgThreads], q_factor, unused);
        fence_proxy_async();  // read by wgmma (async proxy)
        named_sync(kBarSum, kConsumers);  // every thread's part of Q, and every read of s_peak
      }
      const float c = Fp8 ? p.scale_log2 * (k_scale / q_factor) : p.scale_log2;  // > 0 (the host sends other scales elsewhere)
      const int unmasked_end = min(prefix, key_end);  // tiles below need no mask

      auto tree_visible = [&](const int32_t* mrow, int node, int j) {
        return mrow ? (j >> 5) < p.mask_words && ((mrow[j >> 5] >> (j & 31)) & 1) : j <= node;
      };
      // Row maxima of tile S (first key key0) in the log2 domain, masking it first if it reaches
      // the tree or the end. Masked scores are -inf: times c > 0 they stay -inf and exp to 0.
      auto tile_max = [&](float (&s)[32], int key0, float& mxA, float& mxB) {
        if (key0 + kTileKeys > unmasked_end) {
#pragma unroll
          for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = key0 + 8 * i + 2 * t4 + e;
              bool inA = key < key_end, inB = inA;
              if (inA && key >= prefix) {
                inA = tree_visible(maskA, nodeA, key - prefix);
                inB = tree_visible(maskB, nodeB, key - prefix);
              }
              if (!inA) s[4 * i + e] = -INFINITY;
              if (!inB) s[4 * i + 2 + e] = -INFINITY;
            }
        }
        mxA = mxB = -INFINITY;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          mxA = fmaxf(mxA, fmaxf(s[4 * i], s[4 * i + 1]));
          mxB = fmaxf(mxB, fmaxf(s[4 * i + 2], s[4 * i + 3]));
        }
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
        mxA *= c;
        mxB *= c;
      };
      // A row's max only moves when a tile beats it by kRescaleSlack: P stays <= 2^8 and most
      // tiles rescale nothing.
      auto next_max = [](float run, float mx) { return mx > run + kRescaleSlack ? mx : run; };
      // P = 2^(S c - max), kept in S (float) and packed into ps, wgmma's A-fragment layout for
      // 16-key steps (ps[4 kk .. 4 kk + 3]); adds this thread's share of the row sums.
      auto exp_tile = [&](float (&s)[32], uint32_t (&ps)[16], float mA, float mB, float& lA, float& lB) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            s[4 * i + e] = fast_exp2(fmaf(s[4 * i + e], c, -mA));
            s[4 * i + 2 + e] = fast_exp2(fmaf(s[4 * i + 2 + e], c, -mB));
            lA += s[4 * i + e];
            lB += s[4 * i + 2 + e];
          }
#pragma unroll
        for (int q = 0; q < 16; ++q) ps[q] = pack2<M>(s[2 * q], s[2 * q + 1]);
      };
      auto scale_o = [](float (&o)[128], float aA, float aB) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j] *= aA;
          o[4 * j + 1] *= aA;
          o[4 * j + 2] *= aB;
          o[4 * j + 3] *= aB;
        }
      };
      // P into the other consumer's 128-byte swizzled K-major buffer: row r's 16-byte chunk i
      // (keys 8 i ..) sits at chunk i ^ (r & 7).
      auto store_p = [&](uint32_t sP, const uint32_t (&ps)[16]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + rA * 128 + ((i ^ (rA & 7)) << 4) + t4 * 4), "r"(ps[2 * i]));
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + rB * 128 + ((i ^ (rB & 7)) << 4) + t4 * 4), "r"(ps[2 * i + 1]));
        }
      };

      float o[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] = 0.f;
      float s[32];
      uint32_t ps[16];
      // Running max (log2 domain) of rows rA, rB, and this thread's share of their sums.
      float runA = kMaxInit, runB = kMaxInit, lA = 0.f, lB = 0.f;
      // Moves the running max of rows rA, rB to nA, nB; aA, aB bring what was computed against
      // the old max to the new one (1 where it stays).
      auto move_max = [&](float nA, float nB, float& aA, float& aB) {
        aA = nA != runA ? fast_exp2(runA - nA) : 1.f;
        aB = nB != runB ? fast_exp2(runB - nB) : 1.f;
        runA = nA;
        runB = nB;
      };
      // The sums and O by those factors.
      auto rescale = [&](float aA, float aB) {
        lA *= aA;
        lB *= aB;
        if (aA != 1.f || aB != 1.f) scale_o(o, aA, aB);
      };
      auto move_max_rescale_o = [&](float nA, float nB) {
        float aA, aB;
        move_max(nA, nB, aA, aB);
        rescale(aA, aB);
      };

      // K ready for a half of buffer `buf`: where the producer runs its boxed loop its first
      // column block, else the half; then the proxy fence for rows copied by cp.async or widened
      // from fp8 by the producer's stores (a copied or widened half is whole before any of its
      // barriers completes, so one fence covers it; boxes need none). The other consumer's P V
      // reads that half after this one's fence, behind the named barrier that hands it P. blocks_of waits for each further block as the products reach it.
      auto wait_half = [&](int buf, int half, uint32_t parity) {
        mbar_wait(block_bars ? bar_block(buf, half ? 4 : 0) : bar_ready(buf, half), parity);
        fence_proxy_async();
      };
      auto blocks_of = [&](int buf, uint32_t parity) {
        return [=](int cb) {
          if (block_bars) mbar_wait(bar_block(buf, cb), parity);
        };
      };

      if (wg == 0) {
        const uint64_t v0 = v_desc(sK, 0), v1 = v_desc(sK + kTileBytes, 0);
#pragma unroll 1
        for (int pr = 0; pr < n_pairs; ++pr) {
          const uint32_t parity = (pair_base + pr) & 1;
          if (pr == 0) {
            wait_half(0, 0, parity);
            wgmma_fence();
            issue_qk<M, 0, 4, true>(s, sQ, sK, blocks_of(0, parity));
            wait_half(0, 1, parity);
            issue_qk<M, 4, kCols, false>(s, sQ, sK, blocks_of(0, parity));
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
          }
          // softmax of the even tile against this thread's running max
          float mxA, mxB;
          tile_max(s, key_begin + 2 * pr * kTileKeys, mxA, mxB);
          {
            const float nA = next_max(runA, mxA), nB = next_max(runB, mxB);
            move_max_rescale_o(nA, nB);
          }
          exp_tile(s, ps, runA, runB, lA, lB);
          if (t4 == 0) {
            s_max[rA] = runA;
            s_max[rB] = runB;
          }
          named_arrive(kBarMax0, kConsumers);
          // O[:, 0:256) += P0 V0
          wgmma_fence();
          issue_pv_rs<M>(o, ps, v0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs(o);
          mbar_arrive(bar_free(0, 0));
          // WG1's odd tile may have moved the max: bring P0 to it, hand P0 over, rescale O
          named_sync(kBarMax1, kConsumers);
          {
            const float nA = s_max[rA], nB = s_max[rB];
            float aA, aB;
            move_max(nA, nB, aA, aB);
            if (aA != 1.f || aB != 1.f) {
#pragma unroll
              for (int q = 0; q < 16; ++q) {
                const float a = (q & 1) ? aB : aA;
                ps[q] = pack2<M>(s[2 * q] * a, s[2 * q + 1] * a);
              }
            }
            store_p(sP0, ps);
            fence_proxy_async();
            named_arrive(kBarP0, kConsumers);
            rescale(aA, aB);
          }
          // O[:, 0:256) += P1 V1
          named_sync(kBarP1, kConsumers);
          wgmma_fence();
          issue_pv_ss<M>(o, sP1, v1);
          wgmma_commit();
          if (pr + 1 < n_pairs) {
            // the next even tile's S while P1 V1 runs
            wait_half(0, 0, parity ^ 1);
            wgmma_fence();
            issue_qk<M, 0, 4, true>(s, sQ, sK, blocks_of(0, parity ^ 1));
            wgmma_commit();
            wgmma_wait<1>();
            mbar_arrive(bar_free(1, 0));
            wait_half(0, 1, parity ^ 1);
            issue_qk<M, 4, kCols, false>(s, sQ, sK, blocks_of(0, parity ^ 1));
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
            fence_regs(o);
          } else {
            wgmma_wait<0>();
            fence_regs(o);
            mbar_arrive(bar_free(1, 0));
          }
        }
      } else {
        const uint64_t v1 = v_desc(sK + kTileBytes, 1), v0 = v_desc(sK, 1);
#pragma unroll 1
        for (int pr = 0; pr < n_pairs; ++pr) {
          const uint32_t parity = (pair_base + pr) & 1;
          wait_half(1, 1, parity);
          wgmma_fence();
          issue_qk<M, 4, kCols, true>(s, sQ, sK + kTileBytes, blocks_of(1, parity));
          wait_half(1, 0, parity);
          issue_qk<M, 0, 4, false>(s, sQ, sK + kTileBytes, blocks_of(1, parity));
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs(s);
          // softmax of the odd tile against the max WG0 left after the even one
          float mxA, mxB;
          tile_max(s, key_begin + (2 * pr + 1) * kTileKeys, mxA, mxB);
          named_sync(kBarMax0, kConsumers);
          {
            const float nA = next_max(s_max[rA], mxA), nB = next_max(s_max[rB], mxB);
            move_max_rescale_o(nA, nB);
          }
          exp_tile(s, ps, runA, runB, lA, lB);
          __syncwarp();  // every lane of a quad has read s_max before its first lane rewrites it
          if (t4 == 0) {
            s_max[rA] = runA;
            s_max[rB] = runB;
          }
          named_arrive(kBarMax1, kConsumers);
          // O[:, 256:512) += P1 V1, and P1 to WG0
          wgmma_fence();
          issue_pv_rs<M>(o, ps, v1);
          wgmma_commit();
          store_p(sP1, ps);
          fence_proxy_async();
          // O[:, 256:512) += P0 V0. P1 goes to WG0 only once these products are issued: the
          // tensor pipe then runs them before WG0's P1 V1 and next Q K^T, and dims 256-575 of
          // the even tile, which WG0's next Q K^T reads second, free (and refill) that much earlier.
          named_sync(kBarP0, kConsumers);
          wgmma_fence();
          issue_pv_ss<M>(o, sP0, v0);
          wgmma_commit();
          named_arrive(kBarP1, kConsumers);
          wgmma_wait<1>();
          mbar_arrive(bar_free(1, 1));
          wgmma_wait<0>();
          fence_regs(o);
          mbar_arrive(bar_free(0, 1));
        }
      }

      // ---- epilogue: the row sums of both consumers, then this consumer's half of O ----
      lA += __shfl_xor_sync(0xffffffffu, lA, 1);
      lB += __shfl_xor_sync(0xffffffffu, lB, 1);
      lA += __shfl_xor_sync(0xffffffffu, lA, 2);
      lB += __shfl_xor_sync(0xffffffffu, lB, 2);
      if (t4 == 0) {
        s_sum[wg * kRows + rA] = lA;
        s_sum[wg * kRows + rB] = lB;
      }
      named_sync(kBarSum, kConsumers);
      // A slot outside kv_cache met by the producer, or a malformed batch: NaN rows.
      const bool malformed = b == kMalformedBatch;
      const bool slot_bad = named_sync_or(kBarLoaded, kThreads, false);
      const bool range_bad =
          Fp8 && ((Lands8 && named_sync_or(kBarLoaded, kThreads, false)) || !k_scale_usable(k_scale));
      if ((slot_bad || range_bad || malformed) && tid == 0)
        raise_guard(p.guard, malformed ? kGuardVerifyIndptr : slot_bad ? kGuardKvSlot : kGuardFp8Range);
      // The widening's findings (it raised their guard).
      const bool bad = slot_bad || range_bad || malformed || (kPool == Pool::kWidened && !malformed && p.req_bad[b] != 0);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = half ? rB : rA, m = row0 + r;
        if (m >= rows_b) continue;
        const float l = s_sum[r] + s_sum[kRows + r], mx = half ? runB : runA;
        const float inv = bad ? kNaN : l > 0.f ? k_scale / l : 0.f;
        const int node = m / p.heads, head = m - node * p.heads;
        if (direct) {
          T* dst = p.out + (q_begin + node) * p.out_st + head * p.out_sh + wg * 256 + t4 * 2;
#pragma unroll
          for (int j = 0; j < 32; ++j)
            *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<T>(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
        } else if (l > 0.f) {  // the merge never reads a row of a split that saw nothing
          float* dst = p.part_o + (part + r) * kDv + wg * 256 + t4 * 2;
#pragma unroll
          for (int j = 0; j < 32; ++j)
            *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
        }
        if (wg == 0 && t4 == 0) {
          const float lse = bad ? kNaN : l > 0.f ? (mx + __log2f(l)) * 0.69314718055994531f : -INFINITY;
          if (direct)
            p.lse[(q_begin + node) * p.lse_st + head * p.lse_sh] = lse;
          else
            p.part_lse[part + r] = lse;
        }
      }
      if constexpr (!Balanced) break;
      (block_bars ? block_pairs : half_pairs) += n_pairs;
    }
  }
#else
  __trap();
#endif
}

}  // namespace

// A tensor map of the pool for the boxed producer: kv_rows rows of 576 elements, kv_stride
// apart, read in boxes of 64 rows x 128 bytes (64 dims of a 16-bit pool, 128 of an fp8 one;
// the fp8 pool's last box reads 64 bytes past the row's end as zeros) with the K buffers'
// 128-byte swizzle. False where the driver or the pool's layout allows none (base and row
// stride 16-byte aligned, rows < 2^31): the kernel then copies by slot only.
template <typename T>
bool encode_kv_map(const VerifyParams<T>& p, CUtensorMap& map) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess) {
      (void)cudaGetLastError();
      return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    }
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
  }();
  const bool fp8 = p.kv8 != nullptr;
  const void* base = fp8 ? static_cast<const void*>(p.kv8) : static_cast<const void*>(p.kv);
  const int64_t row_bytes = p.kv_stride * static_cast<int64_t>(fp8 ? 1 : sizeof(T));
  if (encode == nullptr || p.kv_rows < kTileKeys || p.kv_rows >= (int64_t{1} << 31) ||
      reinterpret_cast<uintptr_t>(base) % 16 != 0 || row_bytes % 16 != 0) {
    return false;
  }
  cuuint64_t dims[2] = {kDqk, static_cast<cuuint64_t>(p.kv_rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  cuuint32_t box[2] = {fp8 ? 128u : 64u, kTileKeys}, steps[2] = {1, 1};
  const CUtensorMapDataType type = fp8                                       ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(&map, type, 2, const_cast<void*>(base), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// KDTREE_VERIFY_TMA=0 (or boxes = false) keeps every tile on cp.async. A widened pool
// (p.req_bad set) reads no slot index (PositionSlots), so one instance serves either index type.
template <typename T>
void launch_verify_attn_seesaw(const VerifyParams<T>& p, bool idx32, bool boxes, dim3 grid, cudaStream_t stream) {
  CUtensorMap kv_map{};
  const bool boxable = boxes && env_flag("KDTREE_VERIFY_TMA", true) && encode_kv_map(p, kv_map);
  auto kernel = with_flag(p.balanced > 0, [&](auto balanced) {
    return with_flag(idx32, [&](auto i32) {
      return with_flag(boxable, [&](auto bx) {
        using Idx = SlotIndex<decltype(i32)>;
        constexpr bool B = decltype(balanced)::value, Bx = decltype(bx)::value;
        auto widened = verify_attn_seesaw_kernel<T, int32_t, Pool::kWidened, Bx, B>;
        auto fp8 = verify_attn_seesaw_kernel<T, Idx, Pool::kFp8, Bx, B>;
        auto pool16 = verify_attn_seesaw_kernel<T, Idx, Pool::k16, Bx, B>;
        return p.kv8 ? fp8 : p.req_bad ? widened : pool16;
      });
    });
  });
  allow_dynamic_smem(kernel, kSmemBytes);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, kv_map);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_verify_attn_seesaw<__nv_bfloat16>(const VerifyParams<__nv_bfloat16>&, bool, bool, dim3, cudaStream_t);
template void launch_verify_attn_seesaw<__half>(const VerifyParams<__half>&, bool, bool, dim3, cudaStream_t);

namespace {

// The widened route's pre-pass (see launch_widen_fp8_pool; sm_90a, as the seesaw kernel that
// reads its workspace): block (x, b) takes rows x, x + X, ... of request b's prefix, then of its
// tree rows, kRowsPerBlock at a time, each row as kPieces pieces of 16 values, a piece a thread
// (16 bytes of e4m3 in flight per thread: about what HBM's latency asks of an SM). A request
// whose indptr entries do not describe the batch is left alone: the seesaw kernel reports it
// (kGuardVerifyIndptr) and reads nothing of it.
constexpr int kPieces = kDqk / 16, kRowsPerBlock = 8;
template <typename T, typename Idx>
__global__ void __launch_bounds__(kPieces * kRowsPerBlock)
    widen_fp8_pool_kernel(const VerifyParams<T> p, uint4* ws, uint4* ws_tree, int32_t* req_bad) {
#ifdef KD_SM90A
  const int b = blockIdx.y;
  const int64_t kv_begin = p.kv_indptr[b], kv_end = p.kv_indptr[b + 1];
  const int64_t q_begin = p.qo_indptr[b], q_end = p.qo_indptr[b + 1];
  if (kv_begin < 0 || kv_end < kv_begin || kv_end > p.n_indices || q_begin < 0 || q_end < q_begin ||
      q_end > p.tokens) {
    return;
  }
  const Idx* kv_indices = static_cast<const Idx*>(p.kv_indices);
  const int piece = threadIdx.x % kPieces;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kPieces;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  bool bad = false, beyond = false;
  for (int64_t i = kv_begin + first; i < kv_end; i += stride) {
    const Idx slot = checked_slot(p, kv_indices[i], bad);  // row 0 in place of a bad one
    const uint4 v = *reinterpret_cast<const uint4*>(p.kv8 + slot * p.kv_stride + 16 * piece);
    ws[(i * kPieces + piece) * 2] = widen_e4m3x8(make_uint2(v.x, v.y));
    ws[(i * kPieces + piece) * 2 + 1] = widen_e4m3x8(make_uint2(v.z, v.w));
  }
  // As the fp8 producer turns a tree row into the pool's units (one f16 rounding).
  const float tree_to_pool = 1.f / kv_scale(p);
  for (int64_t t = q_begin + first; t < q_end; t += stride) {
    const uint4* src = reinterpret_cast<const uint4*>(p.tree_k + t * p.tk_stride + 16 * piece);
    const uint4 lo = src[0], hi = src[1];
    ws_tree[(t * kPieces + piece) * 2] = to_f16x8<T>(lo, tree_to_pool, beyond);
    ws_tree[(t * kPieces + piece) * 2 + 1] = to_f16x8<T>(hi, tree_to_pool, beyond);
  }
  const bool block_bad = __syncthreads_or(bad), block_beyond = __syncthreads_or(beyond);
  if ((block_bad || block_beyond) && threadIdx.x == 0) {
    req_bad[b] = 1;
    raise_guard(p.guard, block_bad ? kGuardKvSlot : kGuardFp8Range);
  }
#else
  __trap();
#endif
}

}  // namespace

template <typename T>
void launch_widen_fp8_pool(const VerifyParams<T>& p, bool idx32, __half* ws, __half* ws_tree, int32_t* req_bad,
                           int sms, cudaStream_t stream) {
  // About seven blocks (2,016 threads) an SM over the batch: the pass streams 1,728 bytes a
  // prefix row.
  const unsigned per_request = static_cast<unsigned>(std::max(1, 7 * sms / std::max(p.batch, 1)));
  const dim3 grid(per_request, static_cast<unsigned>(p.batch));
  auto kernel = idx32 ? widen_fp8_pool_kernel<T, int32_t> : widen_fp8_pool_kernel<T, int64_t>;
  kernel<<<grid, kPieces * kRowsPerBlock, 0, stream>>>(p, reinterpret_cast<uint4*>(ws), reinterpret_cast<uint4*>(ws_tree),
                                                       req_bad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_widen_fp8_pool<__nv_bfloat16>(const VerifyParams<__nv_bfloat16>&, bool, __half*, __half*, int32_t*,
                                                   int, cudaStream_t);
template void launch_widen_fp8_pool<__half>(const VerifyParams<__half>&, bool, __half*, __half*, int32_t*, int,
                                            cudaStream_t);

}  // namespace kdtree
