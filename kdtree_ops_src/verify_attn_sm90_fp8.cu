// Hopper (sm_90a) tree-verify attention over an fp8 (e4m3) pool, with the keys as the wgmma M
// dimension. Same outputs, split merge and schedules (equal splits, balanced) as the seesaw
// kernel, in CTAs of 48 (node, head) rows.
//
// Why keys as M: wgmma reads a shared-memory operand only in its own type, so with rows as M
// (S = Q K^T, O = P V) every e4m3 row has to be widened to f16 in shared memory before use:
// a landed -> widened -> read chain per buffer, and f16 tiles twice the size, of which 227 KB
// hold only two beside Q. Here the K rows stay e4m3 in shared memory and enter the tensor cores
// as the register operand, converted on the way (one cvt per pair of values, exact):
//   S^T = K Q^T     (M = 64 keys, N = 48 rows, K = 576 dims; Q from shared memory)
//   O^T += V^T P^T  (M = 64 dims x 4 per consumer, N = 48 rows, K = 16 keys a step; P from
//                    shared memory)
// so four 36 KB tiles are in flight and nothing is rewritten. f16 math on the e4m3 values
// themselves, k_scale applied in float32, q in f16 times a power of two (Fp8Math): the same
// numerics as the seesaw kernel's fp8 path.
//
// CTA = 3 warpgroups. WG2, the producer (few registers), gathers each key's 576 e4m3 bytes by
// slot with 16-byte cp.async into 4 K buffers; the tree's own rows (q's dtype) land as f16 in
// the pool's units, 32 keys to a buffer (a tree tile). WG0 and WG1, the consumers, load Q
// themselves (converted and permuted, below), then take the tiles in turns: the owner of tile
// t (WG t % 2) computes S^T(t) and its softmax, hands P(t) and the running max m_t to the other
// through shared memory, and both add P(t) V(t) into their half of O (dims 256 wg ..). The
// owner of t + 1 waits for m_t before its softmax, so one consumer's softmax runs while the
// tensor cores run the other's products. A K buffer is refilled once both have read it.
//
// Register operands. A thread's A fragment holds, per 16-dim step, dims {2 t4, 2 t4 + 1, 2 t4
// + 8, 2 t4 + 9} of two keys. The dims of Q and K are permuted alike (a dot product does not
// care) so that these are 4 consecutive bytes of a row: one 16-byte load of a K row serves 4
// steps, and Q is stored in that order. For V^T the output dims are permuted instead: a
// thread's 8 dims of O are 8 consecutive bytes of a row (one 8-byte load per key), put back
// in order when O is written.
// Shared memory (220 KB): Q 54 KB (f16, 128-byte swizzled 64-dim blocks) + 4 K buffers x 36 KB
// + 3 P buffers x 6 KB (f16, [row][key], 128-byte swizzled) + row statistics.
#include "verify_attn.cuh"
#include "verify_attn_sm90.cuh"

namespace kdtree {
namespace {

constexpr int kWgThreads = 128, kThreads = 3 * kWgThreads, kConsumers = 2 * kWgThreads;
constexpr int kCtaRows = kFp8CtaRows;  // wgmma N
// Register fragments in flight: each wgmma its own 4 registers, a slot reused once the wgmma
// kRing before it has completed (a wgmma reads its registers until it completes). More than 2
// and ptxas lacks the registers to keep the wgmma asynchronous (C7511: it serializes them all;
// up to 8% slower on an H200).
constexpr int kRing = 2;
constexpr int kRowsPerThread = kCtaRows / 4;  // accumulator columns 8 i + 2 t4 + e
constexpr int kTileKeys = 64, kTreeKeys = 32;
constexpr int kBufs = 4, kPBufs = 3;
constexpr int kBufBytes = kTileKeys * kDqk;  // 64 e4m3 rows, or 32 f16 rows
constexpr int kTreeRowBytes = 2 * kDqk;
constexpr int kCols = kDqk / 64;
constexpr int kQBlockBytes = kCtaRows * 128;
constexpr int kPBytes = kCtaRows * kTileKeys * 2;
constexpr int kOffK = kCols * kQBlockBytes;
constexpr int kOffP = kOffK + kBufs * kBufBytes;
constexpr int kOffMax = kOffP + kPBufs * kPBytes;           // [2][rows]: m of tile t at [t & 1]
constexpr int kOffTileMax = kOffMax + 2 * kCtaRows * 4;     // [2 consumers][4 warps][rows]
constexpr int kOffSum = kOffTileMax + 8 * kCtaRows * 4;     // [rows][8 warps]: running row sums
constexpr int kOffNode = kOffSum + 8 * kCtaRows * 4;        // [rows] node of each row
constexpr int kOffBar = kOffNode + kCtaRows * 4;            // mbarriers: K ready x 4, K free x 4
constexpr int kOffSeg = kOffBar + 8 * 2 * kBufs;            // [2] Segment: this one and the next
constexpr int kSegBytes = 64;
// The dynamic shared window is only 16-byte aligned; swizzled blocks need 1024.
constexpr int kSmemBytes = kOffSeg + 2 * kSegBytes + 1024;
static_assert(kSmemBytes <= 227 * 1024, "must fit sm_90's 227 KB per block");
static_assert(kOffK % 1024 == 0 && kOffP % 1024 == 0 && kPBytes % 1024 == 0, "swizzle atoms");
static_assert(kCtaRows % 8 == 0 && kCtaRows <= 64, "wgmma N, and 128-byte P rows of 64 keys");
static_assert(sizeof(Segment) <= kSegBytes && kOffSeg % alignof(Segment) == 0);

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KD_SM90A 1

// ptxas pipelines the consumers' wgmma only with 240 registers (C7512 at 232); the producer
// then spills, which measured as no slower (its copies wait on memory either way).
constexpr int kConsumerRegs = 240, kProducerRegs = 24;
constexpr float kMaxInit = -1e30f;  // a row's first max: finite, below every real score
// Named barriers (0 is __syncthreads). Tile t published (its owner arrives, the other waits):
// kBarTile + (t & 1); per consumer: its max vote, its tile max exchange, its P stores; both
// consumers; all three warpgroups (the producer's bad-slot OR).
constexpr int kBarTile = 1, kBarVote = 3, kBarTileMax = 5, kBarPStored = 7, kBarConsumers = 9, kBarLoaded = 10;

// Over the 8 lanes g of a warp that hold the same accumulator columns (rows) for other keys.
template <typename Op>
__device__ __forceinline__ float over_keys(float v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return op(v, __shfl_xor_sync(0xffffffffu, v, 16));
}
// One consumer's 128 threads: whether any passed true.
__device__ __forceinline__ bool wg_any(int id, bool v) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred in, out;\nsetp.ne.u32 in, %1, 0;\nbar.red.or.pred out, %2, 128, in;\n"
      "selp.u32 %0, 1, 0, out;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(v)), "r"(id)
      : "memory");
  return any != 0;
}

// D (+)= A B over 16 k: m64 n48, A (f16) from registers, B (f16, K-major) from shared memory.
template <bool Accumulate>
__device__ __forceinline__ void wgmma_m64n48(float (&d)[24], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(int(Accumulate)));
}

// Two e4m3 values (the low and the high byte of a 16-bit half of w) -> f16x2, exactly.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ uint4 load_u4(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint2 load_u2(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }

// An e4m3 key row r sits rotated by 32 sigma((r / 2) % 4) bytes, sigma = (0, 2, 1, 3): the four
// 64-byte reads of two keys 2 apart (one instruction of issue_qk) and the 32-byte reads of four
// keys 2 apart (a half-warp of issue_pv) then meet distinct banks, rows being 576 = 4.5 x 128
// bytes long. Byte b of the row (a 16-byte chunk, or an 8-byte read) is at row_pos(r, b).
__device__ __forceinline__ int row_pos(int r, int b) {
  const int m = r >> 1;
  const int x = b + ((((m & 1) << 1) | ((m >> 1) & 1)) << 5);
  return x < kDqk ? x : x - kDqk;
}

// The wgmma pipeline both products run: kSteps steps of 4 wgmma each. Step j's raw bytes are
// loaded one step ahead into registers (a tree tile's at the step itself: the registers of a
// second set are what the pipeline lacks), load(j, raw); wgmma i of step j takes slot
// (4 j + i) % kRing of the fragment ring, refilled by frags(i, raw, f) once the wgmma that read
// it last is done, and issued by mma(j, i, f).
template <bool Tree, int kSteps, typename Load, typename Frags, typename Mma>
__device__ __forceinline__ void wgmma_steps(Load load, Frags frags, Mma mma) {
  uint32_t frag[kRing][4];
  uint4 raw[4], next[4];
  load(0, raw);
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    if constexpr (Tree) {
      if (j > 0) load(j, raw);
    } else if (j + 1 < kSteps) {
      load(j + 1, next);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = 4 * j + i;
      uint32_t (&f)[4] = frag[k % kRing];
      if (k >= kRing) wgmma_wait<kRing - 1>();  // wgmma k - kRing has read this slot
      frags(i, raw, f);
      wgmma_fence();
      mma(j, i, f);
      wgmma_commit();
    }
    if constexpr (!Tree)
#pragma unroll
      for (int r = 0; r < 4; ++r) raw[r] = next[r];
  }
}

// S^T = K Q^T for one tile: 9 column blocks of 4 16-dim steps. The thread's keys are tile rows
// kA = 16 w + 2 g and kA + 1 (M rows 16 w + g, + 8); per block one 16-byte load of each (e4m3:
// bytes 64 cb + 16 t4 ..; a tree tile's f16 rows: 32 bytes) gives the 4 steps' fragments.
// A tree tile holds 32 keys: warps 2 and 3 multiply copies (their keys are masked).
template <bool Tree>
__device__ __forceinline__ void issue_qk(float (&s)[24], const uint8_t* kbuf, uint32_t sQ, int w, int g, int t4) {
  const int kA = 16 * w + 2 * g;
  // A block's raw bytes (loaded a block ahead of its wgmma, so no load waits behind a wgmma
  // wait): e4m3, row kA's 16 bytes and row kA + 1's; f16 (Tree): 32 bytes of each. Warps 2 and
  // 3 of a tree tile read rows 0-31 again (no branch: fragment registers defined on a
  // divergent path make ptxas serialize every wgmma of the kernel).
  auto load = [&](int cb, uint4 (&raw)[4]) {
    if constexpr (Tree) {
      const uint8_t* ra = kbuf + (kA % kTreeKeys) * kTreeRowBytes + cb * 128 + 32 * t4;
      raw[0] = load_u4(ra);
      raw[1] = load_u4(ra + 16);
      raw[2] = load_u4(ra + kTreeRowBytes);
      raw[3] = load_u4(ra + kTreeRowBytes + 16);
    } else {
      const int off = row_pos(kA, cb * 64 + 16 * t4);  // kA and kA + 1 share the rotation
      raw[0] = load_u4(kbuf + kA * kDqk + off);
      raw[1] = load_u4(kbuf + (kA + 1) * kDqk + off);
    }
  };
  wgmma_steps<Tree, kCols>(load,
                           [&](int st, const uint4 (&raw)[4], uint32_t (&f)[4]) {
                             if constexpr (Tree) {
                               f[0] = st < 2 ? (&raw[0].x)[2 * st] : (&raw[1].x)[2 * st - 4];
                               f[2] = st < 2 ? (&raw[0].x)[2 * st + 1] : (&raw[1].x)[2 * st - 3];
                               f[1] = st < 2 ? (&raw[2].x)[2 * st] : (&raw[3].x)[2 * st - 4];
                               f[3] = st < 2 ? (&raw[2].x)[2 * st + 1] : (&raw[3].x)[2 * st - 3];
                             } else {
                               e4m3x4_to_f16((&raw[0].x)[st], f[0], f[2]);
                               e4m3x4_to_f16((&raw[1].x)[st], f[1], f[3]);
                             }
                           },
                           [&](int cb, int st, const uint32_t (&f)[4]) {
                             const uint64_t qd = make_desc(sQ + cb * kQBlockBytes + st * 32, 16, 1024);
                             if (cb == 0 && st == 0) wgmma_m64n48<false>(s, f, qd);
                             else wgmma_m64n48<true>(s, f, qd);
                           });
}

// O^T += V^T P^T for one tile over this consumer's dims: 4 16-key steps (a tree tile: 2), each
// 4 m64 blocks of dims. The thread's 8 dims are bytes 256 wg + 64 w + 8 g .. of a row (dim
// 2 mb + h of them is M row g + 8 h of block mb); its keys per step are tile rows 16 ks + 2 t4
// + {0, 1, 8, 9}: one 8-byte load per key row (a tree row: 16 bytes), bytes paired across key
// rows by prmt.
template <bool Tree>
__device__ __forceinline__ void issue_pv(float (&o)[4][24], const uint8_t* kbuf, uint32_t sP, int wg, int w, int g,
                                         int t4) {
  constexpr int kSteps = Tree ? kTreeKeys / 16 : kTileKeys / 16;
  // A step's raw bytes: 4 key rows, 8 bytes of each (Tree: 16).
  auto load = [&](int ks, uint4 (&raw)[4]) {
    const int r0 = 16 * ks + 2 * t4;
    const int rows[4] = {r0, r0 + 1, r0 + 8, r0 + 9};
    const int off = Tree ? 2 * (256 * wg + 64 * w + 8 * g) : row_pos(r0, 256 * wg + 64 * w + 8 * g);  // one rotation
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (Tree) {
        raw[k] = load_u4(kbuf + rows[k] * kTreeRowBytes + off);
      } else {
        const uint2 v = load_u2(kbuf + rows[k] * kDqk + off);
        raw[k] = make_uint4(v.x, v.y, 0, 0);
      }
    }
  };
  wgmma_steps<Tree, kSteps>(load,
                            [&](int mb, const uint4 (&raw)[4], uint32_t (&f)[4]) {
                              if constexpr (Tree) {
                                const uint32_t x0 = (&raw[0].x)[mb], x1 = (&raw[1].x)[mb], x2 = (&raw[2].x)[mb],
                                               x3 = (&raw[3].x)[mb];
                                f[0] = prmt(x0, x1, 0x5410);
                                f[1] = prmt(x0, x1, 0x7632);
                                f[2] = prmt(x2, x3, 0x5410);
                                f[3] = prmt(x2, x3, 0x7632);
                              } else {
                                const uint32_t sel = mb & 1 ? 0x7362 : 0x5140;
                                const uint32_t x01 = prmt(mb < 2 ? raw[0].x : raw[0].y, mb < 2 ? raw[1].x : raw[1].y, sel);
                                const uint32_t x23 = prmt(mb < 2 ? raw[2].x : raw[2].y, mb < 2 ? raw[3].x : raw[3].y, sel);
                                e4m3x4_to_f16(x01, f[0], f[1]);
                                e4m3x4_to_f16(x23, f[2], f[3]);
                              }
                            },
                            [&](int ks, int mb, const uint32_t (&f)[4]) {
                              wgmma_m64n48<true>(o[mb], f, make_desc(sP + ks * 32, 16, 1024));
                            });
}

// The tiles of a segment: its prefix keys in 64-key e4m3 tiles, then its tree keys in 32-key
// f16 ones (from max(key_begin, prefix)).
struct Tiles {
  int n_pre, n, tree0, unmasked_end;
};
__device__ __forceinline__ Tiles tiles_of(const Segment& sg) {
  Tiles t;
  t.unmasked_end = min(sg.prefix, sg.key_end);
  t.n_pre = sg.key_begin < t.unmasked_end ? (t.unmasked_end - sg.key_begin + kTileKeys - 1) / kTileKeys : 0;
  t.tree0 = max(sg.key_begin, sg.prefix);
  t.n = t.n_pre + (sg.key_end > t.tree0 ? (sg.key_end - t.tree0 + kTreeKeys - 1) / kTreeKeys : 0);
  return t;
}

// The producer: thread lt copies 16-byte chunks lt % 4 + 4 j of a prefix tile's rows lt / 4 and
// lt / 4 + 32 (8 lanes: two rows x 64 bytes, distinct banks; a warp reads 8 rows x 64
// contiguous bytes per instruction), or of a tree tile's row lt / 4, which it then turns into
// f16 in the pool's units itself (divided by k_scale; `beyond` where that passes f16's
// range). Keys past the end land as zeros.
template <typename T, typename Idx>
__device__ __forceinline__ void produce(const VerifyParams<T>& p, const Segment& sg, uint8_t* k_smem, uint32_t sK,
                                        uint32_t bar_ready, uint32_t bar_free, uint32_t tile_base, int lt, bool& bad,
                                        bool& beyond) {
  const Tiles tl = tiles_of(sg);
  const Idx* kv_indices = static_cast<const Idx*>(p.kv_indices) + sg.kv_begin;
  const int r = lt >> 2, q4 = lt & 3;
  const float tree_to_pool = 1.f / kv_scale(p);
  auto slot_of = [&](int key) { return key < tl.unmasked_end ? __ldg(kv_indices + key) : Idx(0); };
  Idx slot[2] = {Idx(0), Idx(0)};
  if (tl.n_pre > 0) {
    slot[0] = slot_of(sg.key_begin + r);
    slot[1] = slot_of(sg.key_begin + r + 32);
  }
#pragma unroll 1
  for (int t = 0; t < tl.n; ++t) {
    const uint32_t gt = tile_base + t, buf = gt % kBufs;
    mbar_wait(bar_free + 8 * buf, ((gt / kBufs) & 1) ^ 1);  // a fresh barrier's "previous phase" is complete
    const uint32_t dst = sK + buf * kBufBytes;
    if (t < tl.n_pre) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = r + 32 * half, key = sg.key_begin + t * kTileKeys + row;
        const bool valid = key < tl.unmasked_end;
        const uint8_t* src = p.kv8 + static_cast<int64_t>(valid ? checked_slot(p, slot[half], bad) : Idx(0)) * p.kv_stride;
#pragma unroll
        for (int j = 0; j < kDqk / 64; ++j) {
          const int c = 4 * j + q4;
          cp_async16(dst + row * kDqk + row_pos(row, 16 * c), src + 16 * c, valid);
        }
      }
      cp_async_arrive(bar_ready + 8 * buf);
      if (t + 1 < tl.n_pre) {
        const int key = sg.key_begin + (t + 1) * kTileKeys + r;
        slot[0] = slot_of(key);
        slot[1] = slot_of(key + 32);
      }
    } else {
      const int key = tl.tree0 + (t - tl.n_pre) * kTreeKeys + r;
      const bool valid = key < sg.key_end;
      const T* src = p.tree_k + (valid ? static_cast<int64_t>(sg.q_begin + key - sg.prefix) * p.tk_stride : 0);
#pragma unroll
      for (int j = 0; j < kTreeRowBytes / 64; ++j) {
        const int c = 4 * j + q4;
        cp_async16(dst + r * kTreeRowBytes + 16 * c, src + 8 * c, valid);
      }
      cp_async_commit();
      cp_async_wait<0>();
      uint8_t* row = k_smem + buf * kBufBytes + r * kTreeRowBytes;
#pragma unroll
      for (int j = 0; j < kTreeRowBytes / 64; ++j) {
        uint4* c = reinterpret_cast<uint4*>(row + 16 * (4 * j + q4));
        *c = to_f16x8<T>(*c, tree_to_pool, beyond);
      }
      mbar_arrive(bar_ready + 8 * buf);
    }
  }
}

#endif  // sm_90a

template <typename T, typename Idx, bool Balanced>
__global__ void __launch_bounds__(kThreads, 1) verify_attn_fp8_kernel(const VerifyParams<T> p) {
#ifdef KD_SM90A
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t s_base = smem_addr(smem);
  const uint32_t sQ = s_base, sK = s_base + kOffK, sP = s_base + kOffP;
  uint8_t* k_smem = smem + kOffK;
  float* s_max = reinterpret_cast<float*>(smem + kOffMax);
  float* s_tile_max = reinterpret_cast<float*>(smem + kOffTileMax);
  float* s_sum = reinterpret_cast<float*>(smem + kOffSum);
  int* s_node = reinterpret_cast<int*>(smem + kOffNode);
  const uint32_t bar_ready = s_base + kOffBar, bar_free = bar_ready + 8 * kBufs;
  Segment* s_seg = reinterpret_cast<Segment*>(smem + kOffSeg);

  const int tid = threadIdx.x, wg = tid / kWgThreads, lt = tid % kWgThreads;
  const bool has_work = start_segments<kCtaRows, Balanced>(p, s_seg, tid, [&] {
    for (int i = 0; i < kBufs; ++i) {
      mbar_init(bar_ready + 8 * i, kWgThreads);
      mbar_init(bar_free + 8 * i, kConsumers);
    }
  });
  if (!has_work) return;

  // K buffer phases run on over the tiles of all segments (tile_base: those of the earlier
  // ones). The producer finds segment k + 1 while the consumers finish k and publishes it
  // through the barrier that ends k (kBarLoaded).
  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    uint32_t tile_base = 0;
    for (int k = 0;; ++k) {
      const Segment sg = s_seg[k & 1];
      if (sg.b == kNoWork) break;
      bool bad = false, beyond = false;
      produce<T, Idx>(p, sg, k_smem, sK, bar_ready, bar_free, tile_base, lt, bad, beyond);
      if constexpr (Balanced) {
        if (lt < 32) {
          const Segment after = balanced_segment(p, lt, &sg);
          if (lt == 0) s_seg[(k + 1) & 1] = after;
        }
      }
      named_sync_or(kBarLoaded, kThreads, bad);
      named_sync_or(kBarLoaded, kThreads, beyond);
      if constexpr (!Balanced) break;
      tile_base += tiles_of(sg).n;
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const int ct = tid;  // 0..255 over both consumers
    const int lane = tid & 31, g = lane >> 2, t4 = lane & 3, w = lt >> 5;
    const int kA = 16 * w + 2 * g;  // this thread's keys in S^T: tile rows kA, kA + 1
    // Accumulator column (row of the CTA) of element 4 i + 2 h + e: 8 i + 2 t4 + e.
    auto row_n = [&](int i, int e) { return 8 * i + 2 * t4 + e; };
    uint32_t tile_base = 0;
    for (int k = 0;; ++k) {
      const Segment sg = s_seg[k & 1];
      if (sg.b == kNoWork) break;
      const Tiles tl = tiles_of(sg);
      const float k_scale = kv_scale(p);

      // The previous segment's epilogue has read s_node and s_sum in every consumer thread.
      if (k > 0) named_sync(kBarConsumers, kConsumers);
      // ---- Q: both consumers load it, into f16 (bf16 times a power of two) and the dim order
      // of the K fragments: within a 64-dim block, the 2-dim unit at dims 16 t + 4 s + 2 v goes
      // to 16 s + 8 v + 2 t (a K row's bytes 16 t4 .. are then steps s = 0..3's fragments).
      float q_factor = 1.f;
      {
        constexpr int kChunks = kCtaRows * kDqk / 8, kPer = (kChunks + kConsumers - 1) / kConsumers;
        uint4 qv[kPer];
        uint32_t peak = 0;
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int idx = ct + j * kConsumers, r = idx / (kDqk / 8), m = sg.row0 + r;
          qv[j] = make_uint4(0, 0, 0, 0);
          if (idx < kChunks && m < sg.rows_b) {
            const int node = m / p.heads, head = m - node * p.heads;
            qv[j] = *reinterpret_cast<const uint4*>(p.q + (sg.q_begin + node) * p.q_st + head * p.q_sh +
                                                    8 * (idx % (kDqk / 8)));
          }
          peak = peak_bits(peak_bits(peak_bits(peak_bits(peak, qv[j].x), qv[j].y), qv[j].z), qv[j].w);
        }
        if (ct < kCtaRows) {
          const int m = sg.row0 + ct;
          s_node[ct] = m < sg.rows_b ? m / p.heads : 0;
        }
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
          peak = __reduce_max_sync(0xffffffffu, peak_bits_fold(peak));
          uint32_t* s_peak = reinterpret_cast<uint32_t*>(s_tile_max);  // free until the first tile max
          if (lane == 0) s_peak[ct >> 5] = peak;
          named_sync(kBarConsumers, kConsumers);
#pragma unroll
          for (int i = 0; i < kConsumers / 32; ++i) peak = max(peak, s_peak[i]);
          q_factor = q_f16_factor(peak);
        }
        bool unused = false;  // |q| x q_factor < 2^15
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int idx = ct + j * kConsumers;
          if (idx >= kChunks) continue;
          const int r = idx / (kDqk / 8), ch = idx % (kDqk / 8), cb = ch >> 3, t = (ch & 7) >> 1;
          const uint4 h = to_f16x8<T>(qv[j], q_factor, unused);
          const uint32_t hw[4] = {h.x, h.y, h.z, h.w};
          const uint32_t row = sQ + cb * kQBlockBytes + r * 128;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int st = 2 * (ch & 1) + (u >> 1), v = u & 1;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(row + (((2 * st + v) ^ (r & 7)) << 4) + 4 * t), "r"(hw[u]));
          }
        }
        fence_proxy_async();  // read by wgmma
        named_sync(kBarConsumers, kConsumers);  // all of Q (and every read of s_peak)
      }
      // The score scale: k_scale, and the q factor folded out (Fp8Math).
      const float c = p.scale_log2 * (k_scale / q_factor);
      const int* mask_base = p.mask ? p.mask + static_cast<int64_t>(sg.q_begin) * p.mask_stride : nullptr;

      float o[4][24];
      auto fence_o = [&] {
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) fence_regs(o[mb]);
      };
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int i = 0; i < 24; ++i) o[mb][i] = 0.f;
      // Pinned here: a zeroing the compiler sinks between a wgmma and its wait makes ptxas
      // serialize every wgmma of the kernel (C7515).
      fence_o();
      float s[24];
      // The row sums live in shared memory (s_sum, one slot per warp and row, kept by the
      // warp's lanes g = 0): 12 registers fewer is what lets ptxas pipeline the wgmma.
      float run[kRowsPerThread];
      auto l_of = [&](int i) -> float& { return s_sum[row_n(i >> 1, i & 1) * 8 + wg * 4 + w]; };
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        run[i] = kMaxInit;
        if (g == 0) l_of(i) = 0.f;
      }
      auto kbuf_of = [&](int t) { return k_smem + ((tile_base + t) % kBufs) * kBufBytes; };
      auto wait_ready = [&](int t) {
        const uint32_t gt = tile_base + t;
        mbar_wait(bar_ready + 8 * (gt % kBufs), (gt / kBufs) & 1);
      };
      auto free_tile = [&](int t) { mbar_arrive(bar_free + 8 * ((tile_base + t) % kBufs)); };
      auto qk = [&](int t) {
        wait_ready(t);
        if (t < tl.n_pre) issue_qk<false>(s, kbuf_of(t), sQ, w, g, t4);
        else issue_qk<true>(s, kbuf_of(t), sQ, w, g, t4);
      };
      auto pv = [&](int t) {
        const uint32_t pbuf = sP + (t % kPBufs) * kPBytes;
        if (t < tl.n_pre) issue_pv<false>(o, kbuf_of(t), pbuf, wg, w, g, t4);
        else issue_pv<true>(o, kbuf_of(t), pbuf, wg, w, g, t4);
      };
      // O and l to a new max (rows whose max moved), O after its products are done.
      auto rescale = [&](const float (&to)[kRowsPerThread]) {
        float a[kRowsPerThread];
        bool moved = false;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          a[i] = to[i] != run[i] ? fast_exp2(run[i] - to[i]) : 1.f;
          moved |= a[i] != 1.f;
          run[i] = to[i];
          if (g == 0) l_of(i) *= a[i];
        }
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
          for (int mb = 0; mb < 4; ++mb)
#pragma unroll
            for (int i = 0; i < 6; ++i)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int e = 0; e < 2; ++e) o[mb][4 * i + 2 * hh + e] *= a[2 * i + e];
        }
      };

      if (wg < tl.n) qk(wg);
#pragma unroll 1
      for (int t = 0; t < tl.n; ++t) {
        if ((t & 1) != wg) {
          // ---- the other consumer's tile: its max and P, then P V into this half of O ----
          named_sync(kBarTile + (t & 1), kConsumers);
          float m[kRowsPerThread];
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) m[i] = s_max[(t & 1) * kCtaRows + row_n(i >> 1, i & 1)];
          // All of this consumer's products, its next S^T too: ptxas cannot tell which a partial
          // wait leaves running and serializes the kernel for it (C7514).
          wgmma_wait<0>();
          if (t > 0) free_tile(t - 1);
          fence_o();
          rescale(m);
          pv(t);
          continue;
        }
        // ---- own tile: S^T, mask, max, P ----
        wgmma_wait<0>();  // (C7514, as above)
        fence_regs(s);
        const bool tree = t >= tl.n_pre;
        const int key0 = tree ? tl.tree0 + (t - tl.n_pre) * kTreeKeys : sg.key_begin + t * kTileKeys;
        if (tree || key0 + kTileKeys > tl.unmasked_end) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = kA + hh, key = key0 + r;
            const bool in = tree ? r < kTreeKeys && key < sg.key_end : key < tl.unmasked_end;
#pragma unroll
            for (int i = 0; i < 6; ++i)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                bool vis = in;
                if (tree && in) {
                  const int j = key - sg.prefix, node = s_node[row_n(i, e)];
                  vis = mask_base ? (j >> 5) < p.mask_words && ((mask_base[node * p.mask_stride + (j >> 5)] >> (j & 31)) & 1)
                                  : j <= node;
                }
                if (!vis) s[4 * i + 2 * hh + e] = -INFINITY;
              }
          }
        }
        // The max only moves where a score beats it by kRescaleSlack; mostly none does, and
        // one vote says so without the tile's row maxima.
        bool beats = false;
#pragma unroll
        for (int i = 0; i < 6; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            beats |= fmaxf(s[4 * i + e], s[4 * i + 2 + e]) * c > run[2 * i + e] + kRescaleSlack;
        float m[kRowsPerThread];
        if (wg_any(kBarVote + wg, beats)) {
#pragma unroll
          for (int i = 0; i < 6; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              m[2 * i + e] = over_keys(fmaxf(s[4 * i + e], s[4 * i + 2 + e]), fmaxf);
            }
          if (g == 0) {
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) s_tile_max[(wg * 4 + w) * kCtaRows + row_n(i >> 1, i & 1)] = m[i];
          }
          named_sync(kBarTileMax + wg, kWgThreads);
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int n = row_n(i >> 1, i & 1);
            float mx = s_tile_max[(wg * 4) * kCtaRows + n];
#pragma unroll
            for (int ww = 1; ww < 4; ++ww) mx = fmaxf(mx, s_tile_max[(wg * 4 + ww) * kCtaRows + n]);
            mx *= c;
            m[i] = mx > run[i] + kRescaleSlack ? mx : run[i];
          }
        } else {
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) m[i] = run[i];
        }
        // P = 2^(S c - m), into P[row][key] (f16, 128-byte rows swizzled in 16-byte chunks)
        float sum[kRowsPerThread];
        const uint32_t pbuf = sP + (t % kPBufs) * kPBytes;
#pragma unroll
        for (int i = 0; i < 6; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = row_n(i, e);
            const float pa = fast_exp2(fmaf(s[4 * i + e], c, -m[2 * i + e]));
            const float pb = fast_exp2(fmaf(s[4 * i + 2 + e], c, -m[2 * i + e]));
            sum[2 * i + e] = pa + pb;
            const uint32_t addr = pbuf + n * 128 + ((((kA >> 3) ^ (n & 7))) << 4) + 4 * (g & 3);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pack2<__half>(pa, pb)));
          }
        if (w == 0 && g == 0) {
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) s_max[(t & 1) * kCtaRows + row_n(i >> 1, i & 1)] = m[i];
        }
        fence_proxy_async();
        named_sync(kBarPStored + wg, kWgThreads);
        named_arrive(kBarTile + (t & 1), kConsumers);
        // ---- P V into this half of O, then the next own tile's S^T ----
        wgmma_wait<0>();
        if (t > 0) free_tile(t - 1);
        fence_o();
        rescale(m);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const float tile_sum = over_keys(sum[i], [](float a, float b) { return a + b; });
          if (g == 0) l_of(i) += tile_sum;
        }
        pv(t);
        if (t + 2 < tl.n) qk(t + 2);
      }
      wgmma_wait<0>();
      fence_o();
      if (tl.n > 0) free_tile(tl.n - 1);

      // ---- epilogue: row sums over both consumers, then this consumer's half of O ----
      named_sync(kBarConsumers, kConsumers);
      const bool malformed = sg.b == kMalformedBatch;
      const bool slot_bad = named_sync_or(kBarLoaded, kThreads, false);
      const bool range_bad = named_sync_or(kBarLoaded, kThreads, false) || !k_scale_usable(k_scale);
      const bool bad = slot_bad || range_bad || malformed;
      if (bad && tid == 0)
        raise_guard(p.guard, malformed ? kGuardVerifyIndptr : slot_bad ? kGuardKvSlot : kGuardFp8Range);
      const int dim0 = 256 * wg + 64 * w + 8 * g;
#pragma unroll
      for (int i = 0; i < 6; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = row_n(i, e), m = sg.row0 + n;
          if (m >= sg.rows_b) continue;
          float lt_sum = 0.f;
#pragma unroll
          for (int x = 0; x < 8; ++x) lt_sum += s_sum[n * 8 + x];
          const float inv = bad ? kNaN : lt_sum > 0.f ? k_scale / lt_sum : 0.f;
          // dims dim0 + 2 mb + hh: o[mb][4 i + 2 hh + e]
          float v[8];
#pragma unroll
          for (int mb = 0; mb < 4; ++mb)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) v[2 * mb + hh] = o[mb][4 * i + 2 * hh + e] * inv;
          const int node = s_node[n], head = m - node * p.heads;
          if (sg.direct) {
            T* dst = p.out + (sg.q_begin + node) * p.out_st + head * p.out_sh + dim0;
            *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
            *reinterpret_cast<uint2*>(dst + 4) = make_uint2(pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
          } else if (lt_sum > 0.f) {  // the merge never reads a row of a split that saw nothing
            float* dst = p.part_o + (sg.part + n) * kDv + dim0;
            *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
          }
          if (wg == 0 && w == 0 && g == 0) {
            const float mx = run[2 * i + e];
            const float lse = bad ? kNaN : lt_sum > 0.f ? (mx + __log2f(lt_sum)) * 0.69314718055994531f : -INFINITY;
            if (sg.direct)
              p.lse[(sg.q_begin + node) * p.lse_st + head * p.lse_sh] = lse;
            else
              p.part_lse[sg.part + n] = lse;
          }
        }
      if constexpr (!Balanced) break;
      tile_base += tl.n;
    }
  }
#else
  __trap();
#endif
}

}  // namespace

template <typename T>
void launch_verify_attn_fp8(const VerifyParams<T>& p, bool idx32, dim3 grid, cudaStream_t stream) {
  auto kernel = with_flag(p.balanced > 0, [&](auto balanced) {
    return with_flag(idx32, [&](auto i32) {
      return verify_attn_fp8_kernel<T, SlotIndex<decltype(i32)>, decltype(balanced)::value>;
    });
  });
  allow_dynamic_smem(kernel, kSmemBytes);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_verify_attn_fp8<__nv_bfloat16>(const VerifyParams<__nv_bfloat16>&, bool, dim3, cudaStream_t);
template void launch_verify_attn_fp8<__half>(const VerifyParams<__half>&, bool, dim3, cudaStream_t);

}  // namespace kdtree
