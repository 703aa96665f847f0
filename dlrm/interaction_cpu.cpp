// Fused CPU pairwise-dot interaction (DLRM): out = [dense, <e_i, e_j> for i < j], with
// e_0 = dense and e_1..e_F the sparse features of the sample, pairs in row-major order.
//
// As tensor ops this is a concatenation, a batched GEMM over (B, n, n) grids, a gather of
// the upper triangle and another concatenation, each a pass over memory; backward a
// zero-padded gather into the grid and a second batched GEMM. Here each sample is done
// in one go while its n rows are in cache: forward, the rows are transposed into a
// (D, n) block so that one multiply-add gives a vector of dot products (n = 27, D = 16:
// 16 multiply-adds per 16 pairs), in register tiles of rows x column vectors (3 x 4 with 16
// registers: each step 3 broadcasts and 4 loads for 12 multiply-adds), the dots kept in a
// small grid and packed into the output by whole vectors (below); backward, grad e_i =
// sum_{j != i} g_ij e_j in tiles of rows x vectors over D (6 x 2 with 16 registers). Samples
// are independent: the result does not depend on the number of threads.

#include "aten_ops.h"
#ifndef COMERA_OPERATOR_LIBRARY  // the operator library binds no Python module
#include "python_module.h"
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using namespace comera;

// Row i of sample b: the dense features for i = 0, sparse feature i - 1 otherwise.
template <typename T>
inline const T* row_of(const T* dense, const T* sparse, int64_t b, int64_t i, int64_t F, int64_t D) {
  return i == 0 ? dense + b * D : sparse + (b * F + (i - 1)) * D;
}

// dots of rows i0 .. i0 + R - 1 with the CB column vectors from j0 of the transposed block:
// R x CB sums in registers over d, each step R broadcasts and CB loads of the block for
// R * CB multiply-adds (R = 3, CB = 4 with 16 registers: 12 sums)
template <typename T, int R, int CB>
inline void dot_tile(const T* et, int64_t np, int64_t D, int64_t i0, int64_t j0, T* grid) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> a[R][CB];
  for (int u = 0; u < R; ++u)
    for (int c = 0; c < CB; ++c) a[u][c] = vzero<T>();
  for (int64_t d = 0; d < D; ++d) {
    const T* row = et + d * np;
    vec_t<T> v[CB];
    for (int c = 0; c < CB; ++c) v[c] = vload(row + j0 + c * W);
    for (int u = 0; u < R; ++u) {
      const T s = row[i0 + u];
      for (int c = 0; c < CB; ++c) a[u][c] += s * v[c];
    }
  }
  for (int u = 0; u < R; ++u)
    for (int c = 0; c < CB; ++c) vstore(grid + (i0 + u) * np + j0 + c * W, a[u][c]);
}

template <typename T, int R>
inline void dot_rows(const T* et, int64_t np, int64_t D, int64_t i0, T* grid) {
  constexpr int64_t W = kLanes<T>;
  const int64_t j0 = (i0 + 1) / W * W;  // the first vector block holding a pair (i0, j > i0)
  int64_t j = j0;
  for (; j + 4 * W <= np; j += 4 * W) dot_tile<T, R, 4>(et, np, D, i0, j, grid);
  switch ((np - j) / W) {
    case 3: dot_tile<T, R, 3>(et, np, D, i0, j, grid); break;
    case 2: dot_tile<T, R, 2>(et, np, D, i0, j, grid); break;
    case 1: dot_tile<T, R, 1>(et, np, D, i0, j, grid); break;
    default: break;
  }
}

// dot_rows with the block's row count a compile-time constant (the last block has fewer)
template <typename T, int R>
inline void dot_rows_upto(const T* et, int64_t np, int64_t D, int64_t i0, int64_t rows_here, T* grid) {
  if constexpr (R > 1) {
    if (rows_here < R) return dot_rows_upto<T, R - 1>(et, np, D, i0, rows_here, grid);
  }
  dot_rows<T, R>(et, np, D, i0, grid);
}

template <typename T>
void forward_rows(const T* dense, const T* sparse, T* out, int64_t B, int64_t F, int64_t D) {
  // rows whose dot products share every load of the transposed block: with 16 registers 3 x 4
  // vectors of sums, with 32 (64-byte vectors: at most 2 column vectors) 6 x 2
  constexpr int64_t kRows = kVectorRegisters >= 32 ? 6 : 3;
  constexpr int64_t W = kLanes<T>;
  const int64_t n = F + 1, np = padded(n, W), width = D + n * (n - 1) / 2;
  at::parallel_for(0, B, 64, [&](int64_t lo, int64_t hi) {
    std::vector<T> et(D * np, T(0));  // (D, np): the sample's rows transposed, zero past n
    // (n + 1, np): the sample's dots by whole vectors of columns, before they are packed;
    // one spare row for the packing's last loads
    std::vector<T> grid((n + 1) * np, T(0));
    for (int64_t b = lo; b < hi; ++b) {
      // the next sample's rows, ahead of the transposition that reads them
      if (b + 1 < hi) {
        const char* next = reinterpret_cast<const char*>(sparse + (b + 1) * F * D);
        for (int64_t k = 0; k < F * D * int64_t(sizeof(T)); k += 64) __builtin_prefetch(next + k);
      }
      for (int64_t i = 0; i < n; ++i) {
        const T* e = row_of(dense, sparse, b, i, F, D);
        for (int64_t d = 0; d < D; ++d) et[d * np + i] = e[d];
      }
      T* o = out + b * width;
      std::copy(dense + b * D, dense + (b + 1) * D, o);
      for (int64_t i0 = 0; i0 < n - 1; i0 += kRows)
        dot_rows_upto<T, kRows>(et.data(), np, D, i0, std::min<int64_t>(kRows, n - 1 - i0), grid.data());
      // row i's pairs (i, i + 1 .. n - 1) follow row i - 1's in the output: copied by whole
      // vectors, each row's last one spilling into the next row's place (written next),
      // where a masked store per (row, vector) cost a third of the pass (AMD Zen 3); lanes
      // past the sample's end go one by one
      T* const end = o + width;
      T* dst = o + D;
      for (int64_t i = 0; i + 1 < n; ++i) {
        const T* src = &grid[i * np + i + 1];
        const int64_t m = n - 1 - i;
        int64_t k = 0;
        for (; k < m && dst + k + W <= end; k += W) vstore(dst + k, vload(src + k));
        for (; k < m; ++k) dst[k] = src[k];
        dst += m;
      }
    }
  });
}

// out_i[d .. d + CV W) = sum_j g_ij e_j[..] (+ grad[b][..] for i = 0, the dense features' own
// gradient) for the R rows i0 ..: R x CV sums in registers over j, each step CV loads of
// e_j and R broadcasts of g for R * CV multiply-adds
template <typename T, int R, int CV, typename OutRow>
inline void grad_tile(const T* g, int64_t n, const T* const* rows, const T* gb, int64_t i0, int64_t d,
                      OutRow out_row) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> acc[R][CV];
  for (int u = 0; u < R; ++u)
    for (int c = 0; c < CV; ++c) acc[u][c] = i0 + u == 0 ? vload(gb + d + c * W) : vzero<T>();
  for (int64_t j = 0; j < n; ++j) {
    vec_t<T> e[CV];
    for (int c = 0; c < CV; ++c) e[c] = vload(rows[j] + d + c * W);
    for (int u = 0; u < R; ++u) {
      const T s = g[(i0 + u) * n + j];
      for (int c = 0; c < CV; ++c) acc[u][c] += s * e[c];
    }
  }
  for (int u = 0; u < R; ++u)
    for (int c = 0; c < CV; ++c) vstore(out_row(i0 + u) + d + c * W, acc[u][c]);
}

// grad_tile with the block's row count as a compile-time constant (the last block has fewer)
template <typename T, int R, int CV, typename OutRow>
inline void grad_rows(const T* g, int64_t n, const T* const* rows, const T* gb, int64_t i0, int64_t rows_here,
                      int64_t d, OutRow out_row) {
  if constexpr (R > 1) {
    if (rows_here < R) return grad_rows<T, R - 1, CV>(g, n, rows, gb, i0, rows_here, d, out_row);
  }
  grad_tile<T, R, CV>(g, n, rows, gb, i0, d, out_row);
}

template <typename T>
void backward_rows(const T* grad, const T* dense, const T* sparse, T* grad_dense, T* grad_sparse,
                   int64_t B, int64_t F, int64_t D) {
  constexpr int64_t W = kLanes<T>;
  // gradient rows summed together, each load of e_j feeding kRows multiply-adds: 6 x 2 vectors
  // of sums with 16 registers, 8 x up to 2 with 32
  constexpr int64_t kRows = kVectorRegisters >= 32 ? 8 : 6;
  const int64_t n = F + 1, width = D + n * (n - 1) / 2;
  at::parallel_for(0, B, 64, [&](int64_t lo, int64_t hi) {
    std::vector<T> g(n * n);  // the sample's symmetric grid of pair gradients, zero diagonal
    std::vector<const T*> rows(n);
    for (int64_t b = lo; b < hi; ++b) {
      const T* gb = grad + b * width;
      const T* gp = gb + D;
      for (int64_t i = 0; i < n; ++i) {  // row i's upper part is contiguous in the packed gradient
        g[i * n + i] = T(0);
        std::copy(gp, gp + (n - 1 - i), &g[i * n + i + 1]);
        for (int64_t j = i + 1; j < n; ++j) g[j * n + i] = gp[j - i - 1];
        gp += n - 1 - i;
        rows[i] = row_of(dense, sparse, b, i, F, D);
      }
      auto out_row = [&](int64_t i) { return i == 0 ? grad_dense + b * D : grad_sparse + (b * F + (i - 1)) * D; };
      // out_i = sum_j g_ij e_j (+ the dense features' own gradient for i = 0): kRows rows x
      // up to 2 vectors over D at a time (grad_tile), the tail of D by scalars
      for (int64_t i0 = 0; i0 < n; i0 += kRows) {
        const int64_t rows_here = std::min(kRows, n - i0);
        int64_t d = 0;
        for (; d + 2 * W <= D; d += 2 * W)
          grad_rows<T, kRows, 2>(g.data(), n, rows.data(), gb, i0, rows_here, d, out_row);
        for (; d + W <= D; d += W) grad_rows<T, kRows, 1>(g.data(), n, rows.data(), gb, i0, rows_here, d, out_row);
        for (; d < D; ++d)
          for (int64_t u = 0; u < rows_here; ++u) {
            const int64_t i = i0 + u;
            T s = i == 0 ? gb[d] : T(0);
            for (int64_t j = 0; j < n; ++j) s += g[i * n + j] * rows[j][d];
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
  m.def("pairwise_dots_forward", &pairwise_dots_forward, "fused pairwise-dot interaction: forward");
  m.def("pairwise_dots_backward", &pairwise_dots_backward, "fused pairwise-dot interaction: backward");
}
#endif
