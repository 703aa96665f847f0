// The fused CPU scoring kernels as PyTorch operators, torch.ops.comera_rec.*, for exported
// DLRM programs (TTM lookups, TT layers, the pairwise-dot interaction, the DCN cross net alone
// or with the top MLP's TT layers) (comera_rec/dlrm/export.py, kernels=True). A library of its
// own, built from the kernels' sources without their Python bindings (COMERA_OPERATOR_LIBRARY),
// so that a server loads it with torch.ops.load_library alone: no comera-rec, no TorchRec. Each
// operator has a Meta kernel (the output's shape) for torch.export to trace it.
//
// The operands are as the exported program stores them, independent of the host's vector
// width (the same program runs on AVX2 and AVX-512 hosts): a TT layer's merged chains
// unpacked (packed per call, a few microseconds), TTM halves with the rank padded to a
// multiple of 64 bytes (whole vectors at every width).

#include "aten_ops.h"
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "simd.h"

// ttm_cpu.cpp, tt_linear_cpu.cpp, interaction_cpu.cpp
void ttm_bag_forward_halves_into(at::Tensor ptab, at::Tensor stab, at::Tensor ids, at::Tensor trains,
                                 at::Tensor offsets, at::Tensor weights, int64_t dim, int64_t batch, int64_t T,
                                 int64_t Nr, at::Tensor out, int64_t row_stride,
                                 const std::vector<int64_t>& stream_cols);
std::vector<at::Tensor> tt_linear_forward(at::Tensor x, at::Tensor left, at::Tensor right,
                                          at::Tensor bias, bool relu);
at::Tensor pairwise_dots_forward(at::Tensor dense, at::Tensor sparse);
at::Tensor tt_cross_forward(std::vector<at::Tensor> x0_parts, std::vector<at::Tensor> lefts,
                            std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                            int64_t block_rows, std::vector<at::Tensor> next_lefts,
                            std::vector<at::Tensor> next_rights, std::vector<at::Tensor> next_biases,
                            std::vector<bool> next_relus);

namespace {

// Below this many rows a TT layer or cross net is two plain products per layer: the fused
// kernels pack their weights on every call (a program's operands do not depend on the
// host's vector width), which costs more than a few rows' arithmetic (MLPerf's cross net:
// 1.25 ms a one-row call).
constexpr int64_t kPackedRows = 8;

// Every bag of a key-major batch (values (N,) ids, offsets (F B + 1,)), pooled (sums) and
// returned sample-major, (B, F, D):
// - a feature f with dense_base[f] >= 0 reads rows dense_base[f] .. + dense_rows[f] of the
//   uncompressed tables' concatenated weight dense_weight (W, D);
// - a feature f that table tables[s, f] >= 0 of stack s reads is pooled over that stack's
//   whole halves (lefts[s] (T N_l, M_l, rp), rights[s] (T N_r, M_r, rp); N_l = prefix_rows[s],
//   N_r = suffix_rows[s]), one kernel call per stack, which writes the bags straight into
//   the output's rows (a stack's own result copied in after was ~3% of an MLPerf batch);
// then one pass over the samples adds up the uncompressed tables' bags. No (F B, D)
// intermediate, no transposition.
at::Tensor ttm_halves_bags(const at::Tensor& values, const at::Tensor& offsets,
                           const at::Tensor& dense_weight, const at::Tensor& dense_base,
                           const at::Tensor& dense_rows, std::vector<at::Tensor> lefts,
                           std::vector<at::Tensor> rights, const at::Tensor& tables,
                           std::vector<int64_t> prefix_rows, std::vector<int64_t> suffix_rows) {
  const int64_t S = static_cast<int64_t>(lefts.size());
  TORCH_CHECK(rights.size() == lefts.size() && prefix_rows.size() == lefts.size() &&
                  suffix_rows.size() == lefts.size(),
              "ttm_halves_bags: ", lefts.size(), " left halves, ", rights.size(), " right halves, ",
              prefix_rows.size(), " and ", suffix_rows.size(), " row counts: one of each per stack");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == S, "ttm_halves_bags: tables must be (stacks, features), got ",
              tables.sizes(), " for ", S, " stacks");
  TORCH_CHECK(dense_weight.dim() == 2 && offsets.dim() == 1 && values.dim() == 1,
              "ttm_halves_bags: expected dense_weight (W, D), values (N,) and offsets (F B + 1,), got ",
              dense_weight.sizes(), ", ", values.sizes(), " and ", offsets.sizes());
  const int64_t F = tables.size(1), bags = offsets.size(0) - 1, dim = dense_weight.size(1);
  TORCH_CHECK(F >= 1 && bags >= 0 && bags % F == 0, "ttm_halves_bags: ", bags, " bags are not whole rows of ", F,
              " features");
  TORCH_CHECK(dense_base.numel() == F && dense_rows.numel() == F, "ttm_halves_bags: dense_base and dense_rows need ",
              F, " values (one per feature), got ", dense_base.numel(), " and ", dense_rows.numel());
  const int64_t B = bags / F;
  const auto dense = dense_weight.contiguous();
  const auto dbase = dense_base.to(at::kLong).contiguous();
  const auto drows = dense_rows.to(at::kLong).contiguous();
  const int64_t* first_row = dbase.data_ptr<int64_t>();
  const int64_t* num_rows = drows.data_ptr<int64_t>();
  for (int64_t f = 0; f < F; ++f)
    TORCH_CHECK(first_row[f] < 0 || (num_rows[f] >= 0 && first_row[f] + num_rows[f] <= dense.size(0)),
                "ttm_halves_bags: feature ", f, "'s rows [", first_row[f], ", ", first_row[f] + num_rows[f],
                ") outside the ", dense.size(0), " rows of dense_weight");
  const auto off = offsets.to(at::kLong).contiguous();
  const auto ids = values.to(at::kLong).contiguous();
  const auto tab = tables.to(at::kLong).contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t* t_of = tab.data_ptr<int64_t>();
  const auto none = at::empty({0}, ids.options());
  // per feature: the stack that pools its bags (-1: an uncompressed table)
  std::vector<int64_t> stack_of(F, -1);
  // every bag written once: a stack's straight into its features' columns, the rest below
  auto out = at::empty({B, F, dim}, dense.options());
  for (int64_t s = 0; s < S; ++s) {
    const auto& left = lefts[s];
    const auto& right = rights[s];
    const int64_t Nl = prefix_rows[s], Nr = suffix_rows[s];
    TORCH_CHECK(left.dim() == 3 && right.dim() == 3 && Nl >= 1 && Nr >= 1 && left.size(0) % Nl == 0 &&
                    right.size(0) == left.size(0) / Nl * Nr,
                "ttm_halves_bags: stack ", s, "'s halves ", left.sizes(), " and ", right.sizes(), " are not tables of ",
                Nl, " prefixes and ", Nr, " suffixes");
    TORCH_CHECK(left.scalar_type() == dense.scalar_type(), "ttm_halves_bags: stack ", s, "'s halves are ",
                left.scalar_type(), ", the bags ", dense.scalar_type());
    const int64_t lanes = comera::kVectorBytes / static_cast<int64_t>(left.element_size());
    TORCH_CHECK(left.size(2) % lanes == 0, "ttm_halves_bags: stack ", s, "'s rank is padded to ", left.size(2),
                ", not a whole number of this host's ", lanes, "-value vectors (export pads it to 64 bytes)");
    const int64_t T = left.size(0) / Nl;
    // the stack's features' ids side by side (a table index per id), their bags' offsets
    // rebased: one kernel call per stack, its bags stream-major as the kernel lays out
    // (B, F_s D) with batch B
    std::vector<int64_t> features;
    int64_t n_ids = 0;
    for (int64_t f = 0; f < F; ++f) {
      const int64_t t = t_of[s * F + f];
      if (t < 0) continue;
      TORCH_CHECK(t < T, "ttm_halves_bags: feature ", f, " reads table ", t, " of a stack of ", T);
      TORCH_CHECK(stack_of[f] < 0, "ttm_halves_bags: feature ", f, " is read by stacks ", stack_of[f], " and ", s);
      TORCH_CHECK(first_row[f] < 0, "ttm_halves_bags: feature ", f, " is read by stack ", s, " and a dense table");
      const int64_t lo = o[f * B], hi = o[(f + 1) * B];
      TORCH_CHECK(lo >= 0 && lo <= hi && hi <= ids.size(0), "ttm_halves_bags: feature ", f, "'s offsets [", lo, ", ",
                  hi, ") outside the ", ids.size(0), " ids");
      stack_of[f] = s;
      features.push_back(f);
      n_ids += hi - lo;
    }
    if (features.empty() || B == 0) continue;
    const int64_t Fs = static_cast<int64_t>(features.size());
    auto stack_ids = at::empty({n_ids}, ids.options());
    auto stack_tables = at::empty({n_ids}, ids.options());
    auto stack_offsets = at::empty({Fs * B + 1}, off.options());
    int64_t* si = stack_ids.data_ptr<int64_t>();
    int64_t* st = stack_tables.data_ptr<int64_t>();
    int64_t* so = stack_offsets.data_ptr<int64_t>();
    const int64_t* all_ids = ids.data_ptr<int64_t>();
    int64_t at_id = 0;
    for (int64_t j = 0; j < Fs; ++j) {
      const int64_t f = features[j], t = t_of[s * F + f], lo = o[f * B], hi = o[(f + 1) * B];
      std::copy(all_ids + lo, all_ids + hi, si + at_id);
      std::fill(st + at_id, st + at_id + (hi - lo), t);
      for (int64_t b = 0; b < B; ++b) so[j * B + b] = at_id + o[f * B + b] - lo;
      at_id += hi - lo;
    }
    so[Fs * B] = at_id;
    std::vector<int64_t> cols(Fs);  // feature f's bags at columns f * dim of out's rows
    for (int64_t j = 0; j < Fs; ++j) cols[j] = features[j] * dim;
    ttm_bag_forward_halves_into(left, right, stack_ids, stack_tables, stack_offsets, none, dim, B, T, Nr, out, F * dim,
                                cols);
  }
  for (int64_t f = 0; f < F; ++f)
    TORCH_CHECK(stack_of[f] >= 0 || first_row[f] >= 0, "ttm_halves_bags: feature ", f, " is read by no table");
  std::vector<int64_t> dense_features;  // the uncompressed tables' features
  for (int64_t f = 0; f < F; ++f)
    if (stack_of[f] < 0) dense_features.push_back(f);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::atomic<bool> bad{false};
  if (!dense_features.empty() && B > 0) AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "ttm_halves_bags", [&] {
    using T_ = scalar_t;
    const T_* W = dense.data_ptr<T_>();
    T_* dst = out.data_ptr<T_>();
    at::parallel_for(0, B, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b)
        for (const int64_t f : dense_features) {
          T_* row = dst + (b * F + f) * dim;
          std::fill_n(row, dim, T_(0));  // an uncompressed table's bag: the sum of its rows
          for (int64_t i = o[f * B + b]; i < o[f * B + b + 1]; ++i) {
            if (id[i] < 0 || id[i] >= num_rows[f]) {
              bad = true;
              continue;
            }
            const T_* src = W + (first_row[f] + id[i]) * dim;
            for (int64_t d = 0; d < dim; ++d) row[d] += src[d];
          }
        }
    });
  });
  if (bad) {  // name the first id outside its table
    for (int64_t f = 0; f < F; ++f) {
      if (stack_of[f] >= 0) continue;
      for (int64_t i = o[f * B]; i < o[(f + 1) * B]; ++i)
        TORCH_CHECK(id[i] >= 0 && id[i] < num_rows[f], "ttm_halves_bags: feature ", f, "'s id ", id[i],
                    " out of range [0, ", num_rows[f], ") of its table");
    }
  }
  return out;
}

at::Tensor ttm_halves_bags_meta(const at::Tensor& values, const at::Tensor& offsets,
                                const at::Tensor& dense_weight, const at::Tensor& dense_base,
                                const at::Tensor& dense_rows, std::vector<at::Tensor> lefts,
                                std::vector<at::Tensor> rights, const at::Tensor& tables,
                                std::vector<int64_t> prefix_rows, std::vector<int64_t> suffix_rows) {
  const int64_t F = tables.size(1);
  return at::empty_symint({(offsets.sym_size(0) - 1) / F, c10::SymInt(F), dense_weight.sym_size(1)},
                          dense_weight.options());
}

// relu?(x @ left @ right + bias): x (B, in), left (in, r), right (r, out).
at::Tensor tt_linear(const at::Tensor& x, const at::Tensor& left, const at::Tensor& right,
                     const std::optional<at::Tensor>& bias, bool relu) {
  if (x.dim() == 2 && x.size(0) < kPackedRows) {
    const auto t = at::mm(x, left);
    auto y = bias.has_value() ? at::addmm(*bias, t, right) : at::mm(t, right);
    return relu ? y.clamp_min_(0) : y;
  }
  const auto b = bias.has_value() ? *bias : at::empty({0}, x.options());
  return tt_linear_forward(x, left, right, b, relu)[0];
}

at::Tensor tt_linear_meta(const at::Tensor& x, const at::Tensor& left, const at::Tensor& right,
                          const std::optional<at::Tensor>& bias, bool relu) {
  TORCH_CHECK(x.dim() == 2 && right.dim() == 2, "tt_linear: x and right must be matrices");
  return at::empty_symint({x.sym_size(0), right.sym_size(1)}, x.options());
}

at::Tensor pairwise_dots(const at::Tensor& dense, const at::Tensor& sparse) {
  return pairwise_dots_forward(dense, sparse);
}

at::Tensor pairwise_dots_meta(const at::Tensor& dense, const at::Tensor& sparse) {
  TORCH_CHECK(dense.dim() == 2 && sparse.dim() == 3, "pairwise_dots: expected dense (B, D) and sparse (B, F, D)");
  // sizes as SymInts throughout: size(i) of a traced tensor would fix every dim (the batch too)
  const c10::SymInt n = sparse.sym_size(1) + 1;
  return at::empty_symint({dense.sym_size(0), dense.sym_size(1) + n * (n - 1) / 2}, dense.options());
}

// Whether a cross net of these inputs is two plain products per layer (kPackedRows).
bool few_cross_rows(const std::vector<at::Tensor>& x0_parts, const std::vector<at::Tensor>& lefts,
                    const std::vector<at::Tensor>& rights, const std::vector<at::Tensor>& biases) {
  return !x0_parts.empty() && x0_parts[0].dim() == 2 && x0_parts[0].size(0) < kPackedRows &&
         rights.size() == lefts.size() && biases.size() == lefts.size();
}

// few_cross_rows' cross net: x0_parts joined, then each layer's products.
at::Tensor cross_by_products(const std::vector<at::Tensor>& x0_parts, const std::vector<at::Tensor>& lefts,
                             const std::vector<at::Tensor>& rights, const std::vector<at::Tensor>& biases) {
  const auto x0 = x0_parts.size() == 1 ? x0_parts[0] : at::cat(x0_parts, 1);
  auto x = x0;
  for (size_t k = 0; k < lefts.size(); ++k) {
    const auto t = at::mm(x, lefts[k]);
    x = at::addcmul(x, x0, biases[k].numel() ? at::addmm(biases[k], t, rights[k]) : at::mm(t, rights[k]));
  }
  return x;
}

// A DCN cross net, x_{k+1} = x_k + x0 * ((x_k @ left_k) @ right_k + bias_k), x0 the column
// blocks x0_parts side by side (never joined into one tensor); empty biases: none.
at::Tensor tt_cross(std::vector<at::Tensor> x0_parts, std::vector<at::Tensor> lefts,
                    std::vector<at::Tensor> rights, std::vector<at::Tensor> biases, int64_t block_rows) {
  if (few_cross_rows(x0_parts, lefts, rights, biases)) return cross_by_products(x0_parts, lefts, rights, biases);
  return tt_cross_forward(std::move(x0_parts), std::move(lefts), std::move(rights), std::move(biases), block_rows, {},
                          {}, {}, {});
}

at::Tensor tt_cross_meta(std::vector<at::Tensor> x0_parts, std::vector<at::Tensor> lefts,
                         std::vector<at::Tensor> rights, std::vector<at::Tensor> biases, int64_t block_rows) {
  TORCH_CHECK(!x0_parts.empty() && x0_parts[0].dim() == 2, "tt_cross: x0 needs at least one (B, N_p) column block");
  c10::SymInt width = 0;
  for (const auto& part : x0_parts) width = width + part.sym_size(1);
  return at::empty_symint({x0_parts[0].sym_size(0), width}, x0_parts[0].options());
}

// The cross net, then the TT layers of an MLP, relu_j?((x @ mlp_lefts[j]) @ mlp_rights[j] +
// mlp_biases[j]) (empty bias: none), in one pass: the net's (B, N) output and the layers' own
// outputs but the last are never written (a DCN's cross net, then its top MLP's TT layers).
at::Tensor tt_cross_mlp(std::vector<at::Tensor> x0_parts, std::vector<at::Tensor> lefts,
                        std::vector<at::Tensor> rights, std::vector<at::Tensor> biases, int64_t block_rows,
                        std::vector<at::Tensor> mlp_lefts, std::vector<at::Tensor> mlp_rights,
                        std::vector<at::Tensor> mlp_biases, const c10::List<bool>& relu_list) {
  TORCH_CHECK(!mlp_lefts.empty(), "tt_cross_mlp: no MLP layers (tt_cross is the net alone)");
  std::vector<bool> relus(relu_list.begin(), relu_list.end());
  if (few_cross_rows(x0_parts, lefts, rights, biases) && mlp_rights.size() == mlp_lefts.size() &&
      mlp_biases.size() == mlp_lefts.size() && relus.size() == mlp_lefts.size()) {
    auto x = cross_by_products(x0_parts, lefts, rights, biases);
    for (size_t j = 0; j < mlp_lefts.size(); ++j) {
      const auto bias = mlp_biases[j].numel() ? std::optional<at::Tensor>(mlp_biases[j]) : std::nullopt;
      x = tt_linear(x, mlp_lefts[j], mlp_rights[j], bias, relus[j]);
    }
    return x;
  }
  return tt_cross_forward(std::move(x0_parts), std::move(lefts), std::move(rights), std::move(biases), block_rows,
                          std::move(mlp_lefts), std::move(mlp_rights), std::move(mlp_biases), std::move(relus));
}

at::Tensor tt_cross_mlp_meta(std::vector<at::Tensor> x0_parts, std::vector<at::Tensor> lefts,
                             std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                             int64_t block_rows, std::vector<at::Tensor> mlp_lefts,
                             std::vector<at::Tensor> mlp_rights, std::vector<at::Tensor> mlp_biases,
                             const c10::List<bool>& relus) {
  TORCH_CHECK(!x0_parts.empty() && x0_parts[0].dim() == 2 && !mlp_rights.empty() && mlp_rights.back().dim() == 2,
              "tt_cross_mlp: x0 needs at least one (B, N_p) column block, and the MLP at least one layer");
  return at::empty_symint({x0_parts[0].sym_size(0), mlp_rights.back().sym_size(1)}, x0_parts[0].options());
}

}  // namespace

TORCH_LIBRARY(comera_rec, m) {
  m.def(
      "ttm_halves_bags(Tensor values, Tensor offsets, Tensor dense_weight, Tensor dense_base, Tensor dense_rows, "
      "Tensor[] lefts, Tensor[] rights, Tensor tables, int[] prefix_rows, int[] suffix_rows) -> Tensor");
  m.def("tt_linear(Tensor x, Tensor left, Tensor right, Tensor? bias, bool relu) -> Tensor");
  m.def("pairwise_dots(Tensor dense, Tensor sparse) -> Tensor");
  m.def("tt_cross(Tensor[] x0_parts, Tensor[] lefts, Tensor[] rights, Tensor[] biases, int block_rows) -> Tensor");
  m.def(
      "tt_cross_mlp(Tensor[] x0_parts, Tensor[] lefts, Tensor[] rights, Tensor[] biases, int block_rows, "
      "Tensor[] mlp_lefts, Tensor[] mlp_rights, Tensor[] mlp_biases, bool[] relus) -> Tensor");
}

TORCH_LIBRARY_IMPL(comera_rec, CPU, m) {
  m.impl("ttm_halves_bags", &ttm_halves_bags);
  m.impl("tt_linear", &tt_linear);
  m.impl("pairwise_dots", &pairwise_dots);
  m.impl("tt_cross", &tt_cross);
  m.impl("tt_cross_mlp", &tt_cross_mlp);
}

TORCH_LIBRARY_IMPL(comera_rec, Meta, m) {
  m.impl("ttm_halves_bags", &ttm_halves_bags_meta);
  m.impl("tt_linear", &tt_linear_meta);
  m.impl("pairwise_dots", &pairwise_dots_meta);
  m.impl("tt_cross", &tt_cross_meta);
  m.impl("tt_cross_mlp", &tt_cross_mlp_meta);
}
