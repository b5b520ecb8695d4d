// Hopper (sm_90a) primitives shared by the wgmma verify kernels (verify_attn_sm90.cu,
// verify_attn_sm90_seesaw.cu, verify_attn_sm90_fp8.cu): mbarriers, cp.async
// completion, proxy fence, shared-memory matrix descriptors, wgmma group control, and the
// accumulator operand lists of their wgmma asm, and the start the segment-walking kernels
// share. Compiled only for sm_90a.
#pragma once

#include <cstdint>

#include "verify_attn.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace kdtree {

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Waits for the phase of `parity` on `bar`; every lane of the warp must call it. The loop's
// branch is warp-uniform (vote, bra.uni), so a wgmma chain may run across the wait without
// ptxas serializing the kernel's wgmma ops.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p, all;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "vote.sync.all.pred all, p, 0xffffffff;\n"
      "@!all bra.uni WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Whether the phase of `parity` has completed, without waiting.
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Shared-memory matrix descriptor: start address, leading and stride offsets in bytes
// (multiples of 16; the descriptor holds them in 16-byte units) and swizzle (1: 128-byte, 2:
// 64-byte). K-major swizzled operands ignore the leading
// offset; an MN-major one (V) steps its 64-element MN blocks by it.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint32_t swizzle = 1) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32 | static_cast<uint64_t>(swizzle) << 62;
}
// Arrives on `bar` once every earlier cp.async of this thread has landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// wgmma reads shared memory through the async proxy: order it after generic-proxy writes
// (P stores, and the cp.async rows this thread has seen land).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Accumulators are written by wgmma behind the compiler's back: pin them after a wait so no
// read is hoisted above it.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The start of a kernel that walks segments (seesaw, fp8): warp 0 finds the CTA's first
// segment into s_seg[0], thread 32 initializes the mbarriers (init_bars) and makes them visible
// to the async proxy. False for a CTA with no work, which returns. Otherwise the split merge
// launched behind the kernel may now be scheduled: it waits for this grid's completion before
// it reads anything.
template <int Rows, bool Balanced, typename T, typename InitBars>
__device__ __forceinline__ bool start_segments(const VerifyParams<T>& p, Segment* s_seg, int tid, InitBars init_bars) {
  if (tid < 32) {
    const Segment first = first_segment<Rows, Balanced>(p, tid);
    if (tid == 0) s_seg[0] = first;
  }
  if (tid == 32) {
    init_bars();
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (s_seg[0].b == kNoWork) return false;
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  return true;
}

// wgmma accumulator operands, for the Hopper kernels' wrappers (left defined): KD_ACC8(i) binds
// d[i .. i+7], KD_ACC32(i) d[i .. i+31]; the asm strings name them from %0 on, KD_REGS16 / 32 /
// 128 as the wgmma's first 16, 32 or 128 operands.
#define KD_ACC8(i)                                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),        \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define KD_ACC32(i) KD_ACC8(i), KD_ACC8(i + 8), KD_ACC8(i + 16), KD_ACC8(i + 24)
#define KD_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
#define KD_REGS32                                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define KD_REGS128                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "  \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "   \
  "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "  \
  "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, "  \
  "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, "    \
  "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
// A wrapper's body: the wgmma macro WGMMA (its asm statement, the type as a string) for T.
#define KD_WGMMA_OF(T, WGMMA)                                                                        \
  if constexpr (std::is_same_v<T, __nv_bfloat16>) WGMMA("bf16");                                     \
  else WGMMA("f16")

}  // namespace kdtree
#endif
