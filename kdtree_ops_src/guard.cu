// The host's side of the device guards (common.cuh): a plain C entry point, not an op, because
// reading the table is a host-memory read that needs neither a tensor nor a stream; Python
// reaches it through ctypes (kdtree_ops.guard_errors).
#include "common.cuh"

// Bit g set: guard g (kdtree::Guard) tripped since the last clear. Also allocates the table on
// first call, which kdtree_ops.load() makes before any graph capture.
extern "C" int kdtree_guard_errors(int clear) {
  int* words = kdtree::guard_words();
  int bits = 0;
  for (int g = 0; g < kdtree::kGuardCount; ++g) {
    if (reinterpret_cast<volatile int*>(words)[g] != 0) bits |= 1 << g;
    if (clear) reinterpret_cast<volatile int*>(words)[g] = 0;
  }
  return bits;
}
