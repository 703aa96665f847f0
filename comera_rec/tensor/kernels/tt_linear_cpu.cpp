// Fused CPU TT linear: y = act((x @ left) @ right + bias) and its backward.
//
// left (N_in, r) and right (r, N_out) are the merged input and output chains of a TT
// weight (contract.tt_linear); r is small (a few vectors), N_in / N_out are the layer's
// widths, x is (B, N_in). As BLAS calls this is two skinny GEMMs forward and four
// backward, plus passes of their own for the bias, the ReLU and its mask, each reading or
// writing a (B, N) activation: memory-bound work. Here a tile of 8 rows goes through
// every step while its rows are in cache:
//
//   forward:  t = x @ left (kept for backward), y = relu(t @ right + bias)
//   backward: g = dy * (y > 0); grad_bias += sum g; grad_right += t^T g;
//             dt = g @ right^T; dx = dt @ left^T; grad_left += x^T dt
//
// The batch is cut into chunks that depend on B only; each chunk sums its weight
// gradients in a partial of its own and the partials are added in chunk order, so the
// result is the same for any number of threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using namespace comera;

constexpr int64_t kTile = 8;  // rows that share every load of left / right

// Rows whose (rows x V) rank accumulators are made at once in the two products with a rank
// output (t = x @ left, dt = g @ right^T): they and the V loaded vectors must fit the vector
// registers. All 8 of a tile with AVX-512's 32; with AVX2's 16 the tile goes in groups of
// fewer rows for more rank vectors (8 rows of 4 vectors spilled, several times slower).
template <int V>
constexpr int64_t group_rows() {
  if constexpr (kVectorRegisters >= 32) return kTile;
  int64_t g = kTile;
  while (g > 1 && g * V + V + 1 > kVectorRegisters) g /= 2;
  return g;
}

// The most rank vectors a tile takes: 256 bytes of rank (r <= 64 float32), at most 8 vectors.
constexpr int kMaxVectors = std::min<int>(8, 256 / kVectorBytes);

// g[0] + ... + g[N - 1], as a balanced tree of adds.
template <int64_t N, typename T>
inline vec_t<T> tree_sum(const vec_t<T>* g) {
  if constexpr (N == 1) {
    return g[0];
  } else {
    return tree_sum<N / 2, T>(g) + tree_sum<N - N / 2, T>(g + N / 2);
  }
}

// Chunks of about 256 rows, their number set by B alone (see the header).
inline int64_t num_chunks(int64_t B) { return std::max<int64_t>(1, std::min<int64_t>(64, (B + 255) / 256)); }

template <typename T>
struct Layer {
  int64_t B = 0, n_in = 0, n_out = 0, r = 0;
  int64_t R = 0;    // r padded to whole vectors
  int64_t Np = 0;   // n_out padded to whole vectors
  int64_t Nip = 0;  // n_in padded to whole vectors
  const T* x = nullptr;      // (B, n_in)
  const T* left = nullptr;   // (n_in, R)
  const T* right = nullptr;  // (r, Np)
  const T* bias = nullptr;   // (Np) or null
  const T* zeros = nullptr;  // max(n_in, Np, R) zeros: the rows of a tile past B
};

// Store lanes [0, n) of v at p (n <= one vector).
template <typename T>
inline void store_head(T* p, vec_t<T> v, int64_t n) {
  if (n >= kLanes<T>) {
    vstore(p, v);
  } else {
    for (int64_t l = 0; l < n; ++l) p[l] = v[l];
  }
}

// The products of a tile's rank rows with a matrix of rank rows: for the columns [0, cols)
// (whole vectors), out(i, c) = init(c) + sum_{j < r} s[i * lds + j] m[j * ldm + c] for the
// tile's rows i, each (row, vector) handed to done(i, c, value). Made in blocks of 8 sums
// kept in registers: 8 rows x 1 vector with AVX-512 (one load of m and 8 broadcasts per
// j), 4 rows x 2 vectors with 16 registers (2 loads and 4 broadcasts per 8 multiply-adds,
// where 9 loads per 8 bound the loop).
constexpr int kOutVectors = kVectorRegisters >= 32 ? 1 : 2;

template <typename T, int CB, typename Init, typename Done>
inline void rank_block(const T* s, int64_t lds, const T* m, int64_t ldm, int64_t r, int64_t c, Init init, Done done) {
  constexpr int64_t W = kLanes<T>;
  constexpr int64_t kRows = kTile / CB;
  for (int64_t i0 = 0; i0 < kTile; i0 += kRows) {
    vec_t<T> a[kRows][CB];
    for (int u = 0; u < CB; ++u) {
      const vec_t<T> start = init(c + u * W);
      for (int64_t i = 0; i < kRows; ++i) a[i][u] = start;
    }
    for (int64_t j = 0; j < r; ++j) {
      vec_t<T> mj[CB];
      for (int u = 0; u < CB; ++u) mj[u] = vload(m + j * ldm + c + u * W);
      for (int64_t i = 0; i < kRows; ++i) {
        const T sij = s[(i0 + i) * lds + j];
        for (int u = 0; u < CB; ++u) a[i][u] += sij * mj[u];
      }
    }
    for (int64_t i = 0; i < kRows; ++i)
      for (int u = 0; u < CB; ++u) done(i0 + i, c + u * W, a[i][u]);
  }
}

template <typename T, typename Init, typename Done>
inline void rank_product(const T* s, int64_t lds, const T* m, int64_t ldm, int64_t r, int64_t cols, Init init,
                         Done done) {
  constexpr int64_t W = kLanes<T>;
  int64_t c = 0;
  if constexpr (kOutVectors == 2)
    for (; c + 2 * W <= cols; c += 2 * W) rank_block<T, 2>(s, lds, m, ldm, r, c, init, done);
  for (; c < cols; c += W) rank_block<T, 1>(s, lds, m, ldm, r, c, init, done);
}

template <typename T, int V>
void forward_tile(const Layer<T>& L, int64_t b0, bool relu, T* t_out, T* y) {
  constexpr int64_t W = kLanes<T>;
  constexpr int64_t kGroup = group_rows<V>();
  const int64_t rows = std::min(kTile, L.B - b0);
  const T* xr[kTile];
  for (int64_t i = 0; i < kTile; ++i) xr[i] = i < rows ? L.x + (b0 + i) * L.n_in : L.zeros;

  // t = x @ left: (kTile, R), kGroup rows at a time
  alignas(64) T t[kTile][V * W];
  for (int64_t i0 = 0; i0 < kTile; i0 += kGroup) {
    vec_t<T> acc[kGroup][V];
    for (int64_t i = 0; i < kGroup; ++i)
      for (int v = 0; v < V; ++v) acc[i][v] = vzero<T>();
    for (int64_t k = 0; k < L.n_in; ++k) {
      vec_t<T> lk[V];
      for (int v = 0; v < V; ++v) lk[v] = vload(L.left + k * L.R + v * W);
      for (int64_t i = 0; i < kGroup; ++i) {
        const T xik = xr[i0 + i][k];
        for (int v = 0; v < V; ++v) acc[i][v] += xik * lk[v];
      }
    }
    for (int64_t i = 0; i < kGroup; ++i)
      for (int v = 0; v < V; ++v) {
        vstore(&t[i0 + i][v * W], acc[i][v]);
        if (i0 + i < rows) vstore(t_out + (b0 + i0 + i) * L.R + v * W, acc[i][v]);
      }
  }

  // y = t @ right + bias, then the activation
  const vec_t<T> zero = vzero<T>();
  rank_product(
      &t[0][0], V * W, L.right, L.Np, L.r, L.Np, [&](int64_t c) { return L.bias ? vload(L.bias + c) : zero; },
      [&](int64_t i, int64_t c, vec_t<T> a) {
        if (i >= rows) return;
        if (relu) a = a > zero ? a : zero;
        store_head(y + (b0 + i) * L.n_out + c, a, L.n_out - c);
      });
}

template <typename T>
struct Grads {
  const T* gy = nullptr;       // (B, n_out)
  const T* y = nullptr;        // (B, n_out) the activation's output, or null: no ReLU
  const T* t = nullptr;        // (B, R) from forward
  const T* right_t = nullptr;  // (n_out, R): right transposed
  const T* left_t = nullptr;   // (r, Nip): left transposed
  T* gx = nullptr;             // (B, n_in) or null
  bool left = true;            // grad_left wanted (else dt is needed only for gx)
};

// One tile's share of every gradient: rows b0 .. min(b0 + kTile, end); gL (n_in, R),
// gR (r, Np), gB (Np) are its chunk's partials, G a (kTile, Np) scratch.
template <typename T, int V>
void backward_tile(const Layer<T>& L, const Grads<T>& d, int64_t b0, int64_t end, T* gL, T* gR, T* gB, T* G) {
  constexpr int64_t W = kLanes<T>;
  constexpr int64_t kGroup = group_rows<V>();
  const int64_t rows = std::min(kTile, end - b0);

  // g = dy, masked by the ReLU, zero past the row's end and past B
  const vec_t<T> zero = vzero<T>();
  for (int64_t i = 0; i < kTile; ++i) {
    T* gi = G + i * L.Np;
    if (i >= rows) {
      std::fill(gi, gi + L.Np, T(0));
      continue;
    }
    const T* dy = d.gy + (b0 + i) * L.n_out;
    const T* yi = d.y ? d.y + (b0 + i) * L.n_out : nullptr;
    int64_t c = 0;
    for (; c + W <= L.n_out; c += W) {  // whole vectors
      const vec_t<T> g = vload(dy + c);
      vstore(gi + c, yi ? (vload(yi + c) > zero ? g : zero) : g);
    }
    for (; c < L.n_out; ++c) gi[c] = !yi || yi[c] > T(0) ? dy[c] : T(0);
    std::fill(gi + L.n_out, gi + L.Np, T(0));
  }
  const T* tr[kTile];
  for (int64_t i = 0; i < kTile; ++i) tr[i] = i < rows ? d.t + (b0 + i) * L.R : L.zeros;

  // grad_bias += sum_i g_i; grad_right[j] += sum_i t_ij g_i
  for (int64_t c = 0; c < L.Np; c += W) {
    vec_t<T> g[kTile];
    for (int64_t i = 0; i < kTile; ++i) g[i] = vload(G + i * L.Np + c);
    if (gB) vstore(gB + c, vload(gB + c) + tree_sum<kTile, T>(g));
    // four rows of grad_right at a time: four independent chains of multiply-adds
    int64_t j = 0;
    for (; j + 4 <= L.r; j += 4) {
      T* p = gR + j * L.Np + c;
      vec_t<T> a0 = vload(p), a1 = vload(p + L.Np), a2 = vload(p + 2 * L.Np), a3 = vload(p + 3 * L.Np);
      for (int64_t i = 0; i < kTile; ++i) {
        a0 += tr[i][j] * g[i];
        a1 += tr[i][j + 1] * g[i];
        a2 += tr[i][j + 2] * g[i];
        a3 += tr[i][j + 3] * g[i];
      }
      vstore(p, a0);
      vstore(p + L.Np, a1);
      vstore(p + 2 * L.Np, a2);
      vstore(p + 3 * L.Np, a3);
    }
    for (; j < L.r; ++j) {
      T* p = gR + j * L.Np + c;
      vec_t<T> a = vload(p);
      for (int64_t i = 0; i < kTile; ++i) a += tr[i][j] * g[i];
      vstore(p, a);
    }
  }

  if (!d.gx && !d.left) return;  // a constant left (NarrowLinear's identity): no dt

  // dt = g @ right^T: (kTile, R), kGroup rows at a time (the loop of t = x @ left in
  // forward_tile over other operands: one helper for both made that forward 20% slower at
  // rank 16 with AVX2, alternating builds)
  alignas(64) T dts[kTile][V * W];
  vec_t<T> dt[kGroup][V];  // the last group's, kept in registers when they are the whole tile
  for (int64_t i0 = 0; i0 < kTile; i0 += kGroup) {
    for (int64_t i = 0; i < kGroup; ++i)
      for (int v = 0; v < V; ++v) dt[i][v] = vzero<T>();
    for (int64_t c = 0; c < L.n_out; ++c) {
      vec_t<T> rc[V];
      for (int v = 0; v < V; ++v) rc[v] = vload(d.right_t + c * L.R + v * W);
      for (int64_t i = 0; i < kGroup; ++i) {
        const T gic = G[(i0 + i) * L.Np + c];
        for (int v = 0; v < V; ++v) dt[i][v] += gic * rc[v];
      }
    }
    for (int64_t i = 0; i < kGroup; ++i)
      for (int v = 0; v < V; ++v) vstore(&dts[i0 + i][v * W], dt[i][v]);
  }

  // dx = dt @ left^T
  if (d.gx)
    rank_product(
        &dts[0][0], V * W, d.left_t, L.Nip, L.r, L.Nip, [](int64_t) { return vzero<T>(); },
        [&](int64_t i, int64_t k, vec_t<T> a) {
          if (i < rows) store_head(d.gx + (b0 + i) * L.n_in + k, a, L.n_in - k);
        });

  if (!d.left) return;
  // grad_left[k] += sum_i x_ik dt_i
  const T* xr[kTile];
  for (int64_t i = 0; i < kTile; ++i) xr[i] = i < rows ? L.x + (b0 + i) * L.n_in : L.zeros;
  // K rows of grad_left at a time: 8 independent chains of multiply-adds (at least 2 rows
  // with AVX-512's registers). dt comes from registers when the whole tile's is there, else
  // from dts (L1).
  constexpr int64_t K = kVectorRegisters >= 32 && V >= 4 ? 2 : std::max(1, 8 / V);
  auto dt_of = [&](int64_t i, int v) {
    if constexpr (kGroup == kTile) return dt[i][v];
    return vload(&dts[i][v * W]);
  };
  int64_t k = 0;
  for (; k + K <= L.n_in; k += K) {
    vec_t<T> a[K][V];
    for (int64_t u = 0; u < K; ++u)
      for (int v = 0; v < V; ++v) a[u][v] = vload(gL + (k + u) * L.R + v * W);
    for (int64_t i = 0; i < kTile; ++i)
      for (int64_t u = 0; u < K; ++u) {
        const T x = xr[i][k + u];
        for (int v = 0; v < V; ++v) a[u][v] += x * dt_of(i, v);
      }
    for (int64_t u = 0; u < K; ++u)
      for (int v = 0; v < V; ++v) vstore(gL + (k + u) * L.R + v * W, a[u][v]);
  }
  for (; k < L.n_in; ++k)
    for (int v = 0; v < V; ++v) {
      T* p = gL + k * L.R + v * W;
      vec_t<T> a = vload(p);
      for (int64_t i = 0; i < kTile; ++i) a += xr[i][k] * dt_of(i, v);
      vstore(p, a);
    }
}

template <typename T>
Layer<T> layer_of(const torch::Tensor& x, const torch::Tensor& left_p, const torch::Tensor& right_p,
                  const torch::Tensor& bias_p, int64_t r, int64_t n_out, const torch::Tensor& zeros) {
  Layer<T> L;
  L.B = x.size(0);
  L.n_in = x.size(1);
  L.n_out = n_out;
  L.r = r;
  L.R = left_p.size(1);
  L.Np = right_p.size(1);
  L.Nip = padded(L.n_in, kLanes<T>);
  L.x = x.data_ptr<T>();
  L.left = left_p.data_ptr<T>();
  L.right = right_p.data_ptr<T>();
  L.bias = bias_p.numel() ? bias_p.data_ptr<T>() : nullptr;
  L.zeros = zeros.data_ptr<T>();
  return L;
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& left, const torch::Tensor& right,
                  const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && left.dim() == 2 && right.dim() == 2, "tt_linear: x, left and right must be matrices");
  TORCH_CHECK(left.size(0) == x.size(1), "tt_linear: left has ", left.size(0), " rows for ", x.size(1), " input features");
  TORCH_CHECK(right.size(0) == left.size(1), "tt_linear: left has rank ", left.size(1), ", right ", right.size(0));
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == right.size(1), "tt_linear: bias of ", bias.numel(),
              " values for ", right.size(1), " outputs");
  TORCH_CHECK(x.scalar_type() == left.scalar_type() && x.scalar_type() == right.scalar_type(),
              "tt_linear: x, left and right need one dtype");
}

// Dispatch on the number of rank vectors V = R / W (1..kMaxVectors).
template <typename T, template <typename, int> class Fn, int Max = kMaxVectors, typename... Args>
void with_vectors(int64_t V, Args&&... args) {
  if constexpr (Max > 1) {
    if (V < Max) return with_vectors<T, Fn, Max - 1>(V, std::forward<Args>(args)...);
  }
  TORCH_CHECK(V == Max, "tt_linear: rank padded to ", V, " vectors; at most ", kMaxVectors, " are supported");
  Fn<T, Max>::run(std::forward<Args>(args)...);
}

template <typename T, int V>
struct ForwardRows {
  static void run(const Layer<T>& L, bool relu, T* t, T* y) {
    const int64_t tiles = (L.B + kTile - 1) / kTile;
    at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t tile = lo; tile < hi; ++tile) forward_tile<T, V>(L, tile * kTile, relu, t, y);
    });
  }
};

template <typename T, int V>
struct BackwardRows {
  static void run(const Layer<T>& L, const Grads<T>& d, int64_t chunks, int64_t chunk_rows, T* gL, T* gR, T* gB) {
    const int64_t sL = d.left ? L.n_in * L.R : 0, sR = L.r * L.Np, sB = L.Np;  // a chunk's partials (see below)
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> G(kTile * L.Np);
      for (int64_t c = lo; c < hi; ++c) {
        // the chunk's partials, zeroed by the thread that sums into them
        std::fill(gL + c * sL, gL + (c + 1) * sL, T(0));
        std::fill(gR + c * sR, gR + (c + 1) * sR, T(0));
        if (gB) std::fill(gB + c * sB, gB + (c + 1) * sB, T(0));
        const int64_t end = std::min(L.B, (c + 1) * chunk_rows);
        for (int64_t b0 = c * chunk_rows; b0 < end; b0 += kTile)
          backward_tile<T, V>(L, d, b0, end, gL + c * sL, gR + c * sR, gB ? gB + c * sB : nullptr, G.data());
      }
    });
  }
};

// out[e] = sum over chunks of parts[chunk][e], in chunk order.
template <typename T>
void sum_chunks(const T* parts, int64_t chunks, int64_t size, T* out) {
  at::parallel_for(0, size, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t e = lo; e < hi; ++e) {
      T s = parts[e];
      for (int64_t c = 1; c < chunks; ++c) s += parts[c * size + e];
      out[e] = s;
    }
  });
}

}  // namespace

// (y (B, n_out), t (B, R)): t is the padded x @ left, kept for the backward.
std::vector<torch::Tensor> tt_linear_forward(torch::Tensor x, torch::Tensor left, torch::Tensor right,
                                             torch::Tensor bias, bool relu) {
  check_inputs(x, left, right, bias);
  x = x.contiguous();
  const int64_t B = x.size(0), n_in = x.size(1), r = left.size(1), n_out = right.size(1);
  auto y = torch::empty({B, n_out}, x.options());
  torch::Tensor t;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_linear_forward", [&] {
    constexpr int64_t W = kLanes<scalar_t>;
    const auto left_p = pad_last(left, W);                   // (n_in, R)
    const auto right_p = pad_last(right, W);                 // (r, Np)
    const auto bias_p = bias.numel() ? pad_last(bias.to(x.scalar_type()), W) : bias;
    const int64_t R = left_p.size(1);
    const auto zeros = torch::zeros({std::max({n_in, right_p.size(1), R})}, x.options());
    t = torch::empty({B, R}, x.options());
    const auto L = layer_of<scalar_t>(x, left_p, right_p, bias_p, r, n_out, zeros);
    with_vectors<scalar_t, ForwardRows>(R / W, L, relu, t.data_ptr<scalar_t>(), y.data_ptr<scalar_t>());
  });
  return {y, t};
}

// (grad_x or empty, grad_left (n_in, r) or empty, grad_right (r, n_out), grad_bias or empty).
// y: the forward's output when it applied the ReLU, else empty.
std::vector<torch::Tensor> tt_linear_backward(torch::Tensor grad_y, torch::Tensor x, torch::Tensor left,
                                              torch::Tensor right, torch::Tensor t, torch::Tensor y,
                                              bool need_grad_x, bool need_grad_bias, bool need_grad_left) {
  x = x.contiguous();
  grad_y = grad_y.contiguous();
  y = y.contiguous();
  const int64_t B = x.size(0), n_in = x.size(1), r = left.size(1), n_out = right.size(1);
  TORCH_CHECK(grad_y.size(0) == B && grad_y.size(1) == n_out, "tt_linear: grad of shape ", grad_y.sizes(),
              " for an output of (", B, ", ", n_out, ")");
  torch::Tensor grad_x = need_grad_x ? torch::empty({B, n_in}, x.options()) : torch::Tensor();
  torch::Tensor grad_left, grad_right, grad_bias;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_linear_backward", [&] {
    using T = scalar_t;
    constexpr int64_t W = kLanes<T>;
    const auto left_p = pad_last(left, W);
    const auto right_p = pad_last(right, W);
    const int64_t R = left_p.size(1), Np = right_p.size(1);
    const auto right_t = pad_last(right.t(), W);  // (n_out, R)
    const auto left_t = pad_last(left.t(), W);    // (r, Nip)
    const auto zeros = torch::zeros({std::max({n_in, Np, R})}, x.options());
    const auto none = torch::empty({0}, x.options());
    const auto L = layer_of<T>(x, left_p, right_p, none, r, n_out, zeros);
    Grads<T> d;
    d.gy = grad_y.data_ptr<T>();
    d.y = y.numel() ? y.data_ptr<T>() : nullptr;
    d.t = t.data_ptr<T>();
    d.right_t = right_t.data_ptr<T>();
    d.left_t = left_t.data_ptr<T>();
    d.gx = need_grad_x ? grad_x.data_ptr<T>() : nullptr;
    d.left = need_grad_left;

    const int64_t chunks = num_chunks(B);
    const int64_t chunk_rows = padded((B + chunks - 1) / chunks, kTile);  // whole tiles
    const int64_t used = (B + chunk_rows - 1) / chunk_rows;
    const int64_t sL = need_grad_left ? n_in * R : 0, sR = r * Np, sB = Np;  // as BackwardRows lays them out
    auto parts = torch::empty({used * (sL + sR + (need_grad_bias ? sB : 0))}, x.options());  // zeroed per chunk
    T* gL = parts.data_ptr<T>();
    T* gR = gL + used * sL;
    T* gB = need_grad_bias ? gR + used * sR : nullptr;
    with_vectors<T, BackwardRows>(R / W, L, d, used, chunk_rows, gL, gR, gB);

    if (need_grad_left) {
      auto gl = torch::empty({n_in, R}, x.options());
      sum_chunks(gL, used, sL, gl.data_ptr<T>());
      grad_left = gl.narrow(1, 0, r);
    }
    auto gr = torch::empty({r, Np}, x.options());
    sum_chunks(gR, used, sR, gr.data_ptr<T>());
    grad_right = gr.narrow(1, 0, n_out);
    if (need_grad_bias) {
      auto gb = torch::empty({Np}, x.options());
      sum_chunks(gB, used, sB, gb.data_ptr<T>());
      grad_bias = gb.narrow(0, 0, n_out);
    }
  });
  return {grad_x.defined() ? grad_x : torch::Tensor(), grad_left.defined() ? grad_left : torch::Tensor(), grad_right,
          grad_bias.defined() ? grad_bias : torch::Tensor()};
}
