// Tree-verify attention for MLA (one 576-wide latent KV head; value = its first 512 dims).
//
// Why this shape: the prefix is visible to every (node, head) row, so each CTA folds 64 of
// those rows into tensor-core M tiles and streams its slice of the prefix once for all of
// them; the prefix is split across CTAs (flash-decoding) so one request fills the GPU; the
// last split also runs the request's own tree keys under the ancestor mask, continuing the
// same online softmax. With one split the CTA writes the final output; otherwise partials
// are merged by log-sum-exp in a second kernel. A batch may instead run the balanced schedule
// (BalancedWork, verify_attn.cuh): a CTA walks one segment of keys after another, each a run
// of one request's row tile, as its equal share of the whole batch's work.
//
// CTA: 8 warps, 64 rows, in two halves of 4 warps and 32 rows that run a tile half a tile apart
// (ping-pong), so that one half's Q K^T (bound by shared-memory reads) issues beside the other
// half's softmax (bound by latency) and P V (bound by the tensor pipe), where warps in lockstep
// between CTA barriers ran each phase alone. Within a half, S = Q K^T: warp (rt, dh) owns rows
// 16*rt.. and half the 576 dims, Q held in registers, the two halves summed through shared
// memory; O += P V: each warp owns the half's 32 rows x 128 dims. The second half copies every
// tile, as soon as both halves are done with the stage it lands in, and tells the first half
// when it has landed; named barriers carry both handshakes. Shared memory stays under 99 KB
// (sm_120) with two 32-key stages of 1,152-byte rows loaded by 16-byte cp.async. Over an fp8
// pool every tile's e4m3 bytes are also widened to f16 in shared memory: the copying half
// widens one of each thread's two rows as they land, the leading half the other once told
// they have, and tells the copying half when it is done.
//
// A request of 144 rows (16 heads x 9 nodes, DeepSeek at TP8) fills 64-row tiles to 75%; the
// 48-row CTA covers it exactly: 12 warps, warp (rt = w % 3, dh = w / 3) owning a quarter of
// the dims for S (the four summed through shared memory by parts 0 and 1, which run the
// softmax as in the 64-row CTA) and rows 16*rt.. x dims [128 dh, +128) for O. It re-reads the
// prefix once per 48 rows instead of 64, so the launcher takes it only where 64-row tiles pad
// enough rows (portable_rows).
// A request of at most 16 rows (16 heads x 1 node) takes a 16-row CTA: the 48-row CTA's warps
// of one row tile (4 warps, each copying 8 rows of a KV tile in two passes), two per SM on
// sm_90 where the others run one. Over an fp8 pool it keeps one f16 tile and stages the next
// tile's e4m3 bytes behind it where that fits more CTAs on an SM (three on sm_90) and the
// grid has CTAs for those places.
//
// On sm_90 (H100/H200) a Hopper kernel takes the same CTAs instead (verify_attn_sm90_seesaw.cu;
// verify_attn_sm90.cu).
#include "verify_attn.cuh"

#include <algorithm>
#include <cmath>

namespace kdtree {
namespace {

constexpr int kRowBytes = kDqk * 2, kChunks = kRowBytes / 16;  // 72 16-byte chunks per row
// Rows sit 1,168 B apart in shared memory: the extra 16 B move consecutive rows to different
// bank groups, so the 8 rows one ldmatrix reads never conflict, and every fragment address
// is a per-lane base plus a compile-time offset.
constexpr int kRowPitch = kRowBytes + 16;
constexpr int kStageBytes = kKeys * kRowPitch;
constexpr int kPStride = kKeys + 8;  // padded P row (bf16)
constexpr int kSmemKV = 2 * kStageBytes;
// Warps that copy (and, over an fp8 pool, widen) a KV tile: one pass of 4 rows x 8 lanes each
// (a CTA of fewer warps makes more passes).
constexpr int kCopyWarps = kKeys / 4;
static_assert(kChunks % 8 == 0, "copy_rows: 8 lanes per row");

// A CTA's shape: Rows (node, head) rows in 16-row tiles; S splits the 576 dims into DimParts
// (one warp per row tile and part), O splits the 512 dims into DimGroups.
// PingPong: two halves of the warps, each with half the row tiles and O's rows, run half a tile
// apart; the second half copies the KV tiles.
template <int Rows, int DimParts, int DimGroups, bool Fp8Staged = false, bool PingPong = false> struct Cta {
  static constexpr int kRows = Rows, kRowTiles = Rows / 16, kParts = DimParts;
  static constexpr int kWarps = kRowTiles * DimParts, kThreads = kWarps * 32;
  static constexpr bool kPingPong = PingPong;
  static constexpr int kCopiers = PingPong ? kWarps / 2 : kWarps < kCopyWarps ? kWarps : kCopyWarps;  // warps that copy a KV tile
  static constexpr int kCopyRows = kKeys / kCopiers;                          // its rows per copying warp
  // fp8 pools only: the e4m3 bytes of the next tile land in a stage of their own (576 B a row)
  // and are widened into the one f16 stage, which makes the CTA small enough to run three to
  // an H200 SM (kMinCtasPerSm) where the 16-row CTA with two f16 stages runs two.
  static constexpr bool kFp8Staged = Fp8Staged;
  static constexpr int kKvBytes = Fp8Staged ? kStageBytes + kKeys * kDqk : kSmemKV;
  static constexpr int kMinCtasPerSm = Fp8Staged ? 3 : 1;
  static constexpr int kPartK = kDqk / DimParts / 16;              // k-steps per dim part
  static constexpr int kRowGroups = kWarps / DimGroups;            // O: warps per dim range
  static constexpr int kORowTiles = kRowTiles / kRowGroups;        // O: row tiles per warp
  static constexpr int kNT = kDv / 8 / DimGroups;                  // O: 8-dim tiles per warp
  // S partials: parts 0 and 1 own the softmax of rows g and g + 8 and hand the other half to
  // each other; every further part hands over both halves (2 kParts - 2 blocks of 8 x 32).
  static constexpr int kSmemS = kRowTiles * (2 * kParts - 2) * 8 * 32 * 4;
  static constexpr int kSmemP = kRows * kPStride * 2;
  static constexpr int kSmemBytes = kKvBytes + kSmemS + kSmemP + 2 * kRows * 4;
  static_assert(kSmemBytes <= 99 * 1024 - 1024, "must fit sm_120's 99 KB per block (static shared memory too)");
  static_assert(kRows * kRowPitch <= kKvBytes, "Q is staged through the KV buffers");
  static_assert(kCopyRows % 4 == 0 && kRows / kWarps % 4 == 0, "copy_rows: 4 rows x 8 lanes per pass");
  static_assert(kPartK * DimParts * 16 == kDqk && kORowTiles * kRowGroups == kRowTiles && kNT % 2 == 0);
  static_assert(!PingPong || (kRowGroups == 2 && kRowTiles % 2 == 0 && !Fp8Staged), "ping-pong: two halves of row tiles");
  static_assert(!PingPong || kCopyRows == 8, "ping-pong fp8: each half widens one of a copying thread's two rows");
};
// 64-row tiles: the ping-pong CTA, over both pools. Over an fp8 pool its halves share the
// widening (a copying thread's first row by the copying half as it lands, its second by the
// leading half): 6-8% faster than 8 warps in lockstep (H100, KDTREE_VERIFY_WGMMA=0, 1x128x9
// @128k 1.301 against 1.385 ms), where the copying half widening alone had been 5% slower.
using Cta64 = Cta<64, 2, 4, false, true>;
using Cta48 = Cta<48, 4, 4>;
using Cta16 = Cta<16, 4, 4>;  // requests of up to 16 rows: Cta48's warps of one row tile
using Cta16Fp8 = Cta<16, 4, 4, true>;
static_assert(Cta64::kRows == kRows, "the Hopper kernels' row tile");

template <typename Idx>
__device__ __forceinline__ void cp_async_idx(uint32_t dst, const Idx* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src),
               "n"(sizeof(Idx)), "r"(valid ? static_cast<int>(sizeof(Idx)) : 0));
}
// 8 bytes, for fp8 rows (src-size 0 zero-fills).
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Split `split` of row tile row0 of request b (cta_span) as a segment: its prefix split, and
// the tree's keys if it is the last.
template <typename T>
__device__ __forceinline__ Segment prefix_split_segment(const VerifyParams<T>& p, int b, int row0, int split) {
  Segment s{};
  s.b = b;
  if (b == kNoWork) return s;  // a tile past the work: the CTA returns (and reads no indptr)
  const CtaSpan c = cta_span(p, b, split);
  s.row0 = row0;
  s.q_begin = c.q_begin;
  s.rows_b = c.rows_b;
  s.kv_begin = c.kv_begin;
  s.prefix = c.prefix;
  s.key_begin = c.pre_begin;
  s.key_end = c.n_tiles > c.pre_tiles ? s.prefix + c.nodes : c.pre_end;
  s.direct = p.splits == 1;
  s.part = split * p.rows_total + static_cast<int64_t>(c.q_begin) * p.heads + row0;
  return s;
}

// Balanced: the balanced schedule (p.balanced > 0), segment after segment; otherwise the CTA's
// one split, and none of that schedule's code (see the seesaw kernel's Balanced).
template <typename C, typename T, typename Idx, bool Fp8, bool Balanced>
__global__ void __launch_bounds__(C::kThreads, C::kMinCtasPerSm) verify_attn_kernel(const VerifyParams<T> p) {
  using M = std::conditional_t<Fp8, Fp8Math, T>;  // the tensor-core operands
  constexpr int kRows = C::kRows, kRowTiles = C::kRowTiles, kParts = C::kParts, kWarps = C::kWarps;
  constexpr int kPartK = C::kPartK, kORowTiles = C::kORowTiles, kNT = C::kNT;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_kv = smem;
  float* s_part = reinterpret_cast<float*>(smem + C::kKvBytes);  // [row tiles][2 kParts - 2][8][32] S parts
  M* s_p = reinterpret_cast<M*>(smem + C::kKvBytes + C::kSmemS);  // [kRows][kPStride]
  float* s_alpha = reinterpret_cast<float*>(smem + C::kKvBytes + C::kSmemS + C::kSmemP);  // [kRows]
  float* s_l = s_alpha + kRows;                                                        // [kRows]
  __shared__ Segment s_seg;
  static_assert(Fp8 || !C::kFp8Staged, "a staged CTA reads fp8 pools only");
  constexpr bool kStaged = C::kFp8Staged;
  // Prefix slots of the next tiles, copied in by cp.async one tile ahead of the KV rows they
  // address, so issuing a tile's loads never waits on an index load from memory.
  __shared__ Idx s_slot[3][kKeys];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  // Ping-pong: this warp's half (0 leads, 1 copies the KV tiles).
  constexpr bool kPing = C::kPingPong;
  constexpr int kHalfWarps = kWarps / 2;
  const int half = kPing ? warp / kHalfWarps : 0;
  // Whether this warp copies KV tiles, and the first row it copies (and, over an fp8 pool,
  // converts), then every 4th of its C::kCopyRows: see copy_rows.
  const bool copier = kPing ? half == 1 : C::kCopiers == kWarps || warp < C::kCopiers;
  constexpr int kFirstCopier = kPing ? kHalfWarps : 0;  // also copies the slots of the tiles ahead
  const int own_row0 = (kPing ? warp % kHalfWarps : warp) * C::kCopyRows + (lane >> 3);

  // ---- which request, rows and keys: warp 0 finds the CTA's segment after `prev` (null: its
  // first); one segment (its split) unless balanced ----
  auto find_segment = [&](const Segment* prev) {
    Segment sg;
    if constexpr (Balanced) {
      sg = balanced_segment(p, lane, prev);
    } else {
      int req, row0;
      find_row_tile<T, kRows>(p, blockIdx.x, lane, req, row0);
      sg = prefix_split_segment(p, req, row0, blockIdx.y);
    }
    if (lane == 0) s_seg = sg;
  };
  if (warp == 0) find_segment(nullptr);
  __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The split merge, launched behind this kernel as a programmatic dependent (sm_90+), may
  // start once every CTA has passed here: its blocks take SMs as these CTAs retire and wait
  // on the device for the whole grid (a no-op after an ordinary launch).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

  // Warp first_warp + w copies rows [w * n, w * n + n) of a tile, four at a time: lane
  // (lane / 8, lane % 8) takes 16-byte chunks lane % 8, + 8, ..., + 64 of row 4 i + lane / 8, so
  // a row costs its lanes one address and nine copies at fixed offsets, and eight lanes read 128
  // contiguous bytes. (One row per pass over 32 lanes spent more issue slots on addresses and
  // predicates than S = Q K^T spends on mma.) src null: zero-fill (never NaN garbage).
  // first_warp is a constant at every call: passed the copying warp's index at run time, an
  // fp8 64-row CTA compiled differently on sm_120 and spilled.
  auto copy_rows = [&](uint8_t* dst, int rows_per_warp, int first_warp, auto src_of) {
    for (int i = 0; i < rows_per_warp; i += 4) {
      const int r = (warp - first_warp) * rows_per_warp + i + (lane >> 3);
      const T* src = src_of(r);
      const uint32_t d = smem_addr(dst + r * kRowPitch) + (lane & 7) * 16;
      const T* s = src ? src + (lane & 7) * 8 : p.kv;
#pragma unroll
      for (int c = 0; c < kChunks / 8; ++c) cp_async16(d + c * 128, s + c * 64, src != nullptr);
    }
  };

  for (Segment seg = s_seg; seg.b != kNoWork;) {
    const int b = seg.b, row0 = seg.row0, q_begin = seg.q_begin, rows_b = seg.rows_b, prefix = seg.prefix;
    // Its prefix keys [pre_begin, pre_end) in pre_tiles 32-key tiles, then its tree keys
    // [tree_begin, tree_end) (node indices).
    const int pre_begin = min(seg.key_begin, prefix), pre_end = min(seg.key_end, prefix);
    const int pre_tiles = (pre_end - pre_begin + kKeys - 1) / kKeys;
    const int tree_begin = max(seg.key_begin, prefix) - prefix, tree_end = max(seg.key_end, prefix) - prefix;
    const int n_tiles = pre_tiles + (tree_end - tree_begin + kKeys - 1) / kKeys;
    const Idx* kv_indices = static_cast<const Idx*>(p.kv_indices) + seg.kv_begin;

    // ---- stage Q (kRows rows x 576) through the KV buffers, then keep it in registers ----
    copy_rows(s_kv, kRows / kWarps, 0, [&](int r) -> const T* {
      const int m = row0 + r;
      if (m >= rows_b) return nullptr;
      const int node = m / p.heads, head = m - node * p.heads;
      return p.q + (q_begin + node) * p.q_st + head * p.q_sh;
    });
    auto load_slots = [&](int t) {  // warp 0; zero-filled past the chunk
      const int pos = pre_begin + t * kKeys + lane;
      const bool valid = t < pre_tiles && pos < pre_end;
      cp_async_idx(smem_addr(&s_slot[t % 3][lane]), valid ? kv_indices + pos : kv_indices, valid);
    };
    if (warp == kFirstCopier) {
      load_slots(0);
      load_slots(1);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // S: row tile rt, dim part dh. O: row tiles from o_tile0, dims from o_dim0. Ping-pong: the
    // half's row tiles, its warps dividing them as a CTA of its size would.
    constexpr int kHalfTiles = kRowTiles / 2;
    const int hw = warp - half * kHalfWarps;
    const int rt = kPing ? half * kHalfTiles + hw % kHalfTiles : warp % kRowTiles;
    const int dh = kPing ? hw / kHalfTiles : warp / kRowTiles;
    const int o_tile0 = kPing ? half * kORowTiles : warp % C::kRowGroups * kORowTiles;
    const int o_dim0 = kPing ? hw * kNT * 8 : warp / C::kRowGroups * kNT * 8;
    uint32_t qf[kPartK][4];
    {
      const uint32_t q_lane = smem_addr(s_kv + (rt * 16 + (lane & 15)) * kRowPitch + (dh * kPartK * 2 + (lane >> 4)) * 16);
#pragma unroll
      for (int ks = 0; ks < kPartK; ++ks) ldmatrix_x4(qf[ks], q_lane + ks * 32);
    }
    // fp8 pool: k_scale (and 1 / the power of two a bf16 q takes into f16) scale the scores in
    // float32, and k_scale the output (Fp8Math).
    const float k_scale = Fp8 ? kv_scale(p) : 1.f;
    bool range_bad = Fp8 && !k_scale_usable(k_scale);  // kGuardFp8Range
    float q_factor = 1.f;
    constexpr bool kQToF16 = Fp8 && std::is_same_v<T, __nv_bfloat16>;
    uint32_t* s_peak = reinterpret_cast<uint32_t*>(s_alpha);  // free until the first softmax
    if constexpr (kQToF16) {
      uint32_t peak = 0;
#pragma unroll
      for (int ks = 0; ks < kPartK; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) peak = peak_bits(peak, qf[ks][i]);
      peak = __reduce_max_sync(0xffffffffu, peak_bits_fold(peak));
      if (lane == 0) s_peak[warp] = peak;
    }
    __syncthreads();  // Q fully in registers before the KV stages overwrite it
    if constexpr (kQToF16) {
      uint32_t peak = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) peak = max(peak, s_peak[w]);
      q_factor = q_f16_factor(peak);
#pragma unroll
      for (int ks = 0; ks < kPartK; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = unpack2<T>(qf[ks][i]);
          qf[ks][i] = pack2<M>(f.x * q_factor, f.y * q_factor);
        }
    }
    const float score_scale = Fp8 ? p.scale_log2 * (k_scale / q_factor) : p.scale_log2;
    const float tree_to_pool = 1.f / k_scale;  // fp8: tree rows into the pool's units
    __shared__ float s_to_pool;  // the ping-pong CTA's copy (its registers are fuller)
    if (kPing && Fp8 && tid == 0) s_to_pool = tree_to_pool;

    bool bad = false;  // met a prefix slot outside kv_cache (checked_slot)
    // Staged CTA: the first stage holds the f16 tile the mma read; behind it the next tile's e4m3
    // bytes land in dense 576-byte rows, as 16-byte pieces (16 dims, 36 a row) copied by
    // cp.async.cg: thread (row, lane % 8) copies pieces lane % 8 + 8 k of its rows (the last
    // round lanes 0-3 only) and widens the same pieces itself, so no thread reads another's
    // copies before they are widened. Otherwise an fp8 row lands in the chunks its f16 values
    // will fill: chunk c's 8 bytes, in the chunk's first half, by an 8-byte cp.async (through
    // L1), copied and widened in place by one thread. On an H200 the staged CTA ran 64x16x1 @8k
    // 10% faster with the 16-byte L1-bypassing pieces than with 8-byte copies; the in-place CTAs
    // ran 11-25% slower with them (and from 2% faster to 7% slower with 16-byte pieces through
    // L1), so they keep the 8-byte copies.
    constexpr int kPieces = kDqk / 16, kPieceRounds = (kPieces + 7) / 8;
    auto piece_valid = [&](int k) { return k < kPieceRounds - 1 || (lane & 7) + 8 * k < kPieces; };
    auto staged_row = [&](int row) { return s_kv + kStageBytes + row * kDqk + (lane & 7) * 16; };
    auto load_tile = [&](int t, int stage) {
      const Idx* slots = s_slot[t % 3];
      if (copier) {
        if (Fp8 && t < pre_tiles) {
          // e4m3 bytes where the comment above puts them.
          const int first = pre_begin + t * kKeys;
#pragma unroll
          for (int i = 0; i < C::kCopyRows; i += 4) {
            const int own_row = own_row0 + i;
            const bool valid = first + own_row < pre_end;
            const uint8_t* src = p.kv8 + (lane & 7) * (kStaged ? 16 : 8);
            if (valid) src += static_cast<int64_t>(checked_slot(p, slots[own_row], bad)) * p.kv_stride;
            if constexpr (kStaged) {
              const uint32_t d = smem_addr(staged_row(own_row));
#pragma unroll
              for (int k = 0; k < kPieceRounds; ++k)
                if (piece_valid(k)) cp_async16(d + k * 128, src + k * 128, valid);
            } else {
              const uint32_t d = smem_addr(s_kv + stage * kStageBytes + own_row * kRowPitch) + (lane & 7) * 16;
#pragma unroll
              for (int c = 0; c < kChunks / 8; ++c) cp_async8(d + c * 128, src + c * 64, valid);
            }
          }
        } else if (kStaged) {
          // a tree tile: copied in its own iteration, straight into the f16 stage
        } else if (t < pre_tiles) {
          const int first = pre_begin + t * kKeys;
          copy_rows(s_kv + stage * kStageBytes, C::kCopyRows, kFirstCopier, [&](int k) -> const T* {
            return first + k < pre_end ? p.kv + static_cast<int64_t>(checked_slot(p, slots[k], bad)) * p.kv_stride : nullptr;
          });
        } else {
          const int first = tree_begin + (t - pre_tiles) * kKeys;
          copy_rows(s_kv + stage * kStageBytes, C::kCopyRows, kFirstCopier, [&](int k) -> const T* {
            return first + k < tree_end ? p.tree_k + static_cast<int64_t>(q_begin + first + k) * p.tk_stride : nullptr;
          });
        }
      }
      cp_async_commit();
    };

    // fp8 pool: this thread's chunks of a tree tile's rows (q's dtype, the pool's units times
    // k_scale), landed in `stage`, into f16 in the pool's units.
    // Rows own_row0 + i for i from i0 by di (the ping-pong halves take every other one).
    auto tree_rows_to_f16 = [&](uint8_t* stage, int i0, int di) {
      const float to_pool = kPing ? s_to_pool : tree_to_pool;
#pragma unroll
      for (int i = i0; i < C::kCopyRows; i += di) {
        uint8_t* row = stage + (own_row0 + i) * kRowPitch + (lane & 7) * 16;
#pragma unroll
        for (int c = 0; c < kChunks / 8; ++c)
          *reinterpret_cast<uint4*>(row + c * 128) =
              to_f16x8<T>(*reinterpret_cast<const uint4*>(row + c * 128), to_pool, range_bad);
      }
    };

    // fp8 pool: this thread's e4m3 bytes of a prefix tile's rows (staged, or in place in
    // `stage`) into f16 in `stage`.
    auto prefix_rows_to_f16 = [&](uint8_t* stage, int i0, int di) {
      // Staged: a lane's first store goes to the half (lane / 4) % 2 of its 32 bytes, so the 8
      // lanes of a row store to 8 distinct bank groups.
      const int first_half = (lane >> 2) & 1;
#pragma unroll
      for (int i = i0; i < C::kCopyRows; i += di) {
        const int row = own_row0 + i;
        if constexpr (kStaged) {
          uint8_t* dst = stage + row * kRowPitch + (lane & 7) * 32;
#pragma unroll
          for (int k = 0; k < kPieceRounds; ++k) {
            if (!piece_valid(k)) continue;
            const uint4 v = *reinterpret_cast<const uint4*>(staged_row(row) + k * 128);
            const uint2 lo = make_uint2(v.x, v.y), hi = make_uint2(v.z, v.w);
            uint8_t* chunks = dst + k * 256;
            *reinterpret_cast<uint4*>(chunks + first_half * 16) = widen_e4m3x8(first_half ? hi : lo);
            *reinterpret_cast<uint4*>(chunks + (first_half ^ 1) * 16) = widen_e4m3x8(first_half ? lo : hi);
          }
        } else {
          uint8_t* dst = stage + row * kRowPitch + (lane & 7) * 16;
#pragma unroll
          for (int c = 0; c < kChunks / 8; ++c)
            *reinterpret_cast<uint4*>(dst + c * 128) = widen_e4m3x8(*reinterpret_cast<const uint2*>(dst + c * 128));
        }
      }
    };

    // Per-lane fragment bases (stage 0); ldmatrix addresses add compile-time offsets to these.
    const int mi = lane >> 3;
    const uint32_t k_lane = smem_addr(s_kv + ((mi >> 1) * 8 + (lane & 7)) * kRowPitch + ((mi & 1) + dh * kPartK * 2) * 16);
    const uint32_t v_lane = smem_addr(s_kv + ((mi & 1) * 8 + (lane & 7)) * kRowPitch + (mi >> 1) * 16 + o_dim0 * 2);
    const uint32_t p_lane = smem_addr(s_p + (o_tile0 * 16 + (lane & 15)) * kPStride + (lane >> 4) * 8);

    float o[kORowTiles][kNT][4];
#pragma unroll
    for (int i = 0; i < kORowTiles; ++i)
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][j][e] = 0.f;
    // Softmax: warp (rt, dh < 2) owns row rt*16 + g + 8*dh; running max (log2 domain) and sum.
    const bool owner = kParts == 2 || dh < 2;
    float row_max = -INFINITY, row_sum = 0.f;
    const int my_row = rt * 16 + g + dh * 8;

    // Ping-pong's named barriers (0 is __syncthreads): each half's own, then by tile parity
    // "tile landed" (the copying half arrives, the leading half waits), "stage free" (the
    // leading half arrives, the copying half waits) and, over an fp8 pool, "widened" (the
    // leading half's rows of the tile are f16: it arrives, the copying half waits).
    constexpr int kBarHalf = 1, kBarLanded = 3, kBarFree = 5, kBarWidened = 7;
    // fp8 pool: rows own_row0 + i of tile t (i from i0 by di), landed in stage `stage`, -> f16
    // in place. Ping-pong: the copying half widens its first rows right after they land, the
    // leading half the others once it is told they have (split so neither waits on the other
    // for all of a tile's widening).
    auto own_rows_to_f16 = [&](int t, int stage, int i0, int di) {
      if (t >= pre_tiles) {
        tree_rows_to_f16(s_kv + stage * kStageBytes, i0, di);
      } else {
        prefix_rows_to_f16(s_kv + stage * kStageBytes, i0, di);
      }
    };
    // The barrier of the warps that share S parts, P and alpha: the CTA's, or the half's.
    auto rows_sync = [&] {
      if constexpr (kPing) named_sync(kBarHalf + half, kHalfWarps * 32); else __syncthreads();
    };
    // (int in and out, as __syncthreads_or: the lockstep CTAs compile as they did without it)
    auto rows_sync_or = [&](int v) -> int {
      if constexpr (kPing) return named_sync_or(kBarHalf + half, kHalfWarps * 32, v != 0); else return __syncthreads_or(v);
    };

    // Pipeline: tile t+1's rows (and tile t+2's slots) load while tile t computes. Ping-pong:
    // tile 0 lands for both halves here; then the copying half copies tile t+1 as soon as both
    // halves are done with tile t-1's stage (as it starts tile t, the leading half then halfway
    // through tile t) and tells the leading half once it has landed (halfway through its tile t,
    // when the leading half wants tile t+1). Those two waits keep the halves half a tile apart.
    if (n_tiles > 0) load_tile(0, 0);
    if constexpr (kPing) {
      cp_async_wait<0>();
      if (Fp8 && copier && n_tiles > 0) own_rows_to_f16(0, 0, 0, 4);
      __syncthreads();
    }
    for (int t = 0; t < n_tiles; ++t) {
      const int stage = kStaged ? 0 : t & 1;
      if constexpr (kPing) {
        if (copier) {
          rows_sync();  // the half is done with tile t-1's stage; tile t (its own copies) visible
          if (Fp8 && t >= 1) named_sync(kBarWidened + (t & 1), C::kThreads);  // and the leading half's rows
          if (t + 1 < n_tiles) {
            if (t >= 1) named_sync(kBarFree + ((t - 1) & 1), C::kThreads);  // and so is the leading half
            if (warp == kFirstCopier) load_slots(t + 2);
            load_tile(t + 1, stage ^ 1);
          }
        } else if (t >= 1) {
          named_sync(kBarLanded + (t & 1), C::kThreads);
          if constexpr (Fp8) {
            own_rows_to_f16(t, stage, 4, 8);
            named_arrive(kBarWidened + (t & 1), C::kThreads);
            rows_sync();  // the half's own widened rows
          }
        }
      } else if constexpr (kStaged) {
        cp_async_wait<0>();
        __syncthreads();  // iteration t-1 finished with the f16 stage; slots(t+1) visible
        if (copier && t < pre_tiles) {
          prefix_rows_to_f16(s_kv, 0, 4);
        } else if (copier) {
          const int first = tree_begin + (t - pre_tiles) * kKeys;
          copy_rows(s_kv, C::kCopyRows, kFirstCopier, [&](int k) -> const T* {
            return first + k < tree_end ? p.tree_k + static_cast<int64_t>(q_begin + first + k) * p.tk_stride : nullptr;
          });
          cp_async_commit();
          cp_async_wait<0>();
          tree_rows_to_f16(s_kv, 0, 4);
        }
        // The staged bytes are this thread's again: tile t+1's go there, after the reads above
        // (the copies are asm the compiler could otherwise move ahead of them).
        asm volatile("" ::: "memory");
        if (t + 1 < n_tiles) {
          if (warp == kFirstCopier) load_slots(t + 2);
          load_tile(t + 1, 0);
        }
        __syncthreads();  // tile t visible in f16
      } else {
        cp_async_wait<0>();
        // fp8 pool: this thread's own copies of tile t -> f16 in place (the same chunks either
        // way), before the barrier that publishes the tile: right behind the previous tile's
        // P V mma, which run on while these conversions issue, and with no barrier of their own.
        if (Fp8 && copier) own_rows_to_f16(t, stage, 0, 4);
        __syncthreads();  // tile t and slots(t+1) visible; iteration t-1 finished with its buffers
        if (t + 1 < n_tiles) {
          if (warp == kFirstCopier) load_slots(t + 2);
          load_tile(t + 1, stage ^ 1);
        }
      }
      const uint32_t stage_off = stage * kStageBytes;

      // ---- S part = Q[rows of rt, dims of dh] K^T ----
      float s[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kPartK; ++ks) {
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
          uint32_t bf[4];
          ldmatrix_x4(bf, k_lane + stage_off + j * 8 * kRowPitch + ks * 32);
          mma16816<M>(s[j], qf[ks], bf[0], bf[1]);
          mma16816<M>(s[j + 1], qf[ks], bf[2], bf[3]);
        }
      }
      // Each owner keeps the 8 rows it will normalise and hands the other 8 to its partner (block
      // dh of its row tile); a further part hands over both halves (blocks 2 dh - 2 and 2 dh - 1).
      // The halves are picked by select, not by s[j][2 * dh + e]: a register array indexed by a
      // runtime value lives in local memory (64 bytes of stack and 12 loads per tile).
      float* part = s_part + rt * ((2 * kParts - 2) * 8 * 32);
      if (owner) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) part[(dh * 8 + j * 2 + e) * 32 + lane] = dh ? s[j][e] : s[j][2 + e];
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[((2 * dh - 2 + e / 2) * 8 + j * 2 + e % 2) * 32 + lane] = s[j][e];
      }
      rows_sync();

      // ---- online softmax: the owners, 2 per row tile x (8 rows x 32 keys) ----
      bool rescaled = false;
      if (owner) {
        const bool tree_tile = t >= pre_tiles;
        const int key0 = tree_tile ? tree_begin + (t - pre_tiles) * kKeys : pre_begin + t * kKeys;
        const int key_end = tree_tile ? tree_end : pre_end;
        const float* other = part + (1 - dh) * 8 * 32;
        float x[8];
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float sum = (dh ? s[j][2 + e] : s[j][e]) + other[(j * 2 + e) * 32 + lane];
#pragma unroll
            for (int q = 2; q < kParts; ++q) sum += part[((2 * q - 2 + dh) * 8 + j * 2 + e) * 32 + lane];
            x[j * 2 + e] = sum * score_scale;
            if (key0 + j * 8 + t4 * 2 + e >= key_end) x[j * 2 + e] = -INFINITY;
          }
        if (tree_tile) {  // the ancestor mask (or the causal chain) applies to tree keys only
          const int m = row0 + my_row;
          const int node = m < rows_b ? m / p.heads : 0;
          const int32_t* mrow = p.mask ? p.mask + (q_begin + node) * p.mask_stride : nullptr;
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = key0 + j * 8 + t4 * 2 + e, w = key >> 5;
              const bool vis = mrow ? w < p.mask_words && ((mrow[w] >> (key & 31)) & 1) : key <= node;
              if (!vis) x[j * 2 + e] = -INFINITY;
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) mx = fmaxf(mx, x[i]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // -inf - -inf is NaN: a first visible max always counts as a move.
        rescaled = mx > row_max + kRescaleSlack || (row_max == -INFINITY && mx > -INFINITY);
        const float alpha = rescaled ? fast_exp2(row_max - mx) : 1.f;
        if (rescaled) row_max = mx;
        // A row with nothing visible yet keeps max -inf; subtract 0 then so exp gives 0.
        const float base = row_max == -INFINITY ? 0.f : row_max;
        float sum = 0.f;
        M* prow = s_p + my_row * kPStride;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float p0 = fast_exp2(x[j * 2] - base), p1 = fast_exp2(x[j * 2 + 1] - base);
          sum += p0 + p1;
          *reinterpret_cast<uint32_t*>(prow + j * 8 + t4 * 2) = pack2<M>(p0, p1);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        row_sum = row_sum * alpha + sum;
        if (t4 == 0) s_alpha[my_row] = alpha;
      }
      // Ping-pong: the copying half publishes tile t+1 to the leading half, past its softmax.
      if constexpr (kPing) {
        if (copier && t + 1 < n_tiles) {
          cp_async_wait<0>();
          if constexpr (Fp8) own_rows_to_f16(t + 1, stage ^ 1, 0, 8);
          named_arrive(kBarLanded + ((t + 1) & 1), C::kThreads);
        }
      }
      // ---- O = O * alpha (only when some row's max moved) + P V, this warp's rows and dims ----
      if (rows_sync_or(rescaled)) {
#pragma unroll
        for (int i = 0; i < kORowTiles; ++i) {
          const float a0 = s_alpha[(o_tile0 + i) * 16 + g], a1 = s_alpha[(o_tile0 + i) * 16 + g + 8];
#pragma unroll
          for (int j = 0; j < kNT; ++j) {
            o[i][j][0] *= a0;
            o[i][j][1] *= a0;
            o[i][j][2] *= a1;
            o[i][j][3] *= a1;
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t pf[kORowTiles][4];
#pragma unroll
        for (int i = 0; i < kORowTiles; ++i) ldmatrix_x4(pf[i], p_lane + (i * 16 * kPStride + kk * 16) * 2);
#pragma unroll
        for (int j = 0; j < kNT; j += 2) {
          uint32_t vf[4];
          ldmatrix_x4_trans(vf, v_lane + stage_off + kk * 16 * kRowPitch + j * 16);
#pragma unroll
          for (int i = 0; i < kORowTiles; ++i) {
            mma16816<M>(o[i][j], pf[i], vf[0], vf[1]);
            mma16816<M>(o[i][j + 1], pf[i], vf[2], vf[3]);
          }
        }
      }
      if constexpr (kPing) {
        if (!copier && t + 2 < n_tiles) named_arrive(kBarFree + (t & 1), C::kThreads);
      }
    }

    // ---- finish: share each row's max and sum, normalise, write ----
    // The last tile's PV has read s_alpha; did any warp meet a slot outside kv_cache?
    const bool malformed = b == kMalformedBatch;  // rows to write NaN, no keys (find_row_tile)
    // The ping-pong CTA reads these again rather than holding them through the tiles, where
    // its registers are fuller; before the barrier past which warp 0 may write the next segment.
    const bool direct = kPing ? s_seg.direct : seg.direct;
    const int64_t part = kPing ? s_seg.part : seg.part;
    const bool slot_cta = __syncthreads_or(bad), range_cta = Fp8 && __syncthreads_or(range_bad);
    const bool bad_cta = slot_cta || range_cta || malformed;
    if (owner && t4 == 0) {
      s_alpha[my_row] = row_max;
      s_l[my_row] = row_sum;
    }
    __syncthreads();
    if (bad_cta && tid == 0)
      raise_guard(p.guard, malformed ? kGuardVerifyIndptr : slot_cta ? kGuardKvSlot : kGuardFp8Range);
#pragma unroll
    for (int i = 0; i < kORowTiles; ++i)
#pragma unroll
      for (int up = 0; up < 2; ++up) {
        const int r = (o_tile0 + i) * 16 + g + up * 8, m = row0 + r;
        if (m >= rows_b) continue;
        const float l = s_l[r];
        const float inv = bad_cta ? kNaN : l > 0.f ? k_scale / l : 0.f;
        const float lse = bad_cta ? kNaN : l > 0.f ? (s_alpha[r] + __log2f(l)) * 0.69314718055994531f : -INFINITY;
        const int node = m / p.heads, head = m - node * p.heads;
        if (direct) {
          T* dst = p.out + (q_begin + node) * p.out_st + head * p.out_sh + o_dim0 + t4 * 2;
#pragma unroll
          for (int j = 0; j < kNT; ++j)
            *reinterpret_cast<uint32_t*>(dst + j * 8) =
                pack2<T>(o[i][j][up * 2] * inv, o[i][j][up * 2 + 1] * inv);
          if (o_dim0 == 0 && t4 == 0) p.lse[(q_begin + node) * p.lse_st + head * p.lse_sh] = lse;
        } else {
          float* dst = p.part_o + (part + r) * kDv + o_dim0 + t4 * 2;
#pragma unroll
          for (int j = 0; j < kNT; ++j)
            *reinterpret_cast<float2*>(dst + j * 8) =
                make_float2(o[i][j][up * 2] * inv, o[i][j][up * 2 + 1] * inv);
          if (o_dim0 == 0 && t4 == 0) p.part_lse[part + r] = lse;
        }
      }
    if constexpr (!Balanced) break;
    // The next segment, once every warp is past this one's epilogue (s_alpha, s_l, the stages).
    if (warp == 0) {
      if constexpr (kPing) {
        const Segment done = s_seg;  // not held in registers: see the epilogue
        find_segment(&done);
      } else {
        find_segment(&seg);
      }
    }
    __syncthreads();
    seg = s_seg;
  }
}

// Enough splits for one row tile to fill an H200 twice (16-row CTAs run two per SM).
constexpr int64_t kMaxSplits = 256;
// The most f16 workspace the widened fp8 route takes (a prefix row of 576 values: 1,152 bytes;
// 1 GiB holds about 930k rows, e.g. 7 requests of 128k); past it an fp8 pool keeps the fp8 path.
constexpr int64_t kWidenBytesCap = int64_t{1} << 30;

// Blocks (t, h) row x dim part: merge the splits' partials by log-sum-exp. gridDim.y = parts
// in {1, 2, 4, 8, 16}: a block merges 512 / parts dims with parts streams of threads, each
// stream taking every parts-th batch of splits. Rows of few requests need the parts: 16 rows
// over 256 splits are 8 MB of partials, which 16 blocks read too few at a time. Under the
// balanced schedule a row's partials are those of the CTAs of its plane whose shares meet its
// row tile; a row of a tile one CTA held whole was written by that CTA.
template <typename T, bool Balanced>
__global__ void __launch_bounds__(128) merge_splits_kernel(const VerifyParams<T> p) {
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_lse;
  __shared__ float4 s_acc[128];
  __shared__ int s_parts;
  __shared__ int64_t s_first, s_step, s_tail;
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, parts = gridDim.y;
  const int stream_lanes = 128 / parts, stream = tid / stream_lanes;
  // Partial s of this row is partial row first + s * step (+ tail for s = 0), if it was
  // written (has). Equal splits: constants every thread knows (as compile-time as they can be:
  // through shared memory they cost batch-1 merges about a microsecond on an H200).
  int n = p.splits;
  int64_t first = row, step = p.rows_total, tail = 0;
  int c_first = 0;
  BalancedWork w{};
  if (tid < 32) {
    if constexpr (Balanced) {
      const int64_t t = row / p.heads;
      auto at_row = [&](int64_t q0, int64_t q1, int64_t, int64_t) { return t >= q0 && t < q1; };
      n = 0;  // a malformed batch: the kernel wrote the row
      w = scan_work(p, tid, 0, at_row);
      if (w.b >= 0) {
        const int64_t m = (t - w.q_begin) * p.heads + row % p.heads;
        const int tile = static_cast<int>(m / p.tile_rows), plane = min(tile, p.planes - 1), unit = tile - plane;
        if (plane > 0) w = scan_work(p, tid, plane, at_row);  // plane 0's is the scan above
        const int64_t unit_start = w.work0 + static_cast<int64_t>(unit) * w.chunks;
        c_first = share_of(w.work, p.balanced, unit_start);
        n = share_of(w.work, p.balanced, unit_start + w.chunks - 1) - c_first + 1;
        // The first of these CTAs met the unit in its share's last segment unless its share
        // starts with the unit; every further one in its first.
        first = share_partial(p, plane, c_first, false) + m % p.tile_rows;
        step = 2 * p.tile_rows;
        if (share_begin(w.work, p.balanced, c_first) < unit_start) tail = p.tile_rows;
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched behind the seesaw or portable kernel as a programmatic dependent: its partials
  // are complete and visible only after this (a no-op after an ordinary launch). Which
  // partials a row has comes from the batch's index arrays, written before that kernel
  // started: found above, under its last CTAs.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  if (tid < 32) {
    // Under the balanced schedule a CTA with an empty share (W_r < G) wrote nothing.
    auto has = [&](int s) {
      return !Balanced || share_begin(w.work, p.balanced, c_first + s) < share_begin(w.work, p.balanced, c_first + s + 1);
    };
    auto lse_of = [&](int s) { return has(s) ? p.part_lse[first + s * step + (s == 0 ? tail : 0)] : -INFINITY; };
    float mx = -INFINITY;
    for (int s = tid; s < n; s += 32) mx = fmaxf(mx, lse_of(s));
#pragma unroll
    for (int off = 16; off; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float base = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
    for (int s = tid; s < n; s += 32) {
      const float w = __expf(lse_of(s) - base);
      s_w[s] = w;
      sum += w;
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int s = tid; s < n; s += 32) s_w[s] *= inv;
    // A NaN partial (a bad slot or a malformed batch) makes sum NaN: the row stays NaN.
    if (tid == 0) {
      s_lse = sum > 0.f ? base + __logf(sum) : sum == 0.f ? -INFINITY : sum;
      if constexpr (Balanced) {
        s_parts = n;
        s_first = first;
        s_step = step;
        s_tail = tail;
      }
    }
  }
  __syncthreads();
  if constexpr (Balanced) {
    n = s_parts;
    first = s_first;
    step = s_step;
    tail = s_tail;
    if (n <= 1) return;
  }
  // Loads in batches of eight splits before their sums: one at a time, each would wait a
  // full memory latency.
  constexpr int kBatch = 8;
  const int dim = blockIdx.y * (kDv / parts) + (tid - stream * stream_lanes) * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = stream * kBatch; s0 < n; s0 += parts * kBatch) {
    float w[kBatch];
    float4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      w[i] = s0 + i < n ? s_w[s0 + i] : 0.f;
      // An empty split's values were never written: not read, so they cannot bring a NaN.
      const int64_t prow = first + (s0 + i) * step + (s0 + i == 0 ? tail : 0);
      v[i] = w[i] != 0.f ? *reinterpret_cast<const float4*>(p.part_o + prow * kDv + dim)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      acc.x += w[i] * v[i].x;
      acc.y += w[i] * v[i].y;
      acc.z += w[i] * v[i].z;
      acc.w += w[i] * v[i].w;
    }
  }
  s_acc[tid] = acc;
  __syncthreads();
  if (stream > 0) return;
  for (int k = 1; k < parts; ++k) {
    const float4 a = s_acc[tid + k * stream_lanes];
    acc.x += a.x;
    acc.y += a.y;
    acc.z += a.z;
    acc.w += a.w;
  }
  const int64_t node = row / p.heads, head = row - node * p.heads;
  T* dst = p.out + node * p.out_st + head * p.out_sh + dim;
  *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w));
  if (tid == 0 && blockIdx.y == 0) p.lse[node * p.lse_st + head * p.lse_sh] = s_lse;
}

// The portable kernel's row tile. A 48-row CTA streams its keys once per 48 rows instead of 64,
// so it pays only where 64-row tiles pad many rows: on an H200, requests of 144 rows (16 heads x
// 9 nodes) ran 1.08-1.14x faster on 48-row tiles, and requests that 64-row tiles fill exactly
// 0.58-0.90x as fast. So 48 when 64-row tiles cover at least 1.2 times the rows 48-row tiles do
// (144 rows: 192 against 144), which also means 64-row tiles pad a fifth or more. Against the
// ping-pong 64-row CTA the 144-row requests still favour 48 rows where mma.sync is slow:
// on an H100 with every mma issued twice (sm_120's tensor rate per byte) 48-row tiles ran them
// 1.08-1.15x faster, at the H100's own rate 0.92-0.98x as fast. A request of
// at most 16 rows (16 heads x 1 node, 8 heads x 2) takes a 16-row CTA: any other pads two
// thirds of its tensor-core work or more, and it still streams its keys once. Every request
// is taken to have T / batch nodes (SGLang pads trees to one size, as the split count assumes),
// so the padding is the same per request as summed over the batch; unequal trees keep 64.
// KDTREE_VERIFY_ROWS=16, 48 or 64 forces one. Shapes only: graph-capturable.
int portable_rows(int64_t T, int64_t H, int64_t batch) {
  const std::optional<std::string> forced = env_setting("KDTREE_VERIFY_ROWS");
  if (forced == "16") return Cta16::kRows;
  if (forced == "48") return Cta48::kRows;
  if (forced == "64") return Cta64::kRows;
  if (T % batch != 0) return Cta64::kRows;
  const int64_t rows = T / batch * H;
  if (rows <= Cta16::kRows) return Cta16::kRows;
  const int64_t padded64 = ceil_div(rows, Cta64::kRows) * int64_t{Cta64::kRows};
  const int64_t padded48 = ceil_div(rows, Cta48::kRows) * int64_t{Cta48::kRows};
  return 5 * padded64 >= 6 * padded48 ? Cta48::kRows : Cta64::kRows;
}

// CTAs of shape C one SM runs at once, as its registers and shared memory allow (16-row CTAs:
// two on an H200, one on sm_120; the others one). Asked of the fp8 variants with the most static
// shared memory (int64 slots), either schedule's (the fewer), once per device. No stream work:
// graph-capturable.
template <typename C>
int64_t portable_ctas_per_sm(const at::Tensor& on) {
  return once_per_device(on.get_device(), [] {
    int ctas = INT32_MAX;
    for (auto kernel : {verify_attn_kernel<C, __nv_bfloat16, int64_t, true, false>,
                        verify_attn_kernel<C, __nv_bfloat16, int64_t, true, true>}) {
      allow_dynamic_smem(kernel, C::kSmemBytes);
      int fit = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, C::kThreads, C::kSmemBytes));
      ctas = std::min(ctas, fit);
    }
    return int64_t{std::max(ctas, 1)};
  });
}

// fp8: the pool holds e4m3 bytes (a staged CTA reads no other).
template <typename C, typename T>
void launch_portable(const VerifyParams<T>& p, bool fp8, bool idx32, dim3 grid) {
  auto kernel = with_flag(fp8, [&](auto fp8_pool) {
    return with_flag(p.balanced > 0, [&](auto balanced) {
      return with_flag(idx32, [&](auto i32) {
        return verify_attn_kernel<C, T, SlotIndex<decltype(i32)>, decltype(fp8_pool)::value || C::kFp8Staged,
                                  decltype(balanced)::value>;
      });
    });
  });
  allow_dynamic_smem(kernel, C::kSmemBytes);
  kernel<<<grid, C::kThreads, C::kSmemBytes, current_stream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool is_fp8_pool(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kByte || kv_cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
}

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& q, int64_t rows) {
  check_cuda(t, name, q);
  if (rows < 0) {  // the pool: q's dtype or e4m3 bytes
    KD_CHECK(t.scalar_type() == q.scalar_type() || is_fp8_pool(t), name, " must be torch.",
             dtype_name(q.scalar_type()), " like q, or float8_e4m3fn / uint8 (e4m3 bytes), got torch.",
             dtype_name(t.scalar_type()));
  } else {
    KD_CHECK(t.scalar_type() == q.scalar_type(), name, " must be ", dtype_name(q.scalar_type()),
             " like q, got ", dtype_name(t.scalar_type()));
  }
  KD_CHECK((t.dim() == 2 && t.size(1) == kDqk) || (t.dim() == 3 && t.size(1) == 1 && t.size(2) == kDqk),
           name, " must be [", rows < 0 ? "S" : std::to_string(rows), ", 576] or [..., 1, 576], got ",
           t.sizes());
  if (rows >= 0) KD_CHECK(t.size(0) == rows, name, " must have ", rows, " rows like q, got ", t.size(0));
  check_last_contiguous(t, name);
  const int64_t per16 = 16 / t.element_size();
  KD_CHECK(t.stride(0) % per16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
           " rows must be 16-byte aligned (row stride a multiple of ", per16, " elements), got stride ",
           t.stride(0));
}

void check_indptr(const at::Tensor& t, const char* name, const at::Tensor& q, int64_t size) {
  check_cuda(t, name, q);
  check_dim(t, name, 1);
  check_index(t, name);
  KD_CHECK(t.is_contiguous(), name, " must be contiguous");
  if (size >= 0) KD_CHECK(t.size(0) == size, name, " must have ", size, " entries (batch + 1), got ", t.size(0));
  KD_CHECK(t.size(0) >= 1, name, " must have batch + 1 >= 1 entries");
}

void verify_attn_out(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indptr,
                     const at::Tensor& kv_indices, const at::Tensor& qo_indptr,
                     const at::Tensor& tree_k, const std::optional<at::Tensor>& tree_mask,
                     double sm_scale, const at::Tensor& out, const at::Tensor& lse,
                     int64_t max_kv_len, const std::optional<at::Tensor>& k_scale, double k_scale_value) {
  KD_CHECK(q.is_cuda(), "q must be a CUDA tensor, got device ", q.device());
  check_dim(q, "q", 3);
  KD_CHECK(q.size(2) == kDqk, "q must be [T, H, 576] (512 absorbed nope + 64 rope), got ", q.sizes());
  KD_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
           "q must be bfloat16 or float16, got ", dtype_name(q.scalar_type()));
  check_last_contiguous(q, "q");
  KD_CHECK(q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
           "q rows must be 16-byte aligned, got strides ", q.strides());
  const int64_t T = q.size(0), H = q.size(1);
  check_rows(kv_cache, "kv_cache", q, -1);
  const bool fp8 = is_fp8_pool(kv_cache);
  if (!fp8) {
    KD_CHECK(!k_scale && k_scale_value == 1.0, "k_scale applies to an fp8 kv_cache only (kv_cache is torch.",
             dtype_name(kv_cache.scalar_type()), ")");
  }
  KD_CHECK(std::fabs(k_scale_value) <= FLT_MAX && k_scale_usable(static_cast<float>(k_scale_value)),
           "k_scale must be finite and positive (a normal float32, >= 2^-126), got ", k_scale_value);
  if (k_scale) {
    KD_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->dim() <= 1 && k_scale->numel() == 1,
             "k_scale must be a float32 tensor of one element, got torch.", dtype_name(k_scale->scalar_type()), " ",
             k_scale->sizes());
    check_cuda(*k_scale, "k_scale", q);
  }
  check_rows(tree_k, "tree_k", q, T);
  check_indptr(kv_indptr, "kv_indptr", q, -1);
  check_indptr(qo_indptr, "qo_indptr", q, kv_indptr.size(0));
  check_cuda(kv_indices, "kv_indices", q);
  check_dim(kv_indices, "kv_indices", 1);
  check_index(kv_indices, "kv_indices");
  KD_CHECK(kv_indices.is_contiguous(), "kv_indices must be contiguous");
  // The kernels hold indptr entries (positions in kv_indices, rows of q) as int, and the Hopper
  // kernel's producer a slot (no device holds 2^31 rows of 576 bytes).
  KD_CHECK(kv_indices.size(0) < (int64_t{1} << 31), "kv_indices must have fewer than 2^31 entries, got ",
           kv_indices.size(0));
  KD_CHECK(kv_cache.size(0) < (int64_t{1} << 31), "kv_cache must have fewer than 2^31 rows, got ", kv_cache.size(0));
  if (tree_mask) {
    const at::Tensor& m = *tree_mask;
    check_cuda(m, "tree_mask", q);
    check_dim(m, "tree_mask", 2);
    check_dtype(m, "tree_mask", at::kInt);
    KD_CHECK(m.size(0) == T && m.size(1) >= 1, "tree_mask must be [", T, ", ceil(max_nodes/32)], got ", m.sizes());
    check_last_contiguous(m, "tree_mask");
  }
  check_cuda(out, "out", q);
  KD_CHECK(out.dim() == 3 && out.size(0) == T && out.size(1) == H && out.size(2) == kDv,
           "out must be [", T, ", ", H, ", 512], got ", out.sizes());
  KD_CHECK(out.scalar_type() == q.scalar_type(), "out must be ", dtype_name(q.scalar_type()), " like q, got ", dtype_name(out.scalar_type()));
  check_last_contiguous(out, "out");
  KD_CHECK(out.stride(0) % 4 == 0 && out.stride(1) % 4 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0,
           "out rows must be 8-byte aligned, got strides ", out.strides());
  check_cuda(lse, "lse", q);
  KD_CHECK(lse.dim() == 2 && lse.size(0) == T && lse.size(1) == H, "lse must be [", T, ", ", H, "], got ", lse.sizes());
  check_dtype(lse, "lse", at::kFloat);
  KD_CHECK(q.size(1) >= 1, "q must have at least one head");
  KD_CHECK(T * H < (int64_t{1} << 31) / kDv, "T * H = ", T * H, " rows is too large");

  const int64_t batch = kv_indptr.size(0) - 1;
  if (T == 0 || batch == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());

  // KDTREE_VERIFY_ROWS=48 or 64 keeps sm_90's small fp8 requests on the Hopper kernel.
  const int portable = portable_rows(T, H, batch);
  const VerifyKernel which = pick_verify_kernel(sm_scale, fp8, fp8 && portable == Cta16::kRows);
  const int rows = which == VerifyKernel::kPortable ? portable : which == VerifyKernel::kFp8 ? kFp8CtaRows : kRows;
  // Grid: one CTA per (request, row tile) and prefix split. The tile count bound and the
  // split count depend only on shapes and host hints, so the launch is graph-capturable.
  const int64_t tiles = ceil_div(T * H, rows) + batch;
  // Row tiles that carry work: exact when every request has T / B nodes (SGLang pads trees to
  // one size), otherwise the unpadded count.
  const int64_t work_tiles = T % batch == 0 ? batch * ceil_div(T / batch * H, rows) : ceil_div(T * H, rows);
  // Fewest waves per unit of prefix: time ~ ceil(tiles * s / slots) / s; among equals take the
  // smallest s (less to merge). Short prefixes (hint) are not cut below 256 keys per split
  // (128, one tile pair, for the seesaw kernel).
  // Splitting only pays while the row tiles alone leave SMs idle: each split re-reads Q and
  // writes a 2 KB partial per row.
  // Past 64 splits (and so only with a hint) a split keeps at least 512 keys: a 64-row tile's
  // Q and partials cost 330 KB per split, as much as 290 keys (1x16x4 @32k on an H200: 132
  // splits of 248 keys ran 0.059 ms, 64 splits of 512 keys 0.050).
  const int64_t split_cap = max_kv_len >= 0 ? std::max<int64_t>(64, max_kv_len / 512) : 64;
  const bool seesaw_merge = which == VerifyKernel::kSeesaw || which == VerifyKernel::kFp8;
  const int64_t min_split_keys = seesaw_merge ? 128 : 256;
  auto splits_for = [&](int64_t slots) {
    int64_t max_split = std::min({kMaxSplits, split_cap, (2 * slots + work_tiles - 1) / work_tiles});
    if (max_kv_len >= 0) max_split = std::clamp<int64_t>(max_kv_len / min_split_keys, 1, max_split);
    if (work_tiles >= slots) max_split = 1;
    int64_t best_s = 1;
    double best = 1e30;
    for (int64_t s = 1; s <= max_split; ++s) {
      const double cost = static_cast<double>((work_tiles * s + slots - 1) / slots) / s;
      if (cost < best * 0.999) {
        best = cost;
        best_s = s;
      }
    }
    return best_s;
  };
  // One CTA per SM (registers; shared memory on sm_90), but for 16-row CTAs. Over an fp8 pool
  // a 16-row CTA stages the next tile's e4m3 bytes instead of a second f16 tile where that
  // fits more CTAs on an SM (three against two on an H200; as many on sm_120), and only for
  // grids that fill those extra places: a CTA with an SM share to itself runs faster with two
  // f16 tiles (H200, 1x16x1 @128k, 256 CTAs: 0.0671 ms staged against 0.0572).
  const DeviceFacts device = device_facts(q);
  const int sms = device.sms;
  const bool rows16 = which == VerifyKernel::kPortable && rows == Cta16::kRows;
  const int64_t per_sm16 = rows16 ? portable_ctas_per_sm<Cta16>(q) : 1;
  int64_t slots = sms * per_sm16;
  int64_t splits = splits_for(slots);
  bool staged16 = false;
  if (rows16 && fp8) {
    const int64_t staged_slots = sms * portable_ctas_per_sm<Cta16Fp8>(q), staged_splits = splits_for(staged_slots);
    staged16 = staged_slots > slots && work_tiles * staged_splits > slots;
    if (staged16) {
      splits = staged_splits;
      slots = staged_slots;
    }
  }
  KD_CHECK(tiles < (int64_t{1} << 31), "too many rows");
  // The seesaw and the portable kernels take a batch on the balanced schedule (BalancedWork:
  // the same share of the whole batch's work on every SM) unless the requests have equal
  // trees and their row tiles x splits fill one wave to 95% or more. Equal splits of each
  // request wait on the longest one: on an H200 the balanced schedule ran batches whose
  // lengths spread from 1k-2k to 32k-64k 1.20-2.00x faster on the seesaw kernel and 1.37-2.54x
  // on the portable one; equal lengths 0.96-0.97x and 1.00-1.09x as fast, and, where one wave
  // of whole requests fills the SMs (64 x 128 x 1 @8k: every share then ends in a partial),
  // 0.76x and 0.94x. KDTREE_VERIFY_BALANCE=0 or 1 forces the choice.
  const int64_t planned = work_tiles * splits;
  const bool one_full_wave = T % batch == 0 && planned <= slots && 20 * planned >= 19 * slots;
  const bool balanced = which != VerifyKernel::kWgmma && env_flag("KDTREE_VERIFY_BALANCE", batch > 1 && !one_full_wave);
  // Planes: the row tiles of a request of T / B nodes (a request with more takes its further
  // tiles in the last plane); CTAs per plane: the SMs' share of one plane, or, with a hint, so
  // that each keeps two tile pairs on average.
  const int64_t planes = T % batch == 0 ? std::max<int64_t>(1, ceil_div(T / batch * H, rows)) : 1;
  int64_t plane_ctas = std::clamp<int64_t>(slots / planes, 1, kMaxSplits);
  if (max_kv_len >= 0) {
    const int64_t plane_work_bound = batch * ceil_div(max_kv_len + T / batch, kChunkKeys);
    plane_ctas = std::clamp<int64_t>(plane_work_bound / 2, 1, plane_ctas);
  }

  // One CTA a plane takes each of the plane's units whole and writes the output itself: no
  // partials, and no merge, whose blocks would only find that out (1 x 128 x 65 @32k on the
  // balanced schedule, H100: 39 us of merge for nothing).
  const bool merge = balanced ? plane_ctas > 1 : splits > 1;
  // The widened route: an fp8 pool on the seesaw kernel is first widened, every prefix row once,
  // into an f16 workspace in the pool's units (launch_widen_fp8_pool), which the kernel then reads
  // as a 16-bit pool (tensor-map boxes throughout: the workspace is contiguous), with the fp8
  // path's numerics and output bits. The fp8 path widens each row once per row tile that reads
  // it; the route costs 1,728 more bytes a prefix row before the kernel instead. On an H100 it
  // paid from 9 row tiles a request (528-576 rows: 1.03-1.04x over pages, 1.17x over scattered
  // slots; 384 rows: 0.95x) up to 1.55x (pages) and 1.82x (scattered) at 8,320 rows
  // (BENCHMARKS.md). KDTREE_VERIFY_FP8_WIDEN=0 or 1 forces the choice; never past
  // kWidenBytesCap of workspace.
  const int64_t widen_rows = std::max<int64_t>(kv_indices.size(0), 1);
  const bool widen = fp8 && which == VerifyKernel::kSeesaw && batch <= 65535 &&
                     (widen_rows + T) * kDqk * 2 <= kWidenBytesCap &&
                     env_flag("KDTREE_VERIFY_FP8_WIDEN", work_tiles >= 9 * batch);
  at::Tensor part_o, part_lse;
  if (merge && balanced) {
    const int64_t partials = planes * plane_ctas * 2;  // share_partial
    part_o = at::empty({partials * rows, kDv}, q.options().dtype(at::kFloat));
    part_lse = at::empty({partials * rows}, q.options().dtype(at::kFloat));
  } else if (merge) {
    part_o = at::empty({splits, T * H, kDv}, q.options().dtype(at::kFloat));
    part_lse = at::empty({splits, T * H}, q.options().dtype(at::kFloat));
  }

  dispatch_half(q.scalar_type(), "q", [&](auto tag) {
    using T_ = decltype(tag);
    VerifyParams<T_> p{};
    p.q = static_cast<const T_*>(q.data_ptr());
    p.q_st = q.stride(0);
    p.q_sh = q.stride(1);
    p.kv = static_cast<const T_*>(kv_cache.data_ptr());
    p.kv8 = fp8 ? static_cast<const uint8_t*>(kv_cache.data_ptr()) : nullptr;
    p.kv_stride = kv_cache.stride(0);
    p.k_scale_ptr = k_scale ? k_scale->data_ptr<float>() : nullptr;
    p.k_scale = static_cast<float>(k_scale_value);
    p.tree_k = static_cast<const T_*>(tree_k.data_ptr());
    p.tk_stride = tree_k.stride(0);
    p.kv_indptr = index_view(kv_indptr);
    p.kv_indices = kv_indices.data_ptr();
    p.qo_indptr = index_view(qo_indptr);
    p.mask = tree_mask ? tree_mask->data_ptr<int32_t>() : nullptr;
    p.mask_stride = tree_mask ? tree_mask->stride(0) : 0;
    p.mask_words = tree_mask ? static_cast<int>(tree_mask->size(1)) : 0;
    p.batch = static_cast<int>(batch);
    p.heads = static_cast<int>(H);
    p.splits = balanced ? 1 : static_cast<int>(splits);
    p.balanced = balanced ? static_cast<int>(plane_ctas) : 0;
    p.planes = static_cast<int>(planes);
    p.tile_rows = rows;
    p.scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);
    p.out = static_cast<T_*>(out.data_ptr());
    p.out_st = out.stride(0);
    p.out_sh = out.stride(1);
    p.lse = lse.data_ptr<float>();
    p.lse_st = lse.stride(0);
    p.lse_sh = lse.stride(1);
    p.part_o = merge ? part_o.data_ptr<float>() : nullptr;
    p.part_lse = merge ? part_lse.data_ptr<float>() : nullptr;
    p.rows_total = T * H;
    p.kv_rows = kv_cache.size(0);
    p.n_indices = kv_indices.size(0);
    p.tokens = static_cast<int>(T);
    p.guard = guard_words();

    const bool idx32 = kv_indices.scalar_type() == at::kInt;
    at::Tensor widened, req_bad;  // the widened route's workspace: prefix rows, then tree rows
    if (widen) {
      widened = at::empty({widen_rows + T, kDqk}, q.options().dtype(at::kHalf));
      req_bad = at::empty({batch}, q.options().dtype(at::kInt)).zero_();
      auto* ws_rows = reinterpret_cast<__half*>(widened.data_ptr());
      auto* ws_tree = ws_rows + widen_rows * kDqk;
      launch_widen_fp8_pool(p, idx32, ws_rows, ws_tree, req_bad.data_ptr<int32_t>(), sms, current_stream());
      p.kv = reinterpret_cast<const T_*>(ws_rows);
      p.kv8 = nullptr;
      p.kv_stride = kDqk;
      p.kv_rows = widen_rows;
      p.tree_k = reinterpret_cast<const T_*>(ws_tree);
      p.tk_stride = kDqk;
      p.req_bad = req_bad.data_ptr<int32_t>();
    }
    const dim3 grid = balanced ? dim3(static_cast<unsigned>(planes), static_cast<unsigned>(plane_ctas))
                               : dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
    if (which == VerifyKernel::kPortable && rows == Cta48::kRows) {
      launch_portable<Cta48>(p, fp8, idx32, grid);
    } else if (staged16) {
      launch_portable<Cta16Fp8>(p, fp8, idx32, grid);
    } else if (rows16) {
      launch_portable<Cta16>(p, fp8, idx32, grid);
    } else if (which == VerifyKernel::kPortable) {
      launch_portable<Cta64>(p, fp8, idx32, grid);
    } else {
      // Tensor-map boxes pay where a CTA streams at least two tile pairs (256 keys): over one
      // (H200, 1x16x9 @4k: 32 splits of 128 keys) the instance without them ran 4-6% faster,
      // paged or scattered. (The balanced schedule gives a CTA two on average.)
      const bool boxes = balanced || max_kv_len < 0 || max_kv_len >= 256 * splits;
      launch_verify_attn_sm90(which, p, idx32, boxes, grid, current_stream());
    }
    if (merge) {
      // Behind the seesaw and portable kernels (sm_90+), a programmatic dependent launch: the
      // merge's blocks start as that kernel's CTAs retire and wait on the device
      // (griddepcontrol.wait) for all of it, instead of the host-side gap between two launches.
      cudaLaunchAttribute pdl{};
      pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      pdl.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t cfg{};
      // Dim parts per row: at least four blocks per SM where rows are few.
      int64_t parts = 1;
      while (parts < 16 && T * H * parts < 4 * sms) parts *= 2;
      cfg.gridDim = dim3(static_cast<unsigned>(T * H), static_cast<unsigned>(parts));
      cfg.blockDim = dim3(128);
      cfg.stream = current_stream();
      cfg.attrs = &pdl;
      // The kernels that signal the merge (griddepcontrol.launch_dependents): kWgmma does not.
      const bool signalled = seesaw_merge || (which == VerifyKernel::kPortable && device.major >= 9);
      cfg.numAttrs = signalled ? 1 : 0;
      auto merge_kernel = with_flag(balanced, [](auto b) { return merge_splits_kernel<T_, decltype(b)::value>; });
      C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, merge_kernel, p));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> verify_attn(const at::Tensor& q, const at::Tensor& kv_cache,
                                               const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                               const at::Tensor& qo_indptr, const at::Tensor& tree_k,
                                               const std::optional<at::Tensor>& tree_mask,
                                               double sm_scale, int64_t max_kv_len,
                                               const std::optional<at::Tensor>& k_scale, double k_scale_value) {
  KD_CHECK(q.dim() == 3, "q must be [T, H, 576], got ", q.sizes());
  at::Tensor out = at::empty({q.size(0), q.size(1), kDv}, q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  verify_attn_out(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale, out, lse,
                  max_kv_len, k_scale, k_scale_value);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("verify_attn", &verify_attn);
  m.impl("verify_attn_out", &verify_attn_out);
}

}  // namespace kdtree
