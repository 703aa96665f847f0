// Fused CPU TTM embedding-bag lookup: per id, contract its prefix and suffix blocks and
// add the row into its bag, in one pass; the backward scatters into both half tables.
//
// The halves are read through strided 6-D views, so they stay in the layout their GEMM
// wrote (no transposed copy):
//   left  (T, n1, n2, m1, m2, r)   key = (t * n1 + i1) * n2 + i2, block (m1 m2, r)
//   right (T, na, nb, mb, r, ma)   key = (t * na + ia) * nb + ib, block (mb, r, ma)
// Row layout of an id: column (x * ma + a) * mb + b, x = a1 * m2 + a2, first D kept.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

struct View6 {
  int64_t size[6];
  int64_t stride[6];
};

View6 view_of(const torch::Tensor& t) {
  TORCH_CHECK(t.dim() == 6, "ttm_cpu: expected a 6-D half view, got ", t.dim(), " dims");
  View6 v;
  for (int k = 0; k < 6; ++k) {
    v.size[k] = t.size(k);
    v.stride[k] = t.stride(k);
  }
  return v;
}

// Offset of a key's block: the key runs over the first three dimensions, row-major.
inline int64_t key_offset(const View6& v, int64_t key) {
  const int64_t k2 = key % v.size[2];
  const int64_t rest = key / v.size[2];
  const int64_t k1 = rest % v.size[1];
  const int64_t k0 = rest / v.size[1];
  return k0 * v.stride[0] + k1 * v.stride[1] + k2 * v.stride[2];
}

struct Dims {
  int64_t m1, m2, r, mb, ma, dim;
};

constexpr int64_t kMaxRank = 256;

Dims dims_of(const View6& left, const View6& right, int64_t dim) {
  TORCH_CHECK(left.size[5] == right.size[4], "ttm_cpu: middle ranks differ (", left.size[5], " vs ",
              right.size[4], ")");
  Dims d{left.size[3], left.size[4], left.size[5], right.size[3], right.size[5], dim};
  TORCH_CHECK(dim <= d.m1 * d.m2 * d.ma * d.mb, "ttm_cpu: embedding_dim ", dim, " exceeds the padded row");
  TORCH_CHECK(d.r <= kMaxRank && d.ma * d.mb <= 16, "ttm_cpu: rank ", d.r, " or suffix block ", d.ma * d.mb,
              " above the kernel's limits (", kMaxRank, ", 16)");
  TORCH_CHECK(left.stride[5] == 1, "ttm_cpu: the left half's rank dimension must be contiguous");
  return d;
}


// The suffix block of one key transposed into rt[c * r + k], c = a * mb + b, so that every
// column of the row is a contiguous dot product over the rank.
template <typename scalar_t>
inline void load_suffix(const scalar_t* R, const View6& rv, const Dims& d, scalar_t* rt) {
  for (int64_t a = 0; a < d.ma; ++a)
    for (int64_t b = 0; b < d.mb; ++b) {
      const scalar_t* src = R + b * rv.stride[3] + a * rv.stride[5];
      scalar_t* dst = rt + (a * d.mb + b) * d.r;
      for (int64_t k = 0; k < d.r; ++k) dst[k] = src[k * rv.stride[4]];
    }
}

template <typename scalar_t>
inline scalar_t dot(const scalar_t* u, const scalar_t* v, int64_t n) {
  scalar_t s = 0;
  _Pragma("omp simd reduction(+ : s)")
  for (int64_t k = 0; k < n; ++k) s += u[k] * v[k];
  return s;
}

template <typename scalar_t>
void contract_row(const scalar_t* L, const View6& lv, const scalar_t* R, const View6& rv, const Dims& d,
                  scalar_t* acc) {
  // acc[x * C + c] += sum_k L[x, k] R^T[c, k], C = ma * mb, first D columns only
  scalar_t rt[kMaxRank * 16];
  load_suffix(R, rv, d, rt);
  const int64_t C = d.ma * d.mb;
  int64_t col = 0;  // = x * C + c, no divisions in the loop
  for (int64_t a1 = 0; a1 < d.m1; ++a1)
    for (int64_t a2 = 0; a2 < d.m2; ++a2) {
      const scalar_t* lrow = L + a1 * lv.stride[3] + a2 * lv.stride[4];
      for (int64_t c = 0; c < C; ++c, ++col) {
        if (col >= d.dim) return;
        acc[col] += dot(lrow, rt + c * d.r, d.r);
      }
    }
}

}  // namespace

// out (B, D): bag b sums the rows of ids offsets[b] .. offsets[b + 1].
torch::Tensor ttm_bag_forward(torch::Tensor left, torch::Tensor right, torch::Tensor prefix_keys,
                              torch::Tensor suffix_keys, torch::Tensor offsets, int64_t dim) {
  TORCH_CHECK(left.device().is_cpu() && right.device().is_cpu(), "ttm_cpu: CPU tensors only");
  TORCH_CHECK(left.scalar_type() == right.scalar_type(), "ttm_cpu: halves of different dtypes");
  const View6 lv = view_of(left), rv = view_of(right);
  const Dims d = dims_of(lv, rv, dim);
  auto pk = prefix_keys.contiguous().to(torch::kLong);
  auto sk = suffix_keys.contiguous().to(torch::kLong);
  auto off = offsets.contiguous().to(torch::kLong);
  const int64_t bags = off.numel() - 1;
  auto out = torch::zeros({bags, dim}, left.options());
  const int64_t* pkp = pk.data_ptr<int64_t>();
  const int64_t* skp = sk.data_ptr<int64_t>();
  const int64_t* offp = off.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(left.scalar_type(), "ttm_bag_forward", [&] {
    const scalar_t* L = left.data_ptr<scalar_t>();
    const scalar_t* R = right.data_ptr<scalar_t>();
    scalar_t* O = out.data_ptr<scalar_t>();
    at::parallel_for(0, bags, 64, [&](int64_t begin, int64_t end) {
      for (int64_t bag = begin; bag < end; ++bag) {
        for (int64_t i = offp[bag]; i < offp[bag + 1]; ++i) {
          contract_row(L + key_offset(lv, pkp[i]), lv, R + key_offset(rv, skp[i]), rv, d, O + bag * dim);
        }
      }
    });
  });
  return out;
}

// Gradients of both halves (zero-filled tensors with the halves' strides). Thread s of S
// owns the prefix keys with key % S == s, thread S + s the suffix keys: no two threads
// write the same block, so no atomics.
std::vector<torch::Tensor> ttm_bag_backward(torch::Tensor grad_out, torch::Tensor left, torch::Tensor right,
                                            torch::Tensor prefix_keys, torch::Tensor suffix_keys,
                                            torch::Tensor offsets) {
  const View6 lv = view_of(left), rv = view_of(right);
  const int64_t dim = grad_out.size(1);
  const Dims d = dims_of(lv, rv, dim);
  auto g = grad_out.contiguous();
  auto pk = prefix_keys.contiguous().to(torch::kLong);
  auto sk = suffix_keys.contiguous().to(torch::kLong);
  auto off = offsets.contiguous().to(torch::kLong);
  auto grad_left = torch::zeros_like(left);  // same strides (dense, non-overlapping views)
  auto grad_right = torch::zeros_like(right);
  const View6 glv = view_of(grad_left), grv = view_of(grad_right);
  const int64_t bags = off.numel() - 1;
  const int64_t* pkp = pk.data_ptr<int64_t>();
  const int64_t* skp = sk.data_ptr<int64_t>();
  const int64_t* offp = off.data_ptr<int64_t>();
  const int64_t shards = std::max<int64_t>(1, at::get_num_threads());
  AT_DISPATCH_FLOATING_TYPES(left.scalar_type(), "ttm_bag_backward", [&] {
    const scalar_t* L = left.data_ptr<scalar_t>();
    const scalar_t* R = right.data_ptr<scalar_t>();
    const scalar_t* G = g.data_ptr<scalar_t>();
    scalar_t* GL = grad_left.data_ptr<scalar_t>();
    scalar_t* GR = grad_right.data_ptr<scalar_t>();
    at::parallel_for(0, 2 * shards, 1, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const bool prefix_side = job < shards;
        const int64_t shard = prefix_side ? job : job - shards;
        for (int64_t bag = 0; bag < bags; ++bag) {
          const scalar_t* gb = G + bag * dim;
          for (int64_t i = offp[bag]; i < offp[bag + 1]; ++i) {
            const int64_t key = prefix_side ? pkp[i] : skp[i];
            if (key % shards != shard) continue;
            const scalar_t* Lp = L + key_offset(lv, pkp[i]);
            const scalar_t* Rp = R + key_offset(rv, skp[i]);
            const int64_t C = d.ma * d.mb;
            if (prefix_side) {  // dL[x, k] += sum_c g[x C + c] R^T[c, k]
              scalar_t rt[kMaxRank * 16];
              load_suffix(Rp, rv, d, rt);
              scalar_t* GLp = GL + key_offset(glv, pkp[i]);
              int64_t col = 0;
              for (int64_t a1 = 0; a1 < d.m1; ++a1)
                for (int64_t a2 = 0; a2 < d.m2; ++a2) {
                  scalar_t* gl = GLp + a1 * glv.stride[3] + a2 * glv.stride[4];
                  for (int64_t c = 0; c < C && col < dim; ++c, ++col) {
                    const scalar_t gv = gb[col];
                    const scalar_t* rc = rt + c * d.r;
                    _Pragma("omp simd")
                    for (int64_t k = 0; k < d.r; ++k) gl[k] += gv * rc[k];
                  }
                }
            } else {  // dR^T[c, k] += sum_x g[x C + c] L[x, k], then into R's layout
              scalar_t drt[kMaxRank * 16];
              std::fill(drt, drt + C * d.r, scalar_t(0));
              int64_t col = 0;
              for (int64_t a1 = 0; a1 < d.m1; ++a1)
                for (int64_t a2 = 0; a2 < d.m2; ++a2) {
                  const scalar_t* lrow = Lp + a1 * lv.stride[3] + a2 * lv.stride[4];
                  for (int64_t c = 0; c < C && col < dim; ++c, ++col) {
                    const scalar_t gv = gb[col];
                    scalar_t* dc = drt + c * d.r;
                    _Pragma("omp simd")
                    for (int64_t k = 0; k < d.r; ++k) dc[k] += gv * lrow[k];
                  }
                }
              scalar_t* GRp = GR + key_offset(grv, skp[i]);
              for (int64_t a = 0; a < d.ma; ++a)
                for (int64_t b = 0; b < d.mb; ++b) {
                  scalar_t* dst = GRp + b * grv.stride[3] + a * grv.stride[5];
                  const scalar_t* src = drt + (a * d.mb + b) * d.r;
                  for (int64_t k = 0; k < d.r; ++k) dst[k * grv.stride[4]] += src[k];
                }
            }
          }
        }
      }
    });
  });
  return {grad_left, grad_right};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ttm_bag_forward", &ttm_bag_forward, "fused TTM embedding-bag forward (CPU)");
  m.def("ttm_bag_backward", &ttm_bag_backward, "fused TTM embedding-bag backward into both halves (CPU)");
}
