// Fused CPU pairwise-dot interaction (DLRM): out = [dense, <e_i, e_j> for i < j], with
// e_0 = dense and e_1..e_F the sparse features of the sample, pairs in row-major order.
//
// As tensor ops this is a concatenation, a batched GEMM over (B, n, n) grids, a gather of
// the upper triangle and another concatenation, each a pass over memory; backward a
// zero-padded gather into the grid and a second batched GEMM. Here each sample is done
// in one go while its n rows are in cache: forward, the rows are transposed into a
// (D, n) block so that one multiply-add gives a vector of dot products (n = 27, D = 16:
// 16 multiply-adds per 16 pairs), four rows at a time (each load of the block feeds four
// rows' sums, which do not wait on each other), the dots kept in a small grid and packed
// into the output by whole vectors (below); backward, grad e_i = sum_{j != i} g_ij e_j for eight rows
// i at a time (each load of e_j feeds eight multiply-adds). Samples are independent: the
// result does not depend on the number of threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

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

template <typename T>
void forward_rows(const T* dense, const T* sparse, T* out, int64_t B, int64_t F, int64_t D) {
  constexpr int64_t W = kLanes<T>;
  constexpr int64_t kRows = 4;  // rows whose dot products share every load of the transposed block
  const int64_t n = F + 1, np = padded(n, W), width = D + n * (n - 1) / 2;
  at::parallel_for(0, B, 64, [&](int64_t lo, int64_t hi) {
    std::vector<T> et(D * np, T(0));  // (D, np): the sample's rows transposed, zero past n
    // (n + 1, np): the sample's dots by whole vectors of columns, before they are packed;
    // one spare row for the packing's last loads
    std::vector<T> grid((n + 1) * np, T(0));
    for (int64_t b = lo; b < hi; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        const T* e = row_of(dense, sparse, b, i, F, D);
        for (int64_t d = 0; d < D; ++d) et[d * np + i] = e[d];
      }
      T* o = out + b * width;
      std::copy(dense + b * D, dense + (b + 1) * D, o);
      // dots of rows i0 .. i0 + 3 with e_j for j in the vector blocks from the one holding
      // i0 + 1: each load of a block of et feeds four rows (eight independent sums)
      for (int64_t i0 = 0; i0 + 1 < n; i0 += kRows) {
        const int64_t rows_here = std::min<int64_t>(kRows, n - 1 - i0);
        const T* e[kRows];
        for (int64_t u = 0; u < kRows; ++u) e[u] = row_of(dense, sparse, b, u < rows_here ? i0 + u : i0, F, D);
        for (int64_t j0 = (i0 + 1) / W * W; j0 < n; j0 += W) {
          vec_t<T> a0[kRows], a1[kRows];
          for (int64_t u = 0; u < kRows; ++u) a0[u] = a1[u] = vzero<T>();
          int64_t d = 0;
          for (; d + 2 <= D; d += 2) {
            const vec_t<T> v0 = vload(&et[d * np + j0]), v1 = vload(&et[(d + 1) * np + j0]);
            for (int64_t u = 0; u < kRows; ++u) {
              a0[u] += e[u][d] * v0;
              a1[u] += e[u][d + 1] * v1;
            }
          }
          if (d < D) {
            const vec_t<T> v0 = vload(&et[d * np + j0]);
            for (int64_t u = 0; u < kRows; ++u) a0[u] += e[u][d] * v0;
          }
          for (int64_t u = 0; u < rows_here; ++u) vstore(&grid[(i0 + u) * np + j0], a0[u] + a1[u]);
        }
      }
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

template <typename T>
void backward_rows(const T* grad, const T* dense, const T* sparse, T* grad_dense, T* grad_sparse,
                   int64_t B, int64_t F, int64_t D) {
  constexpr int64_t W = kLanes<T>;
  constexpr int64_t kRows = 8;  // gradient rows summed together: one load of e_j feeds kRows multiply-adds
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
      // out_i = sum_j g_ij e_j (+ the dense features' own gradient for i = 0): kRows rows at a
      // time by vectors over D, the tail by scalars
      for (int64_t i0 = 0; i0 < n; i0 += kRows) {
        const int64_t rows_here = std::min(kRows, n - i0);
        int64_t d = 0;
        for (; d + W <= D; d += W) {
          vec_t<T> acc[kRows];
          for (int64_t u = 0; u < kRows; ++u) acc[u] = (i0 + u == 0) ? vload(gb + d) : vzero<T>();
          // the same loop twice: with the count a compile-time constant the whole block's
          // accumulators stay in registers (one loop with a run-time count, or a lambda
          // over both, measured ~7% slower)
          if (rows_here == kRows) {
            for (int64_t j = 0; j < n; ++j) {
              const vec_t<T> e = vload(rows[j] + d);
              for (int64_t u = 0; u < kRows; ++u) acc[u] += g[(i0 + u) * n + j] * e;
            }
          } else {
            for (int64_t j = 0; j < n; ++j) {
              const vec_t<T> e = vload(rows[j] + d);
              for (int64_t u = 0; u < rows_here; ++u) acc[u] += g[(i0 + u) * n + j] * e;
            }
          }
          for (int64_t u = 0; u < rows_here; ++u) vstore(out_row(i0 + u) + d, acc[u]);
        }
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
torch::Tensor pairwise_dots_forward(torch::Tensor dense, torch::Tensor sparse) {
  TORCH_CHECK(dense.dim() == 2 && sparse.dim() == 3 && sparse.size(0) == dense.size(0) &&
                  sparse.size(2) == dense.size(1),
              "pairwise_dots: expected dense (B, D) and sparse (B, F, D), got ", dense.sizes(), " and ",
              sparse.sizes());
  TORCH_CHECK(dense.scalar_type() == sparse.scalar_type(), "pairwise_dots: dense and sparse need one dtype");
  dense = dense.contiguous();
  sparse = sparse.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1), n = F + 1;
  auto out = torch::empty({B, D + n * (n - 1) / 2}, dense.options());
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "pairwise_dots_forward", [&] {
    forward_rows<scalar_t>(dense.data_ptr<scalar_t>(), sparse.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), B,
                           F, D);
  });
  return out;
}

// (grad_dense (B, D), grad_sparse (B, F, D))
std::vector<torch::Tensor> pairwise_dots_backward(torch::Tensor grad, torch::Tensor dense, torch::Tensor sparse) {
  grad = grad.contiguous();
  dense = dense.contiguous();
  sparse = sparse.contiguous();
  const int64_t B = dense.size(0), D = dense.size(1), F = sparse.size(1);
  auto grad_dense = torch::empty_like(dense);
  auto grad_sparse = torch::empty_like(sparse);
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "pairwise_dots_backward", [&] {
    backward_rows<scalar_t>(grad.data_ptr<scalar_t>(), dense.data_ptr<scalar_t>(), sparse.data_ptr<scalar_t>(),
                            grad_dense.data_ptr<scalar_t>(), grad_sparse.data_ptr<scalar_t>(), B, F, D);
  });
  return {grad_dense, grad_sparse};
}

// An extension of its own (built by comera_rec.dlrm.interaction_kernel with the tensor
// core's build, simd.h from comera_rec/tensor/kernels on the include path).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pairwise_dots_forward", &pairwise_dots_forward, "fused pairwise-dot interaction: forward");
  m.def("pairwise_dots_backward", &pairwise_dots_backward, "fused pairwise-dot interaction: backward");
}
