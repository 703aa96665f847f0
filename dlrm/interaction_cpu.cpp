// Fused CPU pairwise-dot interaction (DLRM): out = [dense, <e_i, e_j> for i < j], with
// e_0 = dense and e_1..e_F the sparse features of the sample, pairs in row-major order.
//
// As tensor ops this is a concatenation, a batched GEMM over (B, n, n) grids, a gather of
// the upper triangle and another concatenation, each a pass over memory; backward a
// zero-padded gather into the grid and a second batched GEMM. Here the batch is done in one
// pass while each sample's n rows are in cache. Forward, W samples at a time (one sample a
// lane of a W-lane vector, the batch's last B % W with lanes of zeros): their rows are
// transposed in registers into vectors over the samples, so that each multiply-add is a step
// of W dot products and only the tiles on the diagonal spend any on the grid's (i, j <= i)
// half (forward_lanes).
// Backward, per sample, grad e_i = sum_{j != i} g_ij e_j in tiles of rows x vectors over D
// (5 x 2 with 16 registers), g read where the packed gradient holds it: there each
// multiply-add is already a whole vector. Samples are independent and every sample's sums
// are made alike: the result depends neither on the number of threads nor on a sample's
// place in the batch.

#include "aten_ops.h"
#ifndef COMERA_OPERATOR_LIBRARY  // the operator library binds no Python module
#include "python_module.h"
#endif

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using namespace comera;

// Row i of sample b: the dense features for i = 0, sparse feature i - 1 otherwise.
template <typename T>
inline const T* row_of(const T* dense, const T* sparse, int64_t b, int64_t i, int64_t F, int64_t D) {
  return i == 0 ? dense + b * D : sparse + (b * F + (i - 1)) * D;
}

// ---- Forward, W samples at a time, one sample per vector lane ----------------------------
// One sample at a time, with its rows transposed into a (D, n) block, a multiply-add gives W
// of that sample's dots (row i against W rows j), but about half of them lie in the grid's
// (i, j <= i) half, and a broadcast feeds each few. With the lanes over W samples, each
// multiply-add is a step of W dot products of one pair: the samples' rows are transposed in
// registers into (row, d) vectors over the samples (rows_by_lane), the dots summed in
// register tiles of such vectors and transposed back into the samples' rows. At Kaggle
// shapes with AVX-512 that is 448 vector multiply-adds a sample against 704 (what is left of
// the lower half is in the tiles on the diagonal), and about twice as fast as the one-sample
// forward (docs/performance-history.md).

// v[r][c] <- v[c][r] for a W x W block in registers: at each scale s = 1, 2, .., W / 2 the
// off-diagonal s x s blocks of every 2s x 2s block swap (log2 W stages of W shuffles)
template <int64_t W, int64_t s, bool upper, typename V, int... c>
inline V swap_lanes(V lower_row, V upper_row, std::integer_sequence<int, c...>) {
  // the lower row (bit s of its index 0) takes the upper row's lanes c - s where bit s of c is
  // set; the upper row takes the lower row's lanes c + s where it is not
  if constexpr (!upper)
    return __builtin_shufflevector(lower_row, upper_row, ((c & s) ? int(W + c - s) : c)...);
  else
    return __builtin_shufflevector(lower_row, upper_row, ((c & s) ? int(W + c) : int(c + s))...);
}

template <typename T, int64_t s = 1>
inline void transpose_block(vec_t<T> (&v)[kLanes<T>]) {
  constexpr int64_t W = kLanes<T>;
  if constexpr (s < W) {
    using lanes = std::make_integer_sequence<int, int(W)>;
    for (int64_t r = 0; r < W; ++r) {
      if (r & s) continue;
      const vec_t<T> lo = v[r], hi = v[r + s];
      v[r] = swap_lanes<W, s, false>(lo, hi, lanes{});
      v[r + s] = swap_lanes<W, s, true>(lo, hi, lanes{});
    }
    transpose_block<T, 2 * s>(v);
  }
}

// x[(i D + d) W + l] = row i of sample b0 + l at d: the W samples' n rows as (row, d) vectors
// over the samples (W x W blocks transposed in registers, the tail of D lane by lane); lanes
// from `valid` on (past the batch's end) read `zeros` (D zeros)
template <typename T>
void rows_by_lane(const T* dense, const T* sparse, int64_t b0, int64_t valid, int64_t n, int64_t F, int64_t D,
                  const T* zeros, T* x) {
  constexpr int64_t W = kLanes<T>;
  for (int64_t i = 0; i < n; ++i) {
    const T* row[W];
    for (int64_t l = 0; l < W; ++l) row[l] = l < valid ? row_of(dense, sparse, b0 + l, i, F, D) : zeros;
    int64_t d0 = 0;
    for (; d0 + W <= D; d0 += W) {
      vec_t<T> v[W];
      for (int64_t l = 0; l < W; ++l) v[l] = vload(row[l] + d0);
      transpose_block<T>(v);
      for (int64_t k = 0; k < W; ++k) vstore(x + (i * D + d0 + k) * W, v[k]);
    }
    for (int64_t d = d0; d < D; ++d)
      for (int64_t l = 0; l < W; ++l) x[(i * D + d) * W + l] = row[l][d];
  }
}

// forward_lanes' register tiles: R rows x C columns of accumulators, each step R + C loads
// for R C multiply-adds: 4 x 4 with 32 registers, 3 x 3 with 16
constexpr int64_t kLaneTile = kVectorRegisters >= 32 ? 4 : 3;

// where row i's pairs (i, i + 1 .. n - 1) start in row-major order over n rows, and the
// position of pair (i, j), i < j
inline int64_t row_start(int64_t i, int64_t n) { return i * (2 * n - i - 1) / 2; }
inline int64_t pair_index(int64_t i, int64_t j, int64_t n) { return row_start(i, n) + (j - i - 1); }

// Forward for samples b0 .. b0 + valid - 1 (valid <= W; the other lanes compute zeros and
// write nothing). x: rows_by_lane's layout with kLaneTile zero rows after the n; dots:
// (P + W) x W, its last W rows zero; zeros: D zeros
template <typename T>
void forward_lanes(const T* dense, const T* sparse, T* out, int64_t b0, int64_t valid, int64_t F, int64_t D,
                   const T* zeros, T* x, T* dots) {
  constexpr int64_t W = kLanes<T>, R = kLaneTile, C = kLaneTile;
  const int64_t n = F + 1, P = n * (n - 1) / 2, width = D + P;
  rows_by_lane(dense, sparse, b0, valid, n, F, D, zeros, x);
  for (int64_t i0 = 0; i0 + 1 < n; i0 += R) {
    for (int64_t j0 = i0 + 1; j0 < n; j0 += C) {
      vec_t<T> acc[R][C];
      for (int64_t u = 0; u < R; ++u)
        for (int64_t c = 0; c < C; ++c) acc[u][c] = vzero<T>();
      for (int64_t d = 0; d < D; ++d) {
        vec_t<T> a[R], b[C];
        for (int64_t u = 0; u < R; ++u) a[u] = vload(x + ((i0 + u) * D + d) * W);
        for (int64_t c = 0; c < C; ++c) b[c] = vload(x + ((j0 + c) * D + d) * W);
        for (int64_t u = 0; u < R; ++u)
          for (int64_t c = 0; c < C; ++c) acc[u][c] += a[u] * b[c];
      }
      for (int64_t u = 0; u < R; ++u)
        for (int64_t c = 0; c < C; ++c) {
          const int64_t i = i0 + u, j = j0 + c;
          if (i < j && j < n) vstore(dots + pair_index(i, j, n) * W, acc[u][c]);
        }
    }
  }
  for (int64_t l = 0; l < valid; ++l) std::copy(dense + (b0 + l) * D, dense + (b0 + l + 1) * D, out + (b0 + l) * width);
  // W pairs at a time back into the samples' rows; the last (< W) pairs lane by lane
  for (int64_t p0 = 0; p0 < P; p0 += W) {
    vec_t<T> v[W];
    for (int64_t k = 0; k < W; ++k) v[k] = vload(dots + (p0 + k) * W);
    transpose_block<T>(v);
    const int64_t m = std::min(W, P - p0);
    for (int64_t l = 0; l < valid; ++l) {
      T* dst = out + (b0 + l) * width + D + p0;
      if (m == W) {
        vstore(dst, v[l]);
      } else {
        for (int64_t k = 0; k < m; ++k) dst[k] = v[l][k];
      }
    }
  }
}

template <typename T>
void forward_rows(const T* dense, const T* sparse, T* out, int64_t B, int64_t F, int64_t D) {
  constexpr int64_t W = kLanes<T>;
  const int64_t n = F + 1, P = n * (n - 1) / 2;
  const std::vector<T> zeros(D, T(0));
  // blocks of W samples; the batch's last B % W are a block whose other lanes read zeros
  at::parallel_for(0, (B + W - 1) / W, std::max<int64_t>(1, 64 / W), [&](int64_t lo, int64_t hi) {
    // every block writes x's first n rows and dots' first P: only what lies past them is zeroed
    const int64_t x_rows = n * D * W, x_size = ((n + kLaneTile) * D + kLaneTile) * W;
    std::unique_ptr<T[]> x(new T[x_size]), dots(new T[(P + W) * W]);
    std::fill(x.get() + x_rows, x.get() + x_size, T(0));
    std::fill(dots.get() + P * W, dots.get() + (P + W) * W, T(0));
    for (int64_t blk = lo; blk < hi; ++blk) {
      // the next block's rows, ahead of the transpositions that read them
      if (blk + 1 < hi) {
        const int64_t next = (blk + 1) * W;
        prefetch_range(sparse + next * F * D, std::min(W, B - next) * F * D * int64_t(sizeof(T)));
      }
      const int64_t b0 = blk * W;
      forward_lanes(dense, sparse, out, b0, std::min(W, B - b0), F, D, zeros.data(), x.get(), dots.get());
    }
  });
}

// The gradient of pair (i, j) of a sample from its packed pair gradients gp (pair_index
// order): symmetric, zero on the diagonal
template <typename T>
inline T pair_grad(const T* gp, int64_t n, int64_t i, int64_t j) {
  if (i == j) return T(0);
  if (i > j) std::swap(i, j);
  return gp[pair_index(i, j, n)];
}

// out_i[d .. d + CV W) = sum_j g_ij e_j[..] (+ grad[b][..] for i = 0, the dense features' own
// gradient) for the R rows i0 ..: R x CV sums in registers over j, each step CV loads of
// e_j and R broadcasts of g for R * CV multiply-adds. g is read where the packed gradient
// holds it, no (n, n) grid is made (its lower half, n (n - 1) / 2 scattered stores a sample,
// was a fifth of the pass): for j < i0 the R rows' g_ij are consecutive in row j's pairs,
// for j >= i0 + R each row's are consecutive in its own, and the R x R block between has
// the diagonal
template <typename T, int R, int CV, typename OutRow>
inline void grad_tile(const T* gp, int64_t n, const T* const* rows, const T* gb, int64_t i0, int64_t d,
                      OutRow out_row) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> acc[R][CV];
  for (int u = 0; u < R; ++u)
    for (int c = 0; c < CV; ++c) acc[u][c] = i0 + u == 0 ? vload(gb + d + c * W) : vzero<T>();
  auto add = [&](int64_t j, const T* s) {  // s[u] = g_{i0 + u, j}
    vec_t<T> e[CV];
    for (int c = 0; c < CV; ++c) e[c] = vload(rows[j] + d + c * W);
    for (int u = 0; u < R; ++u)
      for (int c = 0; c < CV; ++c) acc[u][c] += s[u] * e[c];
  };
  const T* below = gp + i0 - 1;  // j = 0: g_{i0 + u, 0} = gp[row_start(0) + i0 + u - 1]
  for (int64_t j = 0; j < i0; ++j) {
    add(j, below);
    below += n - 2 - j;  // row_start(j + 1) - row_start(j) - 1
  }
  const int64_t block_end = std::min(i0 + R, n);
  for (int64_t j = i0; j < block_end; ++j) {
    T s[R];
    for (int u = 0; u < R; ++u) s[u] = pair_grad(gp, n, i0 + u, j);
    add(j, s);
  }
  const T* own[R];  // own[u][j] = g_{i0 + u, j} for j > i0 + u
  for (int u = 0; u < R; ++u) own[u] = gp + row_start(i0 + u, n) - (i0 + u) - 1;
  for (int64_t j = block_end; j < n; ++j) {
    T s[R];
    for (int u = 0; u < R; ++u) s[u] = own[u][j];
    add(j, s);
  }
  for (int u = 0; u < R; ++u)
    for (int c = 0; c < CV; ++c) vstore(out_row(i0 + u) + d + c * W, acc[u][c]);
}

// grad_tile with the block's row count as a compile-time constant (the last block has fewer)
template <typename T, int R, int CV, typename OutRow>
inline void grad_rows(const T* gp, int64_t n, const T* const* rows, const T* gb, int64_t i0, int64_t rows_here,
                      int64_t d, OutRow out_row) {
  if constexpr (R > 1) {
    if (rows_here < R) return grad_rows<T, R - 1, CV>(gp, n, rows, gb, i0, rows_here, d, out_row);
  }
  grad_tile<T, R, CV>(gp, n, rows, gb, i0, d, out_row);
}

template <typename T>
void backward_rows(const T* grad, const T* dense, const T* sparse, T* grad_dense, T* grad_sparse,
                   int64_t B, int64_t F, int64_t D) {
  constexpr int64_t W = kLanes<T>;
  // gradient rows summed together, each load of e_j feeding kRows multiply-adds: 5 x 2 vectors
  // of sums with 16 registers, 8 x up to 2 with 32. With 16, 6 x 2 (12 sums, 2 loads of e_j
  // and a broadcast: 15 registers) had GCC move its sums through the stack between a tile's
  // three loops over j; 5 x 2 is 1.09x faster on the Zen 3 host (2 threads, inputs cold)
  constexpr int64_t kRows = kVectorRegisters >= 32 ? 8 : 5;
  const int64_t n = F + 1, width = D + n * (n - 1) / 2;
  at::parallel_for(0, B, 64, [&](int64_t lo, int64_t hi) {
    std::vector<const T*> rows(n);
    for (int64_t b = lo; b < hi; ++b) {
      const T* gb = grad + b * width;
      const T* gp = gb + D;  // the packed pair gradients
      for (int64_t i = 0; i < n; ++i) rows[i] = row_of(dense, sparse, b, i, F, D);
      auto out_row = [&](int64_t i) { return i == 0 ? grad_dense + b * D : grad_sparse + (b * F + (i - 1)) * D; };
      // out_i = sum_j g_ij e_j (+ the dense features' own gradient for i = 0): kRows rows x
      // up to 2 vectors over D at a time (grad_tile), the tail of D by scalars
      for (int64_t i0 = 0; i0 < n; i0 += kRows) {
        const int64_t rows_here = std::min(kRows, n - i0);
        int64_t d = 0;
        for (; d + 2 * W <= D; d += 2 * W) grad_rows<T, kRows, 2>(gp, n, rows.data(), gb, i0, rows_here, d, out_row);
        for (; d + W <= D; d += W) grad_rows<T, kRows, 1>(gp, n, rows.data(), gb, i0, rows_here, d, out_row);
        for (; d < D; ++d)
          for (int64_t u = 0; u < rows_here; ++u) {
            const int64_t i = i0 + u;
            T s = i == 0 ? gb[d] : T(0);
            for (int64_t j = 0; j < n; ++j) s += pair_grad(gp, n, i, j) * rows[j][d];
            out_row(i)[d] = s;
          }
      }
    }
  });
}

}  // namespace

// dense (B, D), sparse (B, F, D) -> (B, D + (F + 1) F / 2)
at::Tensor pairwise_dots_forward(at::Tensor dense, at::Tensor sparse) {
  TORCH_CHECK(dense.dim() == 2 && sparse.dim() == 3 && sparse.size(0) == dense.size(0) &&
                  sparse.size(2) == dense.size(1),
              "pairwise_dots: expected dense (B, D) and sparse (B, F, D), got ", dense.sizes(), " and ",
              sparse.sizes());
  TORCH_CHECK(dense.scalar_type() == sparse.scalar_type(), "pairwise_dots: dense and sparse need one dtype");
  dense = dense.contiguous();
  sparse = sparse.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1), n = F + 1;
  auto out = at::empty({B, D + n * (n - 1) / 2}, dense.options());
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "pairwise_dots_forward", [&] {
    forward_rows<scalar_t>(dense.data_ptr<scalar_t>(), sparse.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), B,
                           F, D);
  });
  return out;
}

// (grad_dense (B, D), grad_sparse (B, F, D))
std::vector<at::Tensor> pairwise_dots_backward(at::Tensor grad, at::Tensor dense, at::Tensor sparse) {
  grad = grad.contiguous();
  dense = dense.contiguous();
  sparse = sparse.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1);
  auto grad_dense = at::empty_like(dense);
  auto grad_sparse = at::empty_like(sparse);
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "pairwise_dots_backward", [&] {
    backward_rows<scalar_t>(grad.data_ptr<scalar_t>(), dense.data_ptr<scalar_t>(), sparse.data_ptr<scalar_t>(),
                            grad_dense.data_ptr<scalar_t>(), grad_sparse.data_ptr<scalar_t>(), B, F, D);
  });
  return {grad_dense, grad_sparse};
}

// An extension of its own (built by comera_rec.dlrm.interaction_kernel with the tensor
// core's build, simd.h from comera_rec/tensor/kernels on the include path).
#ifndef COMERA_OPERATOR_LIBRARY  // the operator library (serving_ops_cpu.cpp) binds no Python module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pairwise_dots_forward", &pairwise_dots_forward, COMERA_RELEASE_GIL, "fused pairwise-dot interaction: forward");
  m.def("pairwise_dots_backward", &pairwise_dots_backward, COMERA_RELEASE_GIL, "fused pairwise-dot interaction: backward");
}
#endif
