// Uncompressed embedding tables on CPU: pooled lookup, and a backward that applies the
// exact row-wise Adagrad update in place (no gradient tensor is formed).
//
// The tables lie one after the other in a flat float32 buffer, as a table-batched
// embedding keeps them; feature f reads table rows starting at table_offset[f] (in
// values), D_f = dim_offset[f + 1] - dim_offset[f] values a row, and writes the output
// columns [dim_offset[f], dim_offset[f + 1]). Bags are feature-major: bag f * batch + b.
//
//   forward:  out[b, cols of f] = sum over ids i of bag (f, b) of w_i * row(f, id_i)
//   backward: per distinct row of a table, g = sum over its ids of w_i * grad[b, cols of f];
//             m[row] += mean(g^2);  row -= lr / (sqrt(m[row]) + eps) * g
//
// Each table (all the features that read it) is one thread's: its distinct rows are found
// with a small open-addressing hash of the ids it got (any table size, nothing the size
// of a table is touched), their gradients summed in the order the ids come, and each row
// updated once. The result does not depend on the number of threads.

#include "aten_ops.h"
#include "python_module.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using namespace comera;

constexpr int64_t kAhead = 4;  // distinct rows ahead whose table rows are prefetched in the update

// dst[0:n] += a * src[0:n]
inline void axpy(float* __restrict dst, const float* __restrict src, float a, int64_t n) {
  constexpr int64_t W = kLanes<float>;
  int64_t d = 0;
  for (; d + W <= n; d += W) vstore(dst + d, vload(dst + d) + a * vload(src + d));
  for (; d < n; ++d) dst[d] += a * src[d];
}

// out[0:NV W] = sum over ids i in [i0, i1) of w_i * tab[id_i] (rows of NV vectors), summed
// in registers and stored once rather than added row by row to a zeroed bag in memory
// (Kaggle's 18 small tables, 2 threads: 0.43 -> 0.34 ms a step, docs/performance-history.md).
// An id outside [0, rows) is skipped and sets bad.
template <int NV, typename Index>
inline void pool_vectors(float* out, const float* tab, const Index* id, int64_t i0, int64_t i1, int64_t rows,
                         const float* w, std::atomic<bool>& bad) {
  constexpr int64_t W = kLanes<float>;
  vec_t<float> sum[NV];
  for (int v = 0; v < NV; ++v) sum[v] = vzero<float>();
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t row = id[i];
    if (row < 0 || row >= rows) {
      bad = true;
      continue;
    }
    const float* src = tab + row * (NV * W);
    const float a = w ? w[i] : 1.0f;
    for (int v = 0; v < NV; ++v) sum[v] += a * vload(src + v * W);
  }
  for (int v = 0; v < NV; ++v) vstore(out + v * W, sum[v]);
}

// pool_vectors for rows of D = 1, 2, 4 or 8 whole vectors; false (nothing done) for others.
template <typename Index>
inline bool pool_in_registers(float* out, const float* tab, const Index* id, int64_t i0, int64_t i1, int64_t rows,
                              const float* w, int64_t D, std::atomic<bool>& bad) {
  constexpr int64_t W = kLanes<float>;
  if (D % W != 0) return false;
  switch (D / W) {
    case 1: pool_vectors<1>(out, tab, id, i0, i1, rows, w, bad); return true;
    case 2: pool_vectors<2>(out, tab, id, i0, i1, rows, w, bad); return true;
    case 4: pool_vectors<4>(out, tab, id, i0, i1, rows, w, bad); return true;
    case 8: pool_vectors<8>(out, tab, id, i0, i1, rows, w, bad); return true;
    default: return false;
  }
}

struct Layout {
  int64_t F = 0, batch = 0, total_dim = 0;
  int64_t row_stride = 0;                 // values between the output's rows (total_dim by default)
  const int64_t* table_offset = nullptr;  // (F,) first value of feature f's table in the buffer
  const int64_t* dim_offset = nullptr;    // (F + 1,) feature f's D_f = dim_offset[f + 1] - dim_offset[f]
  const int64_t* col = nullptr;           // (F,) feature f's first output column (dim_offset by default)
  const int64_t* rows = nullptr;          // (F,) rows of feature f's table
  const int64_t* off = nullptr;           // (F * batch + 1,) bag boundaries
  const float* w = nullptr;               // per-id weights or null
};

// out_cols empty: the output is (batch, total_dim), feature f at dim_offset[f]; else rows of
// row_stride values, feature f at out_cols[f] (a caller's layout shared with other lookups).
Layout layout_of(const at::Tensor& table_offset, const at::Tensor& dim_offset, const at::Tensor& rows,
                 const at::Tensor& offsets, const at::Tensor& weights, int64_t batch, int64_t row_stride,
                 const std::vector<int64_t>& out_cols, const char* who) {
  Layout L;
  L.F = table_offset.numel();
  L.batch = batch;
  L.table_offset = table_offset.data_ptr<int64_t>();
  L.dim_offset = dim_offset.data_ptr<int64_t>();
  L.rows = rows.data_ptr<int64_t>();
  L.total_dim = L.dim_offset[L.F];
  L.row_stride = L.total_dim;
  L.col = L.dim_offset;
  if (!out_cols.empty()) {
    TORCH_CHECK(static_cast<int64_t>(out_cols.size()) == L.F, who, ": ", out_cols.size(), " output columns for ", L.F,
                " features");
    for (int64_t f = 0; f < L.F; ++f)
      TORCH_CHECK(out_cols[f] >= 0 && out_cols[f] + L.dim_offset[f + 1] - L.dim_offset[f] <= row_stride, who,
                  ": feature ", f, "'s columns from ", out_cols[f], " outside rows of ", row_stride, " values");
    L.row_stride = row_stride;
    L.col = out_cols.data();
  }
  L.off = offsets.data_ptr<int64_t>();
  L.w = weights.numel() ? weights.data_ptr<float>() : nullptr;
  return L;
}

void check_args(const at::Tensor& buffer, const at::Tensor& table_offset, const at::Tensor& dim_offset,
                const at::Tensor& rows, const at::Tensor& ids, const at::Tensor& offsets,
                const at::Tensor& weights, int64_t batch, const char* who) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(), who, ": the table buffer must be contiguous float32");
  const int64_t F = table_offset.numel();
  TORCH_CHECK(dim_offset.numel() == F + 1 && rows.numel() == F, who, ": per-feature layout of ", F, " features is inconsistent");
  TORCH_CHECK(batch >= 0 && offsets.numel() == F * batch + 1, who, ": ", offsets.numel(), " offsets for ", F,
              " features of batch ", batch);
  TORCH_CHECK(weights.numel() == 0 || weights.numel() == ids.numel(), who, ": ", weights.numel(), " weights for ",
              ids.numel(), " ids");
}

// The first id outside its feature's table, as an error naming it.
template <typename Index>
void name_bad_id(const Layout& L, const Index* id) {
  for (int64_t f = 0; f < L.F; ++f)
    for (int64_t i = L.off[f * L.batch]; i < L.off[(f + 1) * L.batch]; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < L.rows[f], "embedding lookup: id ", static_cast<int64_t>(id[i]),
                  " of feature ", f, " out of range [0, ", L.rows[f], ")");
}

// Open-addressing hash of row -> slot (first-seen order), sized for n keys.
struct RowSlots {
  std::vector<int64_t> key;
  std::vector<int32_t> slot;
  int64_t mask = 0;
  int32_t used = 0;
  explicit RowSlots(int64_t n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    key.assign(cap, -1);
    slot.resize(cap);
    mask = cap - 1;
  }
  int32_t operator()(int64_t row) {
    uint64_t h = (static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> 17;
    for (;; ++h) {
      const int64_t at = static_cast<int64_t>(h) & mask;
      if (key[at] == row) return slot[at];
      if (key[at] < 0) {
        key[at] = row;
        return slot[at] = used++;
      }
    }
  }
};

}  // namespace

// (batch, total_dim) pooled bags; with out_cols, (batch, out_width) with feature f at out_cols[f].
at::Tensor rowwise_bag_forward(at::Tensor buffer, at::Tensor table_offset, at::Tensor dim_offset,
                               at::Tensor rows, at::Tensor ids, at::Tensor offsets, at::Tensor weights,
                               int64_t batch, int64_t out_width, std::vector<int64_t> out_cols) {
  check_args(buffer, table_offset, dim_offset, rows, ids, offsets, weights, batch, "rowwise_bag_forward");
  offsets = offsets.to(at::kLong).contiguous();
  ids = ids.contiguous();
  if (weights.numel()) weights = weights.to(at::kFloat).contiguous();
  const Layout L = layout_of(table_offset, dim_offset, rows, offsets, weights, batch, out_width, out_cols,
                             "rowwise_bag_forward");
  // each bag zeroed by the thread that pools it; with out_cols, the columns no feature
  // names are left for the caller to write
  auto out = at::empty({batch, L.row_stride}, buffer.options());
  const float* table = buffer.data_ptr<float>();
  float* o = out.data_ptr<float>();
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "rowwise_bag_forward", [&] {
    const index_t* id = ids.data_ptr<index_t>();
    std::atomic<bool> bad{false};
    at::parallel_for(0, batch, 64, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t f = 0; f < L.F; ++f) {
          const int64_t D = L.dim_offset[f + 1] - L.dim_offset[f];
          const float* tab = table + L.table_offset[f];
          float* ob = o + b * L.row_stride + L.col[f];
          const int64_t bag = f * batch + b;
          if (b + 2 < b1)  // this feature's rows of two samples ahead
            for (int64_t i = L.off[bag + 2]; i < L.off[bag + 3]; ++i)
              if (id[i] >= 0 && id[i] < L.rows[f]) prefetch_range(tab + id[i] * D, D * sizeof(float));
          if (pool_in_registers(ob, tab, id, L.off[bag], L.off[bag + 1], L.rows[f], L.w, D, bad)) continue;
          std::fill(ob, ob + D, 0.0f);
          for (int64_t i = L.off[bag]; i < L.off[bag + 1]; ++i) {
            const int64_t row = id[i];
            if (row < 0 || row >= L.rows[f]) {
              bad = true;
              continue;
            }
            axpy(ob, tab + row * D, L.w ? L.w[i] : 1.0f, D);
          }
        }
    });
    if (bad) name_bad_id(L, id);
  });
  return out;
}

// Row-wise Adagrad on the rows the bags read, in place on buffer and momentum.
// feature_table: (F,) the table each feature reads (features of one table are summed
// together); momentum_offset: (F,) the first momentum entry of feature f's table.
void rowwise_bag_backward_adagrad(at::Tensor grad, at::Tensor buffer, at::Tensor momentum,
                                  at::Tensor table_offset, at::Tensor momentum_offset, at::Tensor dim_offset,
                                  at::Tensor rows, at::Tensor feature_table, at::Tensor ids,
                                  at::Tensor offsets, at::Tensor weights, int64_t batch, double lr, double eps,
                                  int64_t row_stride, std::vector<int64_t> out_cols) {
  check_args(buffer, table_offset, dim_offset, rows, ids, offsets, weights, batch, "rowwise_bag_backward_adagrad");
  TORCH_CHECK(momentum.scalar_type() == at::kFloat && momentum.is_contiguous(),
              "rowwise_bag_backward_adagrad: momentum must be contiguous float32");
  grad = grad.to(at::kFloat).contiguous();
  offsets = offsets.to(at::kLong).contiguous();
  ids = ids.contiguous();
  if (weights.numel()) weights = weights.to(at::kFloat).contiguous();
  const Layout L = layout_of(table_offset, dim_offset, rows, offsets, weights, batch, row_stride, out_cols,
                             "rowwise_bag_backward_adagrad");
  TORCH_CHECK(grad.size(0) == batch && grad.size(1) == L.row_stride, "rowwise_bag_backward_adagrad: gradient of shape ",
              grad.sizes(), " for (", batch, ", ", L.row_stride, ")");
  const int64_t* mom_off = momentum_offset.data_ptr<int64_t>();
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  // features grouped by table, tables in order of first use
  std::vector<int64_t> tables;
  std::vector<std::vector<int64_t>> features_of;
  for (int64_t f = 0; f < L.F; ++f) {
    auto it = std::find(tables.begin(), tables.end(), ft[f]);
    if (it == tables.end()) {
      tables.push_back(ft[f]);
      features_of.push_back({f});
    } else {
      features_of[it - tables.begin()].push_back(f);
    }
  }
  for (const auto& fs : features_of)
    for (int64_t f : fs)
      TORCH_CHECK(L.dim_offset[f + 1] - L.dim_offset[f] == L.dim_offset[fs[0] + 1] - L.dim_offset[fs[0]] &&
                      L.table_offset[f] == L.table_offset[fs[0]] && mom_off[f] == mom_off[fs[0]],
                  "rowwise_bag_backward_adagrad: features of one table disagree on its layout");
  const float* g = grad.data_ptr<float>();
  float* table = buffer.data_ptr<float>();
  float* mom = momentum.data_ptr<float>();
  const float rate = static_cast<float>(lr), epsilon = static_cast<float>(eps);
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "rowwise_bag_backward_adagrad", [&] {
    const index_t* id = ids.data_ptr<index_t>();
    at::parallel_for(0, static_cast<int64_t>(tables.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const auto& fs = features_of[t];
        const int64_t D = L.dim_offset[fs[0] + 1] - L.dim_offset[fs[0]], nrows = L.rows[fs[0]];
        int64_t n = 0;
        for (int64_t f : fs) n += L.off[(f + 1) * batch] - L.off[f * batch];
        RowSlots slot_of(n);
        std::vector<int64_t> row_of;
        row_of.reserve(n);
        std::vector<float> acc;
        acc.reserve(n * D);
        for (int64_t f : fs)
          for (int64_t b = 0; b < batch; ++b) {
            const float* gb = g + b * L.row_stride + L.col[f];
            const int64_t bag = f * batch + b;
            for (int64_t i = L.off[bag]; i < L.off[bag + 1]; ++i) {
              const int64_t row = id[i];
              TORCH_CHECK(row >= 0 && row < nrows, "embedding lookup: id ", row, " of feature ", f,
                          " out of range [0, ", nrows, ")");
              const int32_t s = slot_of(row);
              if (s == static_cast<int32_t>(row_of.size())) {
                row_of.push_back(row);
                acc.resize(acc.size() + D, 0.0f);
              }
              axpy(acc.data() + s * D, gb, L.w ? L.w[i] : 1.0f, D);
            }
          }
        float* tab = table + L.table_offset[fs[0]];
        float* m = mom + mom_off[fs[0]];
        for (size_t s = 0; s < row_of.size(); ++s) {
          if (s + kAhead < row_of.size()) {
            prefetch_range(tab + row_of[s + kAhead] * D, D * sizeof(float));
            __builtin_prefetch(m + row_of[s + kAhead]);
          }
          const float* gs = acc.data() + s * D;
          float sq = 0.0f;
          for (int64_t d = 0; d < D; ++d) sq += gs[d] * gs[d];
          const float next = m[row_of[s]] + sq / static_cast<float>(D);
          m[row_of[s]] = next;
          axpy(tab + row_of[s] * D, gs, -rate / (std::sqrt(next) + epsilon), D);
        }
      }
    });
  });
}

// An extension of its own (built by comera_rec.integration.rowwise_bag_kernel with the
// tensor core's build, simd.h from comera_rec/tensor/kernels on the include path).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowwise_bag_forward", &rowwise_bag_forward, COMERA_RELEASE_GIL, "pooled lookup of uncompressed tables");
  m.def("rowwise_bag_backward_adagrad", &rowwise_bag_backward_adagrad, COMERA_RELEASE_GIL,
        "row-wise Adagrad update of uncompressed tables from the pooled gradient");
}
