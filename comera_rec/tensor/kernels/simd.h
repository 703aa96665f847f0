// Vector helpers shared by the fused CPU kernels (ttm_cpu.cpp, tt_linear_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
// The lane sums of 16 float vectors as one vector: lane c = sum of the lanes of v[c]. Four
// levels, each adding the two halves of every vector's partial sums while packing two
// vectors' partials into one (30 shuffles and 15 adds, where 16 hsums take 64 and 64).
#if defined(__clang__)
#define COMERA_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define COMERA_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, typename Simd<T>::index{__VA_ARGS__})
#endif

inline vec_t<float> hsum16(const vec_t<float> (&v)[16]) {
  using T = float;
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
}
#undef COMERA_SHUFFLE2
#undef COMERA_SHUFFLE

// Ask for the cache lines of [p, p + bytes) ahead of use (rows read in a data-dependent
// order, whose loads the hardware prefetcher cannot guess).
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

// Lanes [from, to) of v to dst[0 : to - from): one masked store of 16 floats with
// AVX-512, else lane by lane. Only dst[0 : to - from) is written.
template <typename T>
inline void store_lanes(T* dst, vec_t<T> v, int64_t from, int64_t to) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __mmask16 mask = static_cast<__mmask16>(((1u << to) - 1u) & ~((1u << from) - 1u));
    _mm512_mask_storeu_ps(dst - from, mask, reinterpret_cast<__m512&>(v));  // masked-off lanes: no access
    return;
  }
#endif
  for (int64_t l = from; l < to; ++l) dst[l - from] = v[l];
}

inline int64_t padded(int64_t n, int64_t lanes) { return (n + lanes - 1) / lanes * lanes; }

// The last dimension zero-padded to a multiple of `lanes`, contiguous.
inline torch::Tensor pad_last(const torch::Tensor& t, int64_t lanes) {
  const int64_t n = t.size(-1), p = padded(n, lanes);
  return p == n ? t.contiguous() : at::constant_pad_nd(t, {0, p - n}).contiguous();
}

}  // namespace comera
