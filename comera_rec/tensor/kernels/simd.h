// Vector helpers shared by the fused CPU kernels (ttm_cpu.cpp, tt_linear_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

namespace comera {

// Rank vectors are padded to whole 64-byte vectors (16 floats, 8 doubles): every loop
// over ranks runs over whole vectors held in registers (GCC / Clang vector extensions, which
// become AVX-512 or pairs of AVX2 registers, or narrower ones elsewhere).
template <typename T>
struct Simd {
  static constexpr int64_t W = 64 / sizeof(T);
  typedef T vec __attribute__((vector_size(64)));
  typedef T uvec __attribute__((vector_size(64), aligned(sizeof(T)), may_alias));
  // lane indices of a shuffle: integers of T's width
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> lane_int;
  typedef lane_int index __attribute__((vector_size(64)));
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

// Sum of the lanes, by halving in registers (a shuffle and an add per level).
#if defined(__clang__)
#define COMERA_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define COMERA_SHUFFLE(v, ...) __builtin_shuffle(v, typename Simd<T>::index{__VA_ARGS__})
#endif

inline float hsum(vec_t<float> v) {
  using T = float;
  v += COMERA_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += COMERA_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += COMERA_SHUFFLE(v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += COMERA_SHUFFLE(v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}

inline double hsum(vec_t<double> v) {
  using T = double;
  v += COMERA_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += COMERA_SHUFFLE(v, 2, 3, 0, 1, 2, 3, 0, 1);
  v += COMERA_SHUFFLE(v, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}
#undef COMERA_SHUFFLE

// Ask for the cache lines of [p, p + bytes) ahead of use (rows read in a data-dependent
// order, whose loads the hardware prefetcher cannot guess).
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

inline int64_t padded(int64_t n, int64_t lanes) { return (n + lanes - 1) / lanes * lanes; }

// The last dimension zero-padded to a multiple of `lanes`, contiguous.
inline torch::Tensor pad_last(const torch::Tensor& t, int64_t lanes) {
  const int64_t n = t.size(-1), p = padded(n, lanes);
  return p == n ? t.contiguous() : at::constant_pad_nd(t, {0, p - n}).contiguous();
}

}  // namespace comera
