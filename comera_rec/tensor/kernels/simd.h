// Vector helpers shared by the fused CPU kernels (ttm_cpu.cpp, tt_linear_cpu.cpp, ...).
#pragma once

#include "aten_ops.h"

#include <cstdint>
#include <type_traits>

// The vector width of this build: the widest the target has (the build uses -march=native),
// 64 bytes with AVX-512, 32 with AVX / AVX2, 16 elsewhere. A width the target lacks is
// made of narrower halves by the compiler: correct, but several times slower than the
// PyTorch path (docs/performance-history.md: 64-byte vectors on an AVX2 machine).
// -DCOMERA_VECTOR_BYTES=N forces N, which the tests use to check the kernels at another
// width than the host's.
#ifndef COMERA_VECTOR_BYTES
#if defined(__AVX512F__)
#define COMERA_VECTOR_BYTES 64
#elif defined(__AVX__)
#define COMERA_VECTOR_BYTES 32
#else
#define COMERA_VECTOR_BYTES 16
#endif
#endif
static_assert(COMERA_VECTOR_BYTES == 16 || COMERA_VECTOR_BYTES == 32 || COMERA_VECTOR_BYTES == 64,
              "COMERA_VECTOR_BYTES must be 16, 32 or 64");

namespace comera {

constexpr int64_t kVectorBytes = COMERA_VECTOR_BYTES;
// Architectural vector registers: what a register tile of accumulators may fill.
// -DCOMERA_VECTOR_REGISTERS=N forces N (with a forced width: the tiles of the machine
// whose widest vectors those are).
#ifndef COMERA_VECTOR_REGISTERS
#if defined(__AVX512F__) || defined(__aarch64__)
#define COMERA_VECTOR_REGISTERS 32
#else
#define COMERA_VECTOR_REGISTERS 16
#endif
#endif
constexpr int kVectorRegisters = COMERA_VECTOR_REGISTERS;

// Rank vectors are padded to whole vectors (kVectorBytes): every loop over ranks runs over
// whole vectors held in registers (GCC / Clang vector extensions).
template <typename T>
struct Simd {
  static constexpr int64_t W = kVectorBytes / sizeof(T);
  typedef T vec __attribute__((vector_size(kVectorBytes)));
  typedef T uvec __attribute__((vector_size(kVectorBytes), aligned(sizeof(T)), may_alias));
  // lane indices of a shuffle: integers of T's width
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> lane_int;
  typedef lane_int index __attribute__((vector_size(kVectorBytes)));
};
template <typename T>
using vec_t = typename Simd<T>::vec;
template <typename T>
constexpr int64_t kLanes = Simd<T>::W;

template <typename T>
inline vec_t<T> vload(const T* p) { return *reinterpret_cast<const typename Simd<T>::uvec*>(p); }
template <typename T>
inline void vstore(T* p, vec_t<T> v) { *reinterpret_cast<typename Simd<T>::uvec*>(p) = v; }
template <typename T>
inline vec_t<T> vzero() { return vec_t<T>{}; }

// Sum of the lanes, by halving in registers: the upper half added to the lower, down to
// one lane (an extract and an add per level).
template <typename V>
inline auto hsum_halving(V v) {
  using T = std::remove_reference_t<decltype(v[0])>;
  constexpr int64_t n = sizeof(V) / sizeof(T);
  if constexpr (n == 1) {
    return v[0];
  } else {
    typedef T half __attribute__((vector_size(sizeof(V) / 2)));
    half lo, hi;
    __builtin_memcpy(&lo, &v, sizeof(half));
    __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(half), sizeof(half));
    return hsum_halving(lo + hi);
  }
}

inline float hsum(vec_t<float> v) { return hsum_halving(v); }
inline double hsum(vec_t<double> v) { return hsum_halving(v); }

// The lane sums of W vectors of W lanes (W = kLanes<float>) as one vector: lane c = sum of
// the lanes of v[c]. Each level adds the two halves of every vector's partial sums while
// packing two vectors' partials into one (for 16 lanes: 30 shuffles and 15 adds, where 16
// hsums take 64 and 64).
#if defined(__clang__)
#define COMERA_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define COMERA_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, typename Simd<T>::index{__VA_ARGS__})
#endif

inline vec_t<float> hsum_transpose(const vec_t<float> (&v)[kLanes<float>]) {
  using T = float;
#if COMERA_VECTOR_BYTES == 64
  vec_t<float> l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)  // blocks of 8 partials: (v[2i] | v[2i + 1])
    l1[i] = COMERA_SHUFFLE2(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            COMERA_SHUFFLE2(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // blocks of 4
    l2[i] = COMERA_SHUFFLE2(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            COMERA_SHUFFLE2(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // blocks of 2
    l3[i] = COMERA_SHUFFLE2(l2[2 * i], l2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            COMERA_SHUFFLE2(l2[2 * i], l2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return COMERA_SHUFFLE2(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         COMERA_SHUFFLE2(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif COMERA_VECTOR_BYTES == 32
  vec_t<float> l1[4], l2[2];
  for (int i = 0; i < 4; ++i)  // blocks of 4 partials: (v[2i] | v[2i + 1])
    l1[i] = COMERA_SHUFFLE2(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
            COMERA_SHUFFLE2(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // blocks of 2
    l2[i] = COMERA_SHUFFLE2(l1[2 * i], l1[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
            COMERA_SHUFFLE2(l1[2 * i], l1[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return COMERA_SHUFFLE2(l2[0], l2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         COMERA_SHUFFLE2(l2[0], l2[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  vec_t<float> l1[2];
  for (int i = 0; i < 2; ++i)  // blocks of 2 partials: (v[2i] | v[2i + 1])
    l1[i] = COMERA_SHUFFLE2(v[2 * i], v[2 * i + 1], 0, 1, 4, 5) + COMERA_SHUFFLE2(v[2 * i], v[2 * i + 1], 2, 3, 6, 7);
  return COMERA_SHUFFLE2(l1[0], l1[1], 0, 2, 4, 6) + COMERA_SHUFFLE2(l1[0], l1[1], 1, 3, 5, 7);
#endif
}
#undef COMERA_SHUFFLE2

// Ask for the cache lines of [p, p + bytes) ahead of use (rows read in a data-dependent
// order, whose loads the hardware prefetcher cannot guess).
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

// Keep v in a vector register until its uses: an empty asm that takes it there. A loaded
// vector that feeds a few multiply-adds is otherwise folded by GCC into each of them (a
// memory operand per FMA), and a loop with few accumulators becomes bound by its loads.
// Nothing is emitted where the vector is wider than the machine's (a forced width).
template <typename V>
inline void hold_in_register(V& v) {
#if defined(__x86_64__) && defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__x86_64__) && defined(__AVX__)
  if constexpr (sizeof(V) <= 32) asm("" : "+x"(v));
#elif defined(__x86_64__) && defined(__SSE2__)
  if constexpr (sizeof(V) <= 16) asm("" : "+x"(v));
#elif defined(__aarch64__)
  if constexpr (sizeof(V) <= 16) asm("" : "+w"(v));
#else
  (void)v;
#endif
}

// vload(p) held in a register until its uses (hold_in_register) with 16 registers, where GCC
// folded a loaded vector into each multiply-add that reads it (a memory operand each); with
// 32 the load is left to the compiler (the AVX-512 tiles as they were measured).
template <typename T>
inline vec_t<T> vload_held(const T* p) {
  vec_t<T> v = vload(p);
  if constexpr (kVectorRegisters < 32) hold_in_register(v);
  return v;
}

inline int64_t padded(int64_t n, int64_t lanes) { return (n + lanes - 1) / lanes * lanes; }

// The last dimension zero-padded to a multiple of `lanes`, contiguous.
inline at::Tensor pad_last(const at::Tensor& t, int64_t lanes) {
  const int64_t n = t.size(-1), p = padded(n, lanes);
  return p == n ? t.contiguous() : at::constant_pad_nd(t, {0, p - n}).contiguous();
}

}  // namespace comera
