// Fused CPU TT linear: y = act((x @ left) @ right + bias) and its backward.
//
// left (N_in, r) and right (r, N_out) are the merged input and output chains of a TT
// weight (contract.tt_linear); r is small (a few vectors), N_in / N_out are the layer's
// widths, x is (B, N_in). As BLAS calls this is two skinny GEMMs forward and four
// backward, plus passes of their own for the bias, the ReLU and its mask, each reading or
// writing a (B, N) activation: memory-bound work. Here a tile of rows (8 with AVX-512, 12
// with AVX2) goes through the forward, and a block of 8 tiles through the backward, every
// step while the rows are in cache:
//
//   forward:  t = x @ left (kept for backward), y = relu(t @ right + bias)
//   backward: g = dy * (y > 0); grad_bias += sum g; grad_right += t^T g;
//             dt = g @ right^T; dx = dt @ left^T; grad_left += x^T dt
//
// The batch is cut into chunks that depend on B only; each chunk sums its weight
// gradients in a partial of its own and the partials are added in chunk order, so the
// result is the same for any number of threads.

#include "aten_ops.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using namespace comera;

// Rows that share every load of left / right: 8 with AVX-512's 32 registers; 12 with 16,
// so that the products with a rank input run 6 rows x 2 vectors (rank_product).
constexpr int64_t kTile = kVectorRegisters >= 32 ? 8 : 12;

// The most rank vectors a tile takes: 256 bytes of rank (r <= 64 float32), at most 8 vectors.
constexpr int kMaxVectors = std::min<int>(8, 256 / kVectorBytes);

// Chunks of about 256 rows, their number set by B alone (see the header).
inline int64_t num_chunks(int64_t B) { return std::max<int64_t>(1, std::min<int64_t>(64, (B + 255) / 256)); }

template <typename T>
struct Layer {
  int64_t B = 0, n_in = 0, n_out = 0, r = 0;
  int64_t R = 0;    // r padded to whole vectors
  int64_t Np = 0;   // n_out padded to whole vectors
  int64_t Nip = 0;  // n_in padded to whole vectors
  const T* x = nullptr;      // (B, n_in)
  const T* left = nullptr;   // (n_in, R) (in panels with 16 registers)
  const T* right = nullptr;  // (r, Np) in panels (pack_panels)
  const T* bias = nullptr;   // (Np) or null
  const T* zeros = nullptr;  // max(n_in, Np, R) zeros: the rows of a tile past B
  const T* x0 = nullptr;     // (B, n_out) a cross layer's first input (tt_cross_forward), else null
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

// Lanes [0, n) of p, the rest zero (n <= one vector).
template <typename T>
inline vec_t<T> load_head(const T* p, int64_t n) {
  if (n >= kLanes<T>) return vload(p);
  vec_t<T> v = vzero<T>();
  for (int64_t l = 0; l < n; ++l) v[l] = p[l];
  return v;
}

// The products of a tile's rank rows with a matrix of rank rows, m (r, cols) held as
// panels (pack_panels): for the columns [0, cols) (whole vectors), out(i, c) = init(c) +
// sum_{j < r} s[i * lds + j] m[j, c] for the tile's rows i, each (row, vector) handed to
// done(i, c, value). Made in blocks of sums kept in registers: 8 rows x 1 vector with
// AVX-512 (one load of m and 8 broadcasts per j), 6 rows x 2 vectors with 16 registers (2
// loads and 6 broadcasts per 12 multiply-adds). 4 rows x 2 vectors ran at half the speed
// on an AVX2 EPYC: 8 sums are just the multiply-adds in flight that two FMA units of
// latency 4 need, and any stall left them idle.
constexpr int kOutVectors = kVectorRegisters >= 32 ? 1 : 2;

// m (r, cols) in panels of kOutVectors vectors of columns (one vector for the last when
// cols is odd in vectors), each panel's r rows contiguous: the column block at c starts at
// c * r. Read row by row, m's rows are cols apart: one cache line each, as far apart as
// a page with a wide layer, which the prefetcher did not follow (the loads from L2 bound the
// product).
template <typename T>
at::Tensor pack_panels(const at::Tensor& m) {
  constexpr int64_t W = kLanes<T>;
  const int64_t r = m.size(0), cols = m.size(1);
  auto out = at::empty({r * cols}, m.options());
  const T* src = m.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for (int64_t c = 0; c < cols;) {
    const int64_t width = c + kOutVectors * W <= cols ? kOutVectors * W : W;
    for (int64_t j = 0; j < r; ++j) std::copy(src + j * cols + c, src + j * cols + c + width, dst + c * r + j * width);
    c += width;
  }
  return out;
}

// s's rows are LDS apart (the padded rank: known at compile time, so each row's value is
// read at a constant offset, not through a stride register); the loaded vectors of m held
// (vload_held), else GCC folded the second into each of its 6 multiply-adds (13
// loads per 12 of them, and the stride reloaded from the stack, perf annotate; a 367 -> 512
// layer's forward + backward 1.04-1.13x faster so on an AVX2 EPYC).
template <typename T, int CB, int64_t LDS, typename Init, typename Done>
inline void rank_block(const T* s, const T* panel, int64_t r, int64_t c, Init init, Done done) {
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
      for (int u = 0; u < CB; ++u) mj[u] = vload_held(panel + (j * CB + u) * W);
      for (int64_t i = 0; i < kRows; ++i) {
        const T sij = s[(i0 + i) * LDS + j];
        for (int u = 0; u < CB; ++u) a[i][u] += sij * mj[u];
      }
    }
    for (int64_t i = 0; i < kRows; ++i)
      for (int u = 0; u < CB; ++u) done(i0 + i, c + u * W, a[i][u]);
  }
}

template <typename T, int64_t LDS, typename Init, typename Done>
inline void rank_product(const T* s, const T* panels, int64_t r, int64_t cols, Init init, Done done) {
  constexpr int64_t W = kLanes<T>;
  int64_t c = 0;
  if constexpr (kOutVectors == 2)
    for (; c + 2 * W <= cols; c += 2 * W) rank_block<T, 2, LDS>(s, panels + c * r, r, c, init, done);
  for (; c < cols; c += W) rank_block<T, 1, LDS>(s, panels + c * r, r, c, init, done);
}

// The products with a rank output on 16-register machines (t = x @ left, dt = g @ right^T):
// out[i * R + c] = sum_{k < K} rows[i][k] m[k, c] for a tile's rows, m (K, R) held as panels
// (pack_panels), in blocks of 6 rows x 2 vectors (12 rows x 1 for an odd last vector): 2
// loads and 6 broadcasts per 12 multiply-adds. Rows x every rank vector at once, as with
// AVX-512, leaves 2 rows x 4 vectors at rank 32 here: 8 sums, and the tile reads m 6 times
// (1.2x slower on an AVX2 EPYC, x @ left at 512 x 32 alone).
template <typename T, int PV>
inline void panel_block(const T* const* rows, int64_t K, const T* panel, T* out, int64_t R, int64_t c) {
  constexpr int64_t W = kLanes<T>;
  constexpr int64_t kRows = kTile / PV;
  for (int64_t i0 = 0; i0 < kTile; i0 += kRows) {
    vec_t<T> a[kRows][PV];
    for (int64_t i = 0; i < kRows; ++i)
      for (int u = 0; u < PV; ++u) a[i][u] = vzero<T>();
    for (int64_t k = 0; k < K; ++k) {
      vec_t<T> m[PV];
      for (int u = 0; u < PV; ++u) m[u] = vload_held(panel + (k * PV + u) * W);  // (16 registers only)
      for (int64_t i = 0; i < kRows; ++i) {
        const T s = rows[i0 + i][k];
        for (int u = 0; u < PV; ++u) a[i][u] += s * m[u];
      }
    }
    for (int64_t i = 0; i < kRows; ++i)
      for (int u = 0; u < PV; ++u) vstore(out + (i0 + i) * R + c + u * W, a[i][u]);
  }
}

template <typename T>
inline void panel_product(const T* const* rows, int64_t K, const T* panels, int64_t R, T* out) {
  constexpr int64_t W = kLanes<T>;
  int64_t c = 0;
  for (; c + 2 * W <= R; c += 2 * W) panel_block<T, 2>(rows, K, panels + c * K, out, R, c);
  for (; c < R; c += W) panel_block<T, 1>(rows, K, panels + c * K, out, R, c);
}

// The same product with 32 registers: the tile's rows x all V rank vectors at once, m (K, R)
// row-major (one load of m per vector, shared by the 8 rows).
template <typename T, int V>
inline void rank_output_rows(const T* const* rows, int64_t K, const T* m, T* out) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> a[kTile][V];
  for (int64_t i = 0; i < kTile; ++i)
    for (int v = 0; v < V; ++v) a[i][v] = vzero<T>();
  for (int64_t k = 0; k < K; ++k) {
    vec_t<T> mk[V];
    for (int v = 0; v < V; ++v) mk[v] = vload(m + (k * V + v) * W);
    for (int64_t i = 0; i < kTile; ++i) {
      const T s = rows[i][k];
      for (int v = 0; v < V; ++v) a[i][v] += s * mk[v];
    }
  }
  for (int64_t i = 0; i < kTile; ++i)
    for (int v = 0; v < V; ++v) vstore(out + (i * V + v) * W, a[i][v]);
}

// The second half of a tile's forward, y = act(t @ right + bias) for its rows b0 .. b0 + rows
// (or the cross layer's residual, xr the tile's rows of x), from t (kTile, R): the forward's
// own tile, or a tile of the t the forward kept (tt_chain_backward recomputes the hidden
// outputs so, the same operations in the same order: the same values).
template <typename T, int V, bool Cross = false>
inline void tile_outputs(const Layer<T>& L, const T* t, int64_t b0, int64_t rows, const T* const* xr, bool relu,
                         T* y) {
  const vec_t<T> zero = vzero<T>();
  rank_product<T, V * kLanes<T>>(
      t, L.right, L.r, L.Np, [&](int64_t c) { return L.bias ? vload(L.bias + c) : zero; },
      [&](int64_t i, int64_t c, vec_t<T> a) {
        if (i >= rows) return;
        const int64_t at = (b0 + i) * L.n_out + c, n = L.n_out - c;
        if constexpr (Cross) {
          a = load_head(xr[i] + c, n) + load_head(L.x0 + at, n) * a;
        } else if (relu) {
          a = a > zero ? a : zero;
        }
        store_head(y + at, a, n);
      });
}

// Cross: y = x + x0 * (t @ right + bias) (a cross layer, n_in == n_out), with no ReLU; y may
// be x itself, the tile's rows of x being read (t, then each vector's residual) before that
// vector is written. t_out null: t is not kept.
template <typename T, int V, bool Cross = false>
void forward_tile(const Layer<T>& L, int64_t b0, bool relu, T* t_out, T* y) {
  constexpr int64_t W = kLanes<T>;
  const int64_t rows = std::min(kTile, L.B - b0);
  const T* xr[kTile];
  for (int64_t i = 0; i < kTile; ++i) xr[i] = i < rows ? L.x + (b0 + i) * L.n_in : L.zeros;

  // t = x @ left: (kTile, R)
  alignas(64) T t[kTile][V * W];
  if constexpr (kVectorRegisters < 32) {
    panel_product(xr, L.n_in, L.left, V * W, &t[0][0]);  // left in panels
  } else {
    rank_output_rows<T, V>(xr, L.n_in, L.left, &t[0][0]);
  }
  if (t_out)
    for (int64_t i = 0; i < rows; ++i) std::copy(t[i], t[i] + V * W, t_out + (b0 + i) * L.R);
  tile_outputs<T, V, Cross>(L, &t[0][0], b0, rows, xr, relu, y);
}


template <typename T>
struct Grads {
  const T* gy = nullptr;       // (B, n_out)
  const T* y = nullptr;        // (B, n_out) the activation's output, or null: no ReLU
  const T* t = nullptr;        // (B, R) from forward
  const T* right_t = nullptr;  // (n_out, R): right transposed (in panels with 16 registers)
  const T* left_t = nullptr;   // (r, Nip): left transposed, in panels
  T* gx = nullptr;             // (B, n_in) or null
  bool left = true;            // grad_left wanted (else dt is needed only for gx)
};

// The backward goes over blocks of kBlockRows rows (within a chunk, see the header). Each
// block's weight-gradient sums run over all its rows in registers, so a chunk's partials
// (grad_left is n_in x R: 64 KB at 512 x 32) are read and written once per block, not per
// few rows: with 8-row updates, that traffic to L2 bound the loops.
constexpr int64_t kBlockRows = kTile * (64 / 8);  // whole tiles: 64 rows with AVX-512, 96 with AVX2
// Accumulators of a weight-gradient register tile: most of the registers, the rest for
// the loaded operands.
constexpr int kGradAccumulators = kVectorRegisters >= 32 ? 24 : 12;

// grad_right[j, c] += sum_{i < rows} t[i, j] G[i, c] for J rank rows j0.. and CV vectors
// of columns c0..: J x CV sums in registers over the block's rows.
template <typename T, int J, int CV>
inline void grad_right_tile(const T* t, int64_t ldt, const T* G, int64_t ldg, int64_t rows, T* gR, int64_t ldr,
                            int64_t j0, int64_t c0) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> a[J][CV];
  for (int j = 0; j < J; ++j)
    for (int u = 0; u < CV; ++u) a[j][u] = vload(gR + (j0 + j) * ldr + c0 + u * W);
  for (int64_t i = 0; i < rows; ++i) {
    vec_t<T> g[CV];
    // held: in the tiles of fewer rows GCC folded the second vector into its multiply-adds
    for (int u = 0; u < CV; ++u) g[u] = vload_held(G + i * ldg + c0 + u * W);
    const T* ti = t + i * ldt + j0;
    for (int j = 0; j < J; ++j) {
      const T s = ti[j];
      for (int u = 0; u < CV; ++u) a[j][u] += s * g[u];
    }
  }
  for (int j = 0; j < J; ++j)
    for (int u = 0; u < CV; ++u) vstore(gR + (j0 + j) * ldr + c0 + u * W, a[j][u]);
}

// fn(std::integral_constant<int, n>) for a runtime 1 <= n <= Max: a tile height chosen at
// run time, made by a tile of that height known at compile time.
template <int Max, typename F>
inline void with_height(int64_t n, F&& fn) {
  if constexpr (Max > 1) {
    if (n < Max) return with_height<Max - 1>(n, std::forward<F>(fn));
  }
  fn(std::integral_constant<int, Max>{});
}

// Sums a register tile keeps in flight: two multiply-add units of latency 4 stall with fewer.
constexpr int kMinSums = 8;

// fn(begin, height) over [0, n) in tiles of Max rows of Vectors sums each, the rest in a last
// tile; a last tile of fewer than kMinSums sums takes the full tile before it, and the two
// are made as two of near-equal height. The rest in tiles of 2 rows, then 1, left 4 or 2
// sums in chains as long as the block: at rank 32 with AVX-512, grad_right's last 8 rank
// rows (a quarter) took 13% of backward_block's samples (perf), and 367 inputs left 7 rows of
// grad_left to 1-row tiles.
template <int Max, int Vectors, typename F>
inline void row_tiles(int64_t n, F&& fn) {
  int64_t full = n / Max, rest = n % Max, begin = 0;
  if (rest > 0 && rest * Vectors < kMinSums && full > 0) {
    --full;
    rest += Max;
  }
  auto tile = [&](int64_t height) {
    with_height<Max>(height, [&](auto h) { fn(begin, h); });
    begin += height;
  };
  for (int64_t q = 0; q < full; ++q) tile(Max);
  if (rest > Max) {
    const int64_t first = (rest + 1) / 2;
    tile(first);
    rest -= first;
  }
  if (rest > 0) tile(rest);
}

template <typename T, int CV>
inline void grad_right_columns(const T* t, int64_t ldt, const T* G, int64_t ldg, int64_t rows, T* gR, int64_t ldr,
                               int64_t r, int64_t c0) {
  row_tiles<kGradAccumulators / 2, CV>(r, [&](int64_t j, auto J) {
    grad_right_tile<T, decltype(J)::value, CV>(t, ldt, G, ldg, rows, gR, ldr, j, c0);
  });
}

// With 16 registers grad_left_tile is always inlined: called through the passes of
// backward_block, GCC made each height a function of its own, with ldd no longer a
// constant (the rank-16 backward 1-3% slower). With AVX-512, inlining every height was
// 1-3% slower than GCC's own choice.
#if COMERA_VECTOR_REGISTERS < 32
#define COMERA_GRAD_LEFT_INLINE __attribute__((always_inline))
#else
#define COMERA_GRAD_LEFT_INLINE
#endif

// grad_left[k, :] += sum_{i < rows} x[i, k] dt[i, :] for K input rows k0.. and V vectors of
// dt (rows ldd apart) and of grad_left: K x V sums in registers over the block's rows.
template <typename T, int V, int K>
inline COMERA_GRAD_LEFT_INLINE void grad_left_tile(const T* const* xr, int64_t k0, const T* dts, int64_t ldd,
                                                   int64_t rows, T* gL, int64_t ldl) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> a[K][V];
  for (int u = 0; u < K; ++u)
    for (int v = 0; v < V; ++v) a[u][v] = vload(gL + (k0 + u) * ldl + v * W);
  for (int64_t i = 0; i < rows; ++i) {
    const T* di = dts + i * ldd;
    // the next tiles' x: each row's next cache line, ahead of the loads that reach it
    __builtin_prefetch(xr[i] + k0 + 64 / sizeof(T));
    vec_t<T> dv[V];
    for (int v = 0; v < V; ++v) {
      vec_t<T> loaded = vload(di + v * W);
      // held with 16 registers where they fit, else GCC folds a load of dt into every
      // multiply-add (AVX-512's tiles left as they were measured)
      if constexpr (kVectorRegisters < 32 && K * V + V + 1 <= kVectorRegisters) hold_in_register(loaded);
      dv[v] = loaded;
    }
    for (int u = 0; u < K; ++u) {
      const T x = xr[i][k0 + u];
      for (int v = 0; v < V; ++v) a[u][v] += x * dv[v];
    }
  }
  for (int u = 0; u < K; ++u)
    for (int v = 0; v < V; ++v) vstore(gL + (k0 + u) * ldl + v * W, a[u][v]);
}

// One block's share of every gradient: rows b0 .. min(b0 + kBlockRows, end); gL (n_in, R),
// gR (r, Np), gB (Np) are its chunk's partials; G (kBlockRows, Np) and dts (kBlockRows, R)
// scratch.
template <typename T, int V>
void backward_block(const Layer<T>& L, const Grads<T>& d, int64_t b0, int64_t end, T* gL, T* gR, T* gB, T* G,
                    T* dts) {
  constexpr int64_t W = kLanes<T>;
  constexpr int64_t R = V * W;
  const int64_t rows = std::min(kBlockRows, end - b0);
  const int64_t tiles_rows = padded(rows, kTile);  // the rank products go by whole tiles

  // g = dy, masked by the ReLU, zero past the block's rows
  const vec_t<T> zero = vzero<T>();
  for (int64_t i = 0; i < tiles_rows; ++i) {
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

  // grad_bias += sum_i g_i, four column vectors at a time (four independent chains)
  if (gB) {
    int64_t c = 0;
    for (; c + 4 * W <= L.Np; c += 4 * W) {
      vec_t<T> a[4];
      for (int u = 0; u < 4; ++u) a[u] = vload(gB + c + u * W);
      for (int64_t i = 0; i < rows; ++i)
        for (int u = 0; u < 4; ++u) a[u] += vload(G + i * L.Np + c + u * W);
      for (int u = 0; u < 4; ++u) vstore(gB + c + u * W, a[u]);
    }
    for (; c < L.Np; c += W) {
      vec_t<T> a = vload(gB + c);
      for (int64_t i = 0; i < rows; ++i) a += vload(G + i * L.Np + c);
      vstore(gB + c, a);
    }
  }

  // grad_right += t^T g
  const T* t = d.t + b0 * L.R;
  {
    int64_t c = 0;
    for (; c + 2 * W <= L.Np; c += 2 * W) grad_right_columns<T, 2>(t, L.R, G, L.Np, rows, gR, L.Np, L.r, c);
    for (; c < L.Np; c += W) grad_right_columns<T, 1>(t, L.R, G, L.Np, rows, gR, L.Np, L.r, c);
  }

  if (!d.gx && !d.left) return;  // a constant left (NarrowLinear's identity): no dt

  // dt = g @ right^T: (rows, R), a tile of rows at a time
  for (int64_t s = 0; s < tiles_rows; s += kTile) {
    const T* gr[kTile];
    for (int64_t i = 0; i < kTile; ++i) gr[i] = G + (s + i) * L.Np;
    if constexpr (kVectorRegisters < 32) {
      panel_product(gr, L.n_out, d.right_t, R, dts + s * R);  // right^T in panels
    } else {
      rank_output_rows<T, V>(gr, L.n_out, d.right_t, dts + s * R);
    }
  }

  // dx = dt @ left^T, a tile of rows at a time
  if (d.gx)
    for (int64_t s = 0; s < rows; s += kTile)
      rank_product<T, R>(
          dts + s * R, d.left_t, L.r, L.Nip, [](int64_t) { return vzero<T>(); },
          [&](int64_t i, int64_t k, vec_t<T> a) {
            if (s + i < rows) store_head(d.gx + (b0 + s + i) * L.n_in + k, a, L.n_in - k);
          });

  if (!d.left) return;
  // grad_left += x^T dt
  const T* xr[kBlockRows];
  for (int64_t i = 0; i < rows; ++i) xr[i] = L.x + (b0 + i) * L.n_in;
  // In passes of VP rank vectors, each in tiles of K input rows. With AVX-512 one pass of all
  // V. With 16 registers, 4 and more vectors go two at a time, in tiles of as many rows as
  // leave room for them: 6 rows x 2 vectors, 12 sums, where all 4 vectors of rank 32 at once
  // left 2 rows x 4, 8 sums: just the multiply-adds in flight that two FMA units of latency
  // 4 need.
  constexpr int VP = kVectorRegisters < 32 && V >= 4 ? 2 : V;
  auto pass = [&](int64_t v0, auto vectors) {
    constexpr int P = decltype(vectors)::value;
    constexpr int K = kVectorRegisters >= 32
                          ? std::max(1, kGradAccumulators / P)
                          : std::max(1, std::min(kGradAccumulators / P, (kVectorRegisters - 1 - P) / P));
    row_tiles<K, P>(L.n_in, [&](int64_t k, auto height) {
      grad_left_tile<T, P, decltype(height)::value>(xr, k, dts + v0 * W, R, rows, gL + v0 * W, L.R);
    });
  };
  int64_t v0 = 0;
  for (; v0 + VP <= V; v0 += VP) pass(v0, std::integral_constant<int, VP>{});
  if (v0 < V) pass(v0, std::integral_constant<int, 1>{});
}

template <typename T>
Layer<T> layer_of(const at::Tensor& x, const at::Tensor& left_p, const at::Tensor& right_p,
                  const at::Tensor& bias_p, int64_t r, int64_t n_out, const at::Tensor& zeros) {
  Layer<T> L;
  L.B = x.size(0);
  L.n_in = x.size(1);
  L.n_out = n_out;
  L.r = r;
  L.R = left_p.size(1);
  L.Np = right_p.size(1);
  L.Nip = padded(L.n_in, kLanes<T>);
  L.x = x.is_meta() ? nullptr : x.data_ptr<T>();  // meta: a stand-in whose rows the caller sets
  L.left = left_p.data_ptr<T>();
  L.right = right_p.data_ptr<T>();
  L.bias = bias_p.numel() ? bias_p.data_ptr<T>() : nullptr;
  L.zeros = zeros.data_ptr<T>();
  return L;
}

void check_inputs(const at::Tensor& x, const at::Tensor& left, const at::Tensor& right,
                  const at::Tensor& bias) {
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

// One cross layer over a block of rows (L.B of them), tile after tile, in the calling thread.
template <typename T, int V>
struct CrossTiles {
  static void run(const Layer<T>& L, T* out) {
    for (int64_t b0 = 0; b0 < L.B; b0 += kTile) forward_tile<T, V, true>(L, b0, false, nullptr, out);
  }
};

// One TT linear over a block of rows (L.B of them), tile after tile, in the calling thread;
// t (L.B, R) kept where not null.
template <typename T, int V>
struct LinearTiles {
  static void run(const Layer<T>& L, bool relu, T* t, T* y) {
    for (int64_t b0 = 0; b0 < L.B; b0 += kTile) forward_tile<T, V>(L, b0, relu, t, y);
  }
};

// A block's y = act(t @ right + bias) (rows of them) from the t the forward kept, (rows, R).
template <typename T, int V>
struct OutputsFromT {
  static void run(const Layer<T>& L, const T* t, int64_t rows, bool relu, T* y) {
    constexpr int64_t W = kLanes<T>;
    alignas(64) T tail[kTile][V * W];
    for (int64_t b0 = 0; b0 < rows; b0 += kTile) {
      const int64_t n = std::min(kTile, rows - b0);
      const T* tile = t + b0 * L.R;
      if (n < kTile) {  // the tile's rows past the block read zeros, as in the forward
        std::fill(&tail[0][0], &tail[0][0] + kTile * V * W, T(0));
        std::copy(tile, tile + n * L.R, &tail[0][0]);
        tile = &tail[0][0];
      }
      tile_outputs<T, V>(L, tile, b0, n, nullptr, relu, y);
    }
  }
};

// backward_block over one block of rows with pointers of its own (row 0: the block's first).
template <typename T, int V>
struct BlockBackward {
  static void run(const Layer<T>& L, const Grads<T>& d, int64_t rows, T* gL, T* gR, T* gB, T* G, T* dts) {
    backward_block<T, V>(L, d, 0, rows, gL, gR, gB, G, dts);
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

// The forward's weight operands as its tiles read them: {left (in panels with 16
// registers), right in panels, the padded bias (empty without one), zeros for the rows of a
// tile past B}.
template <typename T>
std::vector<at::Tensor> forward_operands(const at::Tensor& left, const at::Tensor& right,
                                         const at::Tensor& bias) {
  constexpr int64_t W = kLanes<T>;
  const auto left_p = pad_last(left, W), right_p = pad_last(right, W);  // (n_in, R), (r, Np)
  const auto bias_p = bias.numel() ? pad_last(bias.to(left.scalar_type()), W) : bias.to(left.scalar_type());
  const auto zeros = at::zeros({std::max({left.size(0), right_p.size(1), left_p.size(1)})}, left.options());
  // with 16 registers t = x @ left reads left in panels too (panel_product)
  return {kVectorRegisters < 32 ? pack_panels<T>(left_p) : left_p, pack_panels<T>(right_p), bias_p, zeros};
}

// A forward layer over x's rows from forward_operands (r: the rank, n_out: the outputs); x
// may be a meta stand-in whose rows the caller sets.
template <typename T>
Layer<T> forward_layer(const at::Tensor& x, const std::vector<at::Tensor>& operands, int64_t r,
                       int64_t n_out) {
  constexpr int64_t W = kLanes<T>;
  TORCH_CHECK(operands.size() == 4, "tt_linear: ", operands.size(), " packed operands; tt_linear_pack makes 4");
  const auto &left_pk = operands[0], &right_pk = operands[1], &bias_p = operands[2], &zeros = operands[3];
  Layer<T> L;
  L.B = x.size(0);
  L.n_in = x.size(1);
  L.n_out = n_out;
  L.r = r;
  L.R = padded(r, W);
  L.Np = padded(n_out, W);
  L.Nip = padded(L.n_in, W);
  TORCH_CHECK(r >= 1 && left_pk.numel() == L.n_in * L.R && right_pk.numel() == r * L.Np &&
                  (bias_p.numel() == 0 || bias_p.numel() == L.Np) && zeros.numel() >= std::max({L.n_in, L.Np, L.R}),
              "tt_linear: operands packed for another shape than ", L.n_in, " -> ", n_out, " at rank ", r);
  L.x = x.is_meta() ? nullptr : x.data_ptr<T>();
  L.left = left_pk.data_ptr<T>();
  L.right = right_pk.data_ptr<T>();
  L.bias = bias_p.numel() ? bias_p.data_ptr<T>() : nullptr;
  L.zeros = zeros.data_ptr<T>();
  return L;
}

// (y (B, n_out), t (B, R)): t is the padded x @ left, kept for the backward.
std::vector<at::Tensor> tt_linear_forward(at::Tensor x, at::Tensor left, at::Tensor right,
                                          at::Tensor bias, bool relu) {
  check_inputs(x, left, right, bias);
  x = x.contiguous();
  const int64_t B = x.size(0), r = left.size(1), n_out = right.size(1);
  auto y = at::empty({B, n_out}, x.options());
  at::Tensor t;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_linear_forward", [&] {
    const auto operands = forward_operands<scalar_t>(left, right, bias);
    const auto L = forward_layer<scalar_t>(x, operands, r, n_out);
    t = at::empty({B, L.R}, x.options());
    with_vectors<scalar_t, ForwardRows>(L.R / kLanes<scalar_t>, L, relu, t.data_ptr<scalar_t>(),
                                        y.data_ptr<scalar_t>());
  });
  return {y, t};
}

// tt_linear_forward's weight operands prepared once (forward_operands), for a caller that
// scores many batches with the same weights and keeps them: at a few rows the padding and
// the packing were most of a forward call's time.
std::vector<at::Tensor> tt_linear_pack(at::Tensor left, at::Tensor right, at::Tensor bias) {
  const auto like = at::empty({0, left.dim() == 2 ? left.size(0) : 0}, left.options().device(at::kMeta));
  check_inputs(like, left, right, bias);
  std::vector<at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(left.scalar_type(), "tt_linear_pack",
                             [&] { out = forward_operands<scalar_t>(left, right, bias); });
  return out;
}

// y = act((x @ left) @ right + bias) from tt_linear_pack's operands (r: the rank, n_out: the
// outputs), without t: nothing is kept for a backward.
at::Tensor tt_linear_forward_packed(at::Tensor x, std::vector<at::Tensor> packed, int64_t r, int64_t n_out,
                                    bool relu) {
  TORCH_CHECK(!packed.empty() && x.dim() == 2 && x.scalar_type() == packed[0].scalar_type(),
              "tt_linear: x must be a matrix of the ", packed.empty() ? x.scalar_type() : packed[0].scalar_type(),
              " the operands were packed in, got ", x.scalar_type(), " of shape ", x.sizes());
  x = x.contiguous();
  auto y = at::empty({x.size(0), n_out}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_linear_forward_packed", [&] {
    const auto L = forward_layer<scalar_t>(x, packed, r, n_out);
    with_vectors<scalar_t, ForwardRows>(L.R / kLanes<scalar_t>, L, relu, static_cast<scalar_t*>(nullptr),
                                        y.data_ptr<scalar_t>());
  });
  return y;
}

// A DCN cross net for scoring (nothing is kept for a backward): x_0 = x0, then for each
// layer k, x_{k+1} = x_k + x0 * ((x_k @ left_k) @ right_k + bias_k), its two projections
// merged into one TT weight (left_k (N, r_k), right_k (r_k, N)). Each thread takes blocks of
// block_rows rows through every layer, so that between layers a block's x_k and x0 are still
// in its core's cache: a (B, N) activation is read from memory once and written once, not
// read twice and written once per layer, and the threads meet once, not once per layer.
// Each layer after the first overwrites the block's x_k in place: a tile reads its rows of
// x_k (t, then each vector's residual) before it writes them.
//
// x0 comes as column blocks side by side, (B, N_p) each, N = sum N_p (DCN's input is the
// dense features then the pooled embeddings): with more than one, each thread copies its
// block's rows of them into one (block_rows, N) buffer, which then serves as x_0, so the
// (B, N) concatenation is never made.
//
// With next layers (an MLP's TT layers, as a DCN's top MLP begins), the net's output goes on
// through them, relu_j?((x @ next_lefts[j]) @ next_rights[j] + next_biases[j]), block by block
// while the block's rows are in cache, and the last one's (B, n_last) output is returned:
// neither the net's (B, N) output nor the layers' own (B, n_j) outputs are written to memory
// and read back (MLPerf at 4096 rows: 56 MB each way for the net's; not writing it made the
// net 1.16-1.18x faster on a 2-core AVX2 EPYC), and the threads meet once for all of it.
at::Tensor tt_cross_forward(std::vector<at::Tensor> x0_parts, std::vector<at::Tensor> lefts,
                            std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                            int64_t block_rows, std::vector<at::Tensor> next_lefts,
                            std::vector<at::Tensor> next_rights, std::vector<at::Tensor> next_biases,
                            std::vector<bool> next_relus) {
  const auto layers = lefts.size();
  TORCH_CHECK(layers >= 1 && rights.size() == layers && biases.size() == layers, "tt_cross: ", lefts.size(),
              " lefts, ", rights.size(), " rights and ", biases.size(), " biases; one each per layer, at least one");
  const auto nexts = next_lefts.size();
  TORCH_CHECK(next_rights.size() == nexts && next_biases.size() == nexts && next_relus.size() == nexts,
              "tt_cross: ", nexts, " next lefts, ", next_rights.size(), " next rights, ", next_biases.size(),
              " next biases and ", next_relus.size(), " ReLU flags; one each per next layer");
  TORCH_CHECK(block_rows >= 1, "tt_cross: block_rows must be positive, got ", block_rows);
  TORCH_CHECK(!x0_parts.empty(), "tt_cross: x0 needs at least one column block");
  const int64_t B = x0_parts[0].dim() == 2 ? x0_parts[0].size(0) : -1;
  int64_t n = 0;
  for (size_t p = 0; p < x0_parts.size(); ++p) {
    auto& part = x0_parts[p];
    TORCH_CHECK(part.dim() == 2 && part.size(0) == B, "tt_cross: x0's column block ", p, " has shape ", part.sizes(),
                "; each must be (B, N_p) with the first's B");
    TORCH_CHECK(part.scalar_type() == x0_parts[0].scalar_type(), "tt_cross: x0's column blocks need one dtype");
    part = part.contiguous();
    n += part.size(1);
  }
  // a (B, n) stand-in for the shape checks (no data read)
  const auto like = x0_parts.size() == 1 ? x0_parts[0] : at::empty({B, n}, x0_parts[0].options().device(at::kMeta));
  for (size_t k = 0; k < layers; ++k) {
    check_inputs(like, lefts[k], rights[k], biases[k]);
    TORCH_CHECK(rights[k].size(1) == n, "tt_cross: layer ", k, " has ", rights[k].size(1), " outputs for ", n,
                " input features; a cross layer keeps its width");
  }
  // each next layer's input: the one before's output (its stand-in)
  std::vector<at::Tensor> next_inputs;
  int64_t widest = 0;  // the widest next output, for the blocks' buffers
  for (size_t j = 0; j < nexts; ++j) {
    const auto& input = j == 0 ? like : at::empty({B, next_rights[j - 1].size(1)}, like.options().device(at::kMeta));
    TORCH_CHECK(next_lefts[j].numel() > 0, "tt_cross: next layer ", j, "'s left is empty");
    check_inputs(input, next_lefts[j], next_rights[j], next_biases[j]);
    next_inputs.push_back(input);
    widest = std::max(widest, next_rights[j].size(1));
  }
  const int64_t n_out = nexts ? next_rights.back().size(1) : n;
  auto out = at::empty({B, n_out}, x0_parts[0].options());
  AT_DISPATCH_FLOATING_TYPES(x0_parts[0].scalar_type(), "tt_cross_forward", [&] {
    using T = scalar_t;
    constexpr int64_t W = kLanes<T>;
    std::vector<at::Tensor> kept;  // the padded and packed operands, alive for the call
    std::vector<Layer<T>> L(layers);
    for (size_t k = 0; k < layers; ++k) {
      const auto operands = forward_operands<T>(lefts[k], rights[k], biases[k]);
      L[k] = forward_layer<T>(like, operands, lefts[k].size(1), n);
      kept.insert(kept.end(), operands.begin(), operands.end());
    }
    std::vector<Layer<T>> next(nexts);
    for (size_t j = 0; j < nexts; ++j) {
      const auto operands = forward_operands<T>(next_lefts[j], next_rights[j], next_biases[j]);
      next[j] = forward_layer<T>(next_inputs[j], operands, next_lefts[j].size(1), next_rights[j].size(1));
      kept.insert(kept.end(), operands.begin(), operands.end());
    }
    std::vector<const T*> part_ptr;
    std::vector<int64_t> part_cols;
    for (const auto& part : x0_parts) {
      part_ptr.push_back(part.data_ptr<T>());
      part_cols.push_back(part.size(1));
    }
    const bool whole = x0_parts.size() == 1;
    T* out_ptr = out.data_ptr<T>();
    const int64_t blocks = (B + block_rows - 1) / block_rows;
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      // this thread's block of x0, and of x_k and the next layers' outputs but the last (none
      // returned); not zeroed: every element is written before it is read
      const int64_t block = std::min(block_rows, B);
      std::unique_ptr<T[]> gathered(new T[whole ? 0 : block * n]);
      std::unique_ptr<T[]> net_out(new T[nexts ? block * n : 0]), hidden(new T[nexts > 1 ? 2 * block * widest : 0]);
      for (int64_t blk = lo; blk < hi; ++blk) {
        const int64_t b0 = blk * block_rows, rows = std::min(block_rows, B - b0);
        const T* x0_block = whole ? part_ptr[0] + b0 * n : gathered.get();
        if (!whole) {
          for (int64_t i = 0; i < rows; ++i) {
            T* dst = gathered.get() + i * n;
            for (size_t p = 0; p < part_ptr.size(); ++p) {
              const T* src = part_ptr[p] + (b0 + i) * part_cols[p];
              std::copy(src, src + part_cols[p], dst);
              dst += part_cols[p];
            }
          }
        }
        T* x_block = nexts ? net_out.get() : out_ptr + b0 * n;
        for (size_t k = 0; k < layers; ++k) {
          Layer<T> block = L[k];
          block.B = rows;
          block.x = k == 0 ? x0_block : x_block;
          block.x0 = x0_block;
          with_vectors<T, CrossTiles>(block.R / W, block, x_block);
        }
        const T* input = x_block;
        for (size_t j = 0; j < nexts; ++j) {
          Layer<T> head = next[j];
          head.B = rows;
          head.x = input;
          T* y = j + 1 == nexts ? out_ptr + b0 * n_out : hidden.get() + (j % 2) * block * widest;
          with_vectors<T, LinearTiles>(head.R / W, head, static_cast<bool>(next_relus[j]), static_cast<T*>(nullptr), y);
          input = y;
        }
      }
    });
  });
  return out;
}

namespace {

// The backward's weight operands as backward_block reads them: {right^T (n_out, R), in panels
// with 16 registers (dt = g @ right^T by panel_product), left^T (r, Nip) in panels}.
template <typename T>
std::vector<at::Tensor> backward_operands(const at::Tensor& left, const at::Tensor& right) {
  constexpr int64_t W = kLanes<T>;
  const auto right_t = pad_last(right.t(), W);  // (n_out, R)
  const auto left_t = pad_last(left.t(), W);    // (r, Nip)
  return {kVectorRegisters < 32 ? pack_panels<T>(right_t) : right_t, pack_panels<T>(left_t)};
}

// A layer's weight-gradient partials, one set per chunk of rows (zeroed by the thread that
// sums into them), and their sums in chunk order.
template <typename T>
struct GradParts {
  int64_t used = 0, sL = 0, sR = 0, sB = 0;  // chunks; a chunk's grad_left, grad_right, grad_bias
  at::Tensor parts;
  T *gL = nullptr, *gR = nullptr, *gB = nullptr;

  GradParts(const Layer<T>& L, int64_t chunks, bool left, bool bias, const at::TensorOptions& options)
      : used(chunks), sL(left ? L.n_in * L.R : 0), sR(L.r * L.Np), sB(bias ? L.Np : 0) {
    parts = at::empty({used * (sL + sR + sB)}, options);
    gL = parts.template data_ptr<T>();
    gR = gL + used * sL;
    gB = bias ? gR + used * sR : nullptr;
  }
  void zero(int64_t c) const {
    std::fill(gL + c * sL, gL + (c + 1) * sL, T(0));
    std::fill(gR + c * sR, gR + (c + 1) * sR, T(0));
    if (gB) std::fill(gB + c * sB, gB + (c + 1) * sB, T(0));
  }
  T* left(int64_t c) const { return gL + c * sL; }
  T* right(int64_t c) const { return gR + c * sR; }
  T* bias(int64_t c) const { return gB ? gB + c * sB : nullptr; }
  // {grad_left (n_in, r) or undefined, grad_right (r, n_out), grad_bias (n_out) or undefined}
  std::vector<at::Tensor> sums(const Layer<T>& L) const {
    const auto options = parts.options();
    at::Tensor grad_left, grad_bias;
    if (sL) {
      auto gl = at::empty({L.n_in, L.R}, options);
      sum_chunks(gL, used, sL, gl.template data_ptr<T>());
      grad_left = gl.narrow(1, 0, L.r);
    }
    auto gr = at::empty({L.r, L.Np}, options);
    sum_chunks(gR, used, sR, gr.template data_ptr<T>());
    if (sB) {
      auto gb = at::empty({L.Np}, options);
      sum_chunks(gB, used, sB, gb.template data_ptr<T>());
      grad_bias = gb.narrow(0, 0, L.n_out);
    }
    return {grad_left, gr.narrow(1, 0, L.n_out), grad_bias};
  }
};

// The backward's chunks of rows: (chunks used, rows per chunk, whole tiles).
inline std::pair<int64_t, int64_t> backward_chunks(int64_t B) {
  const int64_t chunks = num_chunks(B);
  const int64_t chunk_rows = padded((B + chunks - 1) / chunks, kTile);
  return {std::max<int64_t>(1, (B + chunk_rows - 1) / chunk_rows), chunk_rows};
}

// One layer's backward over the whole batch, each thread taking whole chunks.
template <typename T, int V>
struct BackwardRows {
  static void run(const Layer<T>& L, const Grads<T>& d, int64_t chunk_rows, const GradParts<T>& parts) {
    at::parallel_for(0, parts.used, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> G(padded(kBlockRows, kTile) * L.Np), dts(kBlockRows * V * kLanes<T>);
      for (int64_t c = lo; c < hi; ++c) {
        parts.zero(c);
        const int64_t end = std::min(L.B, (c + 1) * chunk_rows);
        for (int64_t b0 = c * chunk_rows; b0 < end; b0 += kBlockRows)
          backward_block<T, V>(L, d, b0, end, parts.left(c), parts.right(c), parts.bias(c), G.data(), dts.data());
      }
    });
  }
};

}  // namespace

// (grad_x or empty, grad_left (n_in, r) or empty, grad_right (r, n_out), grad_bias or empty).
// y: the forward's output when it applied the ReLU, else empty.
std::vector<at::Tensor> tt_linear_backward(at::Tensor grad_y, at::Tensor x, at::Tensor left,
                                           at::Tensor right, at::Tensor t, at::Tensor y,
                                           bool need_grad_x, bool need_grad_bias, bool need_grad_left) {
  x = x.contiguous();
  grad_y = grad_y.contiguous();
  y = y.contiguous();
  const int64_t B = x.size(0), n_in = x.size(1), r = left.size(1), n_out = right.size(1);
  TORCH_CHECK(grad_y.size(0) == B && grad_y.size(1) == n_out, "tt_linear: grad of shape ", grad_y.sizes(),
              " for an output of (", B, ", ", n_out, ")");
  at::Tensor grad_x = need_grad_x ? at::empty({B, n_in}, x.options()) : at::Tensor();
  std::vector<at::Tensor> grads;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_linear_backward", [&] {
    using T = scalar_t;
    constexpr int64_t W = kLanes<T>;
    const auto left_p = pad_last(left, W);
    const auto right_p = pad_last(right, W);
    const int64_t R = left_p.size(1), Np = right_p.size(1);
    const auto zeros = at::zeros({std::max({n_in, Np, R})}, x.options());
    const auto none = at::empty({0}, x.options());
    const auto L = layer_of<T>(x, left_p, right_p, none, r, n_out, zeros);
    const auto operands = backward_operands<T>(left, right);
    Grads<T> d;
    d.gy = grad_y.data_ptr<T>();
    d.y = y.numel() ? y.data_ptr<T>() : nullptr;
    d.t = t.data_ptr<T>();
    d.right_t = operands[0].data_ptr<T>();
    d.left_t = operands[1].data_ptr<T>();
    d.gx = need_grad_x ? grad_x.data_ptr<T>() : nullptr;
    d.left = need_grad_left;

    const auto [used, chunk_rows] = backward_chunks(B);
    const GradParts<T> parts(L, used, need_grad_left, need_grad_bias, x.options());
    with_vectors<T, BackwardRows>(R / W, L, d, chunk_rows, parts);
    grads = parts.sums(L);
  });
  return {grad_x.defined() ? grad_x : at::Tensor(), grads[0], grads[1], grads[2]};
}

// ---------------------------------------------------------------- a chain of TT linears
//
// An MLP's consecutive fused layers (TT linears, and NarrowLinears: a constant identity
// left) in one call each way. One by one, each layer's forward reads its (B, N_in) input
// and writes its (B, N_out) output, and its backward reads the output's gradient, the output
// (the ReLU's mask) and the input, and writes the input's gradient: passes over activations
// of 8 MB each for a 1024-wide layer at 2048 rows, and the hidden outputs kept for the
// backward.
//
// Here a thread takes a block of rows through every layer while the block is in its core's
// cache. The forward writes the last output and each layer's t (B, R_k), not the hidden
// outputs. The backward goes block by block from the last layer to the first: it recomputes
// each hidden output from its t (one rank product, act(t @ right + bias), the forward's own
// operations) where it is the next layer's input and its own layer's ReLU mask, and hands
// each layer's input gradient to the layer below in the block's buffer. Only the last
// output's gradient, the first input and its gradient go through memory.
//
// Blocks and chunks are the single-layer kernels', so every value is the one the layers
// would give one by one, bit for bit, for any number of threads. Every block reads all the
// chain's weights and weight-gradient partials, so a chain pays only while they stay in
// the core's cache (the caller cuts runs: kernels.chain_fits). Measured at DLRM's Kaggle
// shapes: the forward 1.10-1.20x faster than the layers one by one, the backward 1.02-1.06x
// slower (the recomputation), the hidden outputs' memory saved (docs/tensor.md).

namespace {

// Each layer's packed forward operands (kept alive with the Layer that points into them).
template <typename T>
struct ChainLayers {
  std::vector<at::Tensor> kept;
  std::vector<Layer<T>> layers;
  int64_t widest_out = 0, widest_in = 0, widest_np = 0, widest_r = 0;
};

void check_chain(const at::Tensor& x, const std::vector<at::Tensor>& lefts, const std::vector<at::Tensor>& rights,
                 const std::vector<at::Tensor>& biases, const std::vector<bool>& relus) {
  const auto K = lefts.size();
  TORCH_CHECK(K >= 1 && rights.size() == K && biases.size() == K && relus.size() == K, "tt_chain: ", K,
              " lefts, ", rights.size(), " rights, ", biases.size(), " biases and ", relus.size(),
              " ReLU flags; one each per layer, at least one layer");
  TORCH_CHECK(x.dim() == 2, "tt_chain: x must be a matrix, got shape ", x.sizes());
  for (size_t k = 0; k < K; ++k) {
    const auto like = k == 0 ? x : at::empty({x.size(0), rights[k - 1].size(1)}, x.options().device(at::kMeta));
    TORCH_CHECK(lefts[k].dim() == 2 && lefts[k].size(1) >= 1, "tt_chain: layer ", k, "'s left must be (N_in, r >= 1), got ",
                lefts[k].sizes());
    check_inputs(like, lefts[k], rights[k], biases[k]);
  }
}

template <typename T>
ChainLayers<T> chain_layers(const at::Tensor& x, const std::vector<at::Tensor>& lefts,
                            const std::vector<at::Tensor>& rights, const std::vector<at::Tensor>& biases) {
  ChainLayers<T> C;
  for (size_t k = 0; k < lefts.size(); ++k) {
    const auto operands = forward_operands<T>(lefts[k], rights[k], biases[k]);
    const auto like = k == 0 ? x : at::empty({x.size(0), rights[k - 1].size(1)}, x.options().device(at::kMeta));
    auto L = forward_layer<T>(like, operands, lefts[k].size(1), rights[k].size(1));
    C.kept.insert(C.kept.end(), operands.begin(), operands.end());
    C.widest_out = std::max(C.widest_out, L.n_out);
    C.widest_in = std::max(C.widest_in, L.n_in);
    C.widest_np = std::max(C.widest_np, L.Np);
    C.widest_r = std::max(C.widest_r, L.R);
    C.layers.push_back(L);
  }
  return C;
}

}  // namespace

// {y (B, n_out of the last), then t_k (B, R_k) for each layer k: the padded input @ left_k}.
// Layer k: y_k = relu_k?((y_{k-1} @ lefts[k]) @ rights[k] + biases[k]) (bias empty: none).
std::vector<at::Tensor> tt_chain_forward(at::Tensor x, std::vector<at::Tensor> lefts,
                                         std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                                         std::vector<bool> relus) {
  check_chain(x, lefts, rights, biases, relus);
  x = x.contiguous();
  const int64_t B = x.size(0), K = static_cast<int64_t>(lefts.size());
  std::vector<at::Tensor> out{at::empty({B, rights.back().size(1)}, x.options())};
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_chain_forward", [&] {
    using T = scalar_t;
    constexpr int64_t W = kLanes<T>;
    const auto C = chain_layers<T>(x, lefts, rights, biases);
    std::vector<T*> t(K);
    for (int64_t k = 0; k < K; ++k) {
      out.push_back(at::empty({B, C.layers[k].R}, x.options()));
      t[k] = out.back().data_ptr<T>();
    }
    const T* x_ptr = x.data_ptr<T>();
    T* y_ptr = out[0].data_ptr<T>();
    const int64_t n_in = x.size(1), n_last = C.layers.back().n_out, width = C.widest_out;
    at::parallel_for(0, (B + kBlockRows - 1) / kBlockRows, 1, [&](int64_t lo, int64_t hi) {
      // this thread's hidden outputs, two blocks (a layer's input and output); not zeroed:
      // every element is written before it is read
      std::unique_ptr<T[]> hidden(new T[K > 1 ? 2 * kBlockRows * width : 0]);
      for (int64_t blk = lo; blk < hi; ++blk) {
        const int64_t b0 = blk * kBlockRows, rows = std::min(kBlockRows, B - b0);
        const T* input = x_ptr + b0 * n_in;
        for (int64_t k = 0; k < K; ++k) {
          Layer<T> L = C.layers[k];
          L.B = rows;
          L.x = input;
          T* y = k + 1 == K ? y_ptr + b0 * n_last : hidden.get() + (k % 2) * kBlockRows * width;
          with_vectors<T, LinearTiles>(L.R / W, L, static_cast<bool>(relus[k]), t[k] + b0 * L.R, y);
          input = y;
        }
      }
    });
  });
  return out;
}

// {grad_x or undefined, then per layer {grad_left or undefined, grad_right, grad_bias or
// undefined}} from tt_chain_forward's ts (biases: the forward's, which the recomputed
// hidden outputs need). y: the forward's output where the last layer has a ReLU (its mask,
// not recomputed), else empty.
std::vector<at::Tensor> tt_chain_backward(at::Tensor grad_y, at::Tensor x, std::vector<at::Tensor> lefts,
                                          std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                                          std::vector<bool> relus, std::vector<at::Tensor> ts, at::Tensor y,
                                          bool need_grad_x, std::vector<bool> need_grad_left,
                                          std::vector<bool> need_grad_bias) {
  check_chain(x, lefts, rights, biases, relus);
  const int64_t B = x.size(0), K = static_cast<int64_t>(lefts.size());
  TORCH_CHECK(static_cast<int64_t>(ts.size()) == K && static_cast<int64_t>(need_grad_left.size()) == K &&
                  static_cast<int64_t>(need_grad_bias.size()) == K,
              "tt_chain: ", ts.size(), " saved t, ", need_grad_left.size(), " and ", need_grad_bias.size(),
              " gradient flags for ", K, " layers");
  TORCH_CHECK(grad_y.dim() == 2 && grad_y.size(0) == B && grad_y.size(1) == rights.back().size(1),
              "tt_chain: grad of shape ", grad_y.sizes(), " for an output of (", B, ", ", rights.back().size(1), ")");
  TORCH_CHECK(y.numel() == 0 || (y.sizes() == grad_y.sizes() && y.scalar_type() == x.scalar_type()),
              "tt_chain: the forward's output has shape ", y.sizes(), " for a gradient of ", grad_y.sizes());
  x = x.contiguous();
  grad_y = grad_y.contiguous();
  y = y.contiguous();
  at::Tensor grad_x = need_grad_x ? at::empty({B, x.size(1)}, x.options()) : at::Tensor();
  std::vector<at::Tensor> out{grad_x};
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_chain_backward", [&] {
    using T = scalar_t;
    constexpr int64_t W = kLanes<T>;
    const auto C = chain_layers<T>(x, lefts, rights, biases);
    const auto [used, chunk_rows] = backward_chunks(B);
    std::vector<at::Tensor> kept;
    std::vector<Grads<T>> grads(K);
    std::vector<GradParts<T>> parts;
    std::vector<const T*> t(K);
    for (int64_t k = 0; k < K; ++k) {
      const auto& L = C.layers[k];
      TORCH_CHECK(ts[k].dim() == 2 && ts[k].size(0) == B && ts[k].size(1) == L.R && ts[k].is_contiguous() &&
                      ts[k].scalar_type() == x.scalar_type(),
                  "tt_chain: layer ", k, "'s saved t has shape ", ts[k].sizes(), "; the forward made (", B, ", ", L.R,
                  ")");
      t[k] = ts[k].data_ptr<T>();
      const auto operands = backward_operands<T>(lefts[k], rights[k]);
      kept.insert(kept.end(), operands.begin(), operands.end());
      grads[k].right_t = operands[0].data_ptr<T>();
      grads[k].left_t = operands[1].data_ptr<T>();
      grads[k].left = need_grad_left[k];
      parts.emplace_back(L, used, need_grad_left[k], need_grad_bias[k] && biases[k].numel() > 0, x.options());
    }
    const T* x_ptr = x.data_ptr<T>();
    const T* gy_ptr = grad_y.data_ptr<T>();
    const T* y_ptr = y.numel() ? y.data_ptr<T>() : nullptr;
    T* gx_ptr = need_grad_x ? grad_x.data_ptr<T>() : nullptr;
    const int64_t n_in = x.size(1), n_last = C.layers.back().n_out;
    at::parallel_for(0, used, 1, [&](int64_t lo, int64_t hi) {
      // scratch: backward_block's G and dt, the block's recomputed outputs (two: a layer's
      // input and its output, the mask) and its input gradients (two: a layer's and the one
      // it reads)
      const int64_t block = kBlockRows;
      std::vector<T> G(padded(block, kTile) * C.widest_np), dts(block * C.widest_r);
      std::vector<T> X(2 * block * C.widest_out), GX(2 * block * C.widest_in);
      for (int64_t c = lo; c < hi; ++c) {
        for (const auto& p : parts) p.zero(c);
        const int64_t end = std::min(B, (c + 1) * chunk_rows);
        for (int64_t b0 = c * chunk_rows; b0 < end; b0 += block) {
          const int64_t rows = std::min(block, end - b0);
          int xb = 0;                // the X buffer the next recomputed output goes to
          const T* mask = nullptr;   // the current layer's output, where it has a ReLU
          if (relus[K - 1] && y_ptr) {
            mask = y_ptr + b0 * n_last;
          } else if (relus[K - 1]) {
            const auto& L = C.layers[K - 1];
            with_vectors<T, OutputsFromT>(L.R / W, L, t[K - 1] + b0 * L.R, rows, true, X.data());
            mask = X.data();
            xb = 1;
          }
          const T* gy = gy_ptr + b0 * n_last;
          for (int64_t k = K - 1; k >= 0; --k) {
            Layer<T> L = C.layers[k];
            L.B = rows;
            if (k > 0) {  // this layer's input: the layer below's output, recomputed
              const auto& below = C.layers[k - 1];
              T* xk = X.data() + xb * block * C.widest_out;
              with_vectors<T, OutputsFromT>(below.R / W, below, t[k - 1] + b0 * below.R, rows,
                                            static_cast<bool>(relus[k - 1]), xk);
              L.x = xk;
              xb ^= 1;
            } else {
              L.x = x_ptr + b0 * n_in;
            }
            Grads<T> d = grads[k];
            d.gy = gy;
            d.y = relus[k] ? mask : nullptr;
            d.t = t[k] + b0 * L.R;
            d.gx = k > 0 ? GX.data() + (k % 2) * block * C.widest_in : (gx_ptr ? gx_ptr + b0 * n_in : nullptr);
            with_vectors<T, BlockBackward>(L.R / W, L, d, rows, parts[k].left(c), parts[k].right(c),
                                           parts[k].bias(c), G.data(), dts.data());
            gy = d.gx;
            mask = L.x;
          }
        }
      }
    });
    for (int64_t k = 0; k < K; ++k) {
      const auto sums = parts[k].sums(C.layers[k]);
      out.insert(out.end(), sums.begin(), sums.end());
    }
  });
  return out;
}

// ---------------------------------------------------------------- the chains of a TT weight
//
// A TT linear's 2d cores (r_{k-1}, n_k, r_k), with a controller (diagonal) on each of the
// 2d - 1 bonds, merged into left = G_1 D_1 ... G_d D_d as (N_in, r) and right =
// G_{d+1} D_{d+1} ... D_{2d-1} G_{2d} as (r, N_out): each controller scales the running
// product of its side (left's columns, right's rows), the same product as scaling a core.
// Composed of torch operators with autograd, that is about 50 small operators a layer
// forward and backward, whose dispatch cost more than their arithmetic (a few MFLOP); as
// ATen calls from C++ (MKL's products, ATen's elementwise loops) still ~30 calls a layer,
// 0.3 ms forward and backward for ~5 MFLOP. Here they are loops of our own in the calling
// thread: the products are too small to share between threads.
//
// Forward returns {left (in_features rows), right (out_features columns), then per left
// bond k the running product before and after its controller (P_k, Q_k), then per right
// bond k = 2d - 2 .. d the same (R_k, S_k)}: what the backward reads.

namespace {

void check_chains(const std::vector<at::Tensor>& cores, const std::vector<at::Tensor>& controllers, int64_t d) {
  TORCH_CHECK(d >= 1 && static_cast<int64_t>(cores.size()) == 2 * d, "tt_chains: ", cores.size(),
              " cores for ", d, " input cores (need 2d)");
  TORCH_CHECK(static_cast<int64_t>(controllers.size()) == 2 * d - 1, "tt_chains: ", controllers.size(),
              " controllers for ", cores.size(), " cores (need one per bond)");
  for (size_t k = 0; k < cores.size(); ++k) {
    TORCH_CHECK(cores[k].dim() == 3, "tt_chains: core ", k, " must be (r, n, r'), got ", cores[k].sizes());
    TORCH_CHECK(cores[k].scalar_type() == cores[0].scalar_type(), "tt_chains: core ", k, " is ",
                cores[k].scalar_type(), ", core 0 ", cores[0].scalar_type());
    if (k + 1 < cores.size())
      TORCH_CHECK(controllers[k].dim() == 1 && controllers[k].size(0) == cores[k].size(2) &&
                      cores[k + 1].size(0) == cores[k].size(2) &&
                      controllers[k].scalar_type() == cores[0].scalar_type(),
                  "tt_chains: bond ", k, " has ranks ", cores[k].size(2), " / ", cores[k + 1].size(0),
                  " and a controller of ", controllers[k].sizes(), " (", controllers[k].scalar_type(), ")");
  }
  TORCH_CHECK(cores.front().size(0) == 1 && cores.back().size(2) == 1, "tt_chains: the end ranks must be 1");
}

std::vector<at::Tensor> contiguous_all(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.contiguous());
  return out;
}

// out[i0 : i0 + RB][j : j + CB W] of small_gemm in registers: RB x CB independent sums
// (enough of them that consecutive multiply-adds do not wait on each other), each stored once.
template <int RB, int CB, typename T>
inline void gemm_tile(T* out, int64_t ldo, int64_t i0, int64_t j, int64_t K, const T* a, int64_t a_row,
                      int64_t a_col, const T* b, int64_t ldb) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> acc[RB][CB] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec_t<T> bv[CB];
    for (int u = 0; u < CB; ++u) bv[u] = vload(b + k * ldb + j + u * W);
    for (int r = 0; r < RB; ++r) {
      const T av = a[(i0 + r) * a_row + k * a_col];
      for (int u = 0; u < CB; ++u) acc[r][u] += av * bv[u];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int u = 0; u < CB; ++u) vstore(out + (i0 + r) * ldo + j + u * W, acc[r][u]);
}

// out (rows, cols), rows ldo apart, = A @ B with A[i][k] = a[i * a_row + k * a_col] (so a
// transposed A is a_row = 1) and B (K, cols) rows ldb apart, every sum in k order: tiles
// of 2 rows x 4 vectors, narrow column rests in tiles of 8 rows x 1 vector (a rank of 32
// is 2 float32 vectors with AVX-512), the last columns short of a vector as a vector padded with zeros.
template <typename T>
void small_gemm(T* out, int64_t ldo, int64_t rows, int64_t cols, int64_t K, const T* a, int64_t a_row,
                int64_t a_col, const T* b, int64_t ldb) {
  constexpr int64_t W = kLanes<T>;
  int64_t j = 0;
  for (; j + 4 * W <= cols; j += 4 * W) {
    int64_t i = 0;
    for (; i + 2 <= rows; i += 2) gemm_tile<2, 4>(out, ldo, i, j, K, a, a_row, a_col, b, ldb);
    for (; i < rows; ++i) gemm_tile<1, 4>(out, ldo, i, j, K, a, a_row, a_col, b, ldb);
  }
  for (; j + W <= cols; j += W) {
    int64_t i = 0;
    for (; i + 8 <= rows; i += 8) gemm_tile<8, 1>(out, ldo, i, j, K, a, a_row, a_col, b, ldb);
    for (; i < rows; ++i) gemm_tile<1, 1>(out, ldo, i, j, K, a, a_row, a_col, b, ldb);
  }
  if (j == cols) return;
  // the last cols - j < W columns: B's as whole vectors padded with zeros, into a scratch
  const int64_t rest = cols - j;
  std::vector<T> bp(K * W, T(0)), op(rows * W);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < rest; ++c) bp[k * W + c] = b[k * ldb + j + c];
  int64_t i = 0;
  for (; i + 8 <= rows; i += 8) gemm_tile<8, 1>(op.data(), W, i, 0, K, a, a_row, a_col, bp.data(), W);
  for (; i < rows; ++i) gemm_tile<1, 1>(op.data(), W, i, 0, K, a, a_row, a_col, bp.data(), W);
  for (i = 0; i < rows; ++i)
    for (int64_t c = 0; c < rest; ++c) out[i * ldo + j + c] = op[i * W + c];
}

// (rows, cols) -> (cols, rows)
template <typename T>
std::vector<T> transposed(const T* m, int64_t rows, int64_t cols) {
  std::vector<T> out(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * rows + i] = m[i * cols + j];
  return out;
}

template <typename T>
std::vector<at::Tensor> chains_forward(const std::vector<at::Tensor>& cores, const std::vector<at::Tensor>& controllers,
                                       int64_t d, int64_t in_features, int64_t out_features) {
  const auto options = cores[0].options();
  std::vector<at::Tensor> saved;
  // left: P_0 = G_1 as (n_1, r_1); Q_k = P_k D_k; P_{k+1} = (Q_k @ G_{k+2}) as (N, r)
  int64_t N = cores[0].size(1), r = cores[0].size(2);
  at::Tensor P = cores[0].view({N, r});
  at::Tensor Q;
  for (int64_t k = 0; k < d; ++k) {
    Q = at::empty({N, r}, options);
    const T* p = P.data_ptr<T>();
    const T* dk = controllers[k].data_ptr<T>();
    T* q = Q.data_ptr<T>();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t c = 0; c < r; ++c) q[i * r + c] = p[i * r + c] * dk[c];
    saved.push_back(P);
    saved.push_back(Q);
    if (k + 1 < d) {
      const auto& g = cores[k + 1];  // (r, n, r')
      const int64_t n = g.size(1), r2 = g.size(2);
      P = at::empty({N * n, r2}, options);
      small_gemm(P.data_ptr<T>(), n * r2, N, n * r2, r, q, r, 1, g.data_ptr<T>(), n * r2);
      N *= n;
      r = r2;
    }
  }
  // right, from the last core: R_k = the product of cores k + 1 .. 2d - 1 as (r_k, M);
  // S_k = D_k R_k; R_{k-1} = (G_k as (r_{k-1} n_k, r_k) @ S_k) as (r_{k-1}, n_k M)
  const auto& last = cores[2 * d - 1];
  int64_t M = last.size(1);
  at::Tensor R = last.view({last.size(0), M});
  for (int64_t k = 2 * d - 2; k >= d; --k) {
    const int64_t rk = R.size(0);
    at::Tensor S = at::empty({rk, M}, options);
    const T* rp = R.data_ptr<T>();
    const T* dk = controllers[k].data_ptr<T>();
    T* s = S.data_ptr<T>();
    for (int64_t b = 0; b < rk; ++b)
      for (int64_t m = 0; m < M; ++m) s[b * M + m] = dk[b] * rp[b * M + m];
    saved.push_back(R);
    saved.push_back(S);
    const auto& g = cores[k];  // (r_{k-1}, n_k, r_k)
    const int64_t rows = g.size(0) * g.size(1);
    R = at::empty({g.size(0), g.size(1) * M}, options);
    small_gemm(R.data_ptr<T>(), M, rows, M, rk, g.data_ptr<T>(), rk, 1, s, M);
    M *= g.size(1);
  }
  TORCH_CHECK(in_features >= 1 && in_features <= Q.size(0) && out_features >= 1 && out_features <= R.size(1),
              "tt_chains: ", in_features, " x ", out_features, " features from a ", Q.size(0), " x ", R.size(1),
              " train");
  std::vector<at::Tensor> out = {Q.narrow(0, 0, in_features), R.narrow(1, 0, out_features)};
  out.insert(out.end(), saved.begin(), saved.end());
  return out;
}

// `full` (rows, cols) holds `part` (rows, part_cols) in its first columns and zeros after.
template <typename T>
at::Tensor zero_padded(const at::Tensor& part, int64_t rows, int64_t cols) {
  at::Tensor full = at::empty({rows, cols}, part.options());
  const int64_t pc = part.size(1), pr = part.size(0);
  const T* src = part.data_ptr<T>();
  T* dst = full.data_ptr<T>();
  for (int64_t i = 0; i < pr; ++i) {
    std::copy(src + i * pc, src + (i + 1) * pc, dst + i * cols);
    std::fill(dst + i * cols + pc, dst + (i + 1) * cols, T(0));
  }
  std::fill(dst + pr * cols, dst + rows * cols, T(0));
  return full;
}

template <typename T>
std::vector<at::Tensor> chains_backward(const at::Tensor& grad_left, const at::Tensor& grad_right,
                                        const std::vector<at::Tensor>& cores,
                                        const std::vector<at::Tensor>& controllers,
                                        const std::vector<at::Tensor>& saved, int64_t d) {
  const auto options = cores[0].options();
  std::vector<at::Tensor> grad_cores(2 * d), grad_controllers(2 * d - 1);
  // left, from its last bond back; grad_left covers in_features of the N_in rows
  const auto& Q_last = saved[2 * (d - 1) + 1];
  at::Tensor gQ = zero_padded<T>(grad_left, Q_last.size(0), Q_last.size(1));
  for (int64_t k = d - 1; k >= 0; --k) {
    const auto& P = saved[2 * k];
    const int64_t N = P.size(0), r = P.size(1);
    T* gq = gQ.data_ptr<T>();
    const T* p = P.data_ptr<T>();
    const T* dk = controllers[k].data_ptr<T>();
    // grad D_k = column sums of gQ * P; then gQ * D_k in place: gP
    grad_controllers[k] = at::zeros({r}, options);
    T* gd = grad_controllers[k].data_ptr<T>();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t c = 0; c < r; ++c) {
        gd[c] += gq[i * r + c] * p[i * r + c];
        gq[i * r + c] *= dk[c];
      }
    if (k == 0) {
      grad_cores[0] = gQ.view(cores[0].sizes());
      break;
    }
    const auto& g = cores[k];  // (r_{k-1}, n, r)
    const auto& Q_prev = saved[2 * (k - 1) + 1];  // (N_prev, r_{k-1})
    const int64_t N_prev = Q_prev.size(0), r_prev = Q_prev.size(1), width = g.size(1) * r;
    // gP as (N_prev, n r): grad G_k = Q_prev^T @ gP; grad Q_prev = gP @ G_k^T
    grad_cores[k] = at::empty(g.sizes(), options);
    small_gemm(grad_cores[k].data_ptr<T>(), width, r_prev, width, N_prev, Q_prev.data_ptr<T>(), 1, r_prev, gq, width);
    const auto gT = transposed(g.data_ptr<T>(), r_prev, width);  // (n r, r_{k-1})
    at::Tensor gQ_prev = at::empty({N_prev, r_prev}, options);
    small_gemm(gQ_prev.data_ptr<T>(), r_prev, N_prev, r_prev, width, gq, width, 1, gT.data(), r_prev);
    gQ = gQ_prev;
  }
  // right, from its first bond (d) on; grad_right covers out_features of the N_out columns
  const int64_t base = 2 * d;  // saved[base + 2 j], saved[base + 2 j + 1]: R_k, S_k for k = 2d - 2 - j
  int64_t n_out = 1;           // N_out: the output modes' product
  for (int64_t k = d; k < 2 * d; ++k) n_out *= cores[k].size(1);
  at::Tensor gR = zero_padded<T>(grad_right, cores[d].size(0), n_out);
  for (int64_t k = d; k <= 2 * d - 2; ++k) {
    const int64_t j = 2 * d - 2 - k;
    const auto& R = saved[base + 2 * j];
    const auto& S = saved[base + 2 * j + 1];
    const auto& g = cores[k];  // (r_{k-1}, n_k, r_k)
    const int64_t rk = S.size(0), M = S.size(1), rows = g.size(0) * g.size(1);
    const T* G = gR.data_ptr<T>();  // (r_{k-1} n_k, M)
    // grad G_k = G @ S^T; gS = G_k^T @ G, both over the (r_{k-1} n_k) rows
    const auto sT = transposed(S.data_ptr<T>(), rk, M);  // (M, r_k)
    grad_cores[k] = at::empty(g.sizes(), options);
    small_gemm(grad_cores[k].data_ptr<T>(), rk, rows, rk, M, G, M, 1, sT.data(), rk);
    at::Tensor gS = at::empty({rk, M}, options);
    T* gs = gS.data_ptr<T>();
    small_gemm(gs, M, rk, M, rows, g.data_ptr<T>(), 1, rk, G, M);
    // grad D_k = row sums of gS * R; then D_k gS in place: the next gR
    grad_controllers[k] = at::empty({rk}, options);
    T* gd = grad_controllers[k].data_ptr<T>();
    const T* rp = R.data_ptr<T>();
    const T* dk = controllers[k].data_ptr<T>();
    for (int64_t b = 0; b < rk; ++b) {
      T sum = 0;
      for (int64_t m = 0; m < M; ++m) {
        sum += gs[b * M + m] * rp[b * M + m];
        gs[b * M + m] *= dk[b];
      }
      gd[b] = sum;
    }
    gR = gS;
  }
  grad_cores[2 * d - 1] = gR.view(cores[2 * d - 1].sizes());
  std::vector<at::Tensor> out = grad_cores;
  out.insert(out.end(), grad_controllers.begin(), grad_controllers.end());
  return out;
}

}  // namespace

std::vector<at::Tensor> tt_chains_forward(std::vector<at::Tensor> cores, std::vector<at::Tensor> controllers,
                                          int64_t d, int64_t in_features, int64_t out_features) {
  check_chains(cores, controllers, d);
  cores = contiguous_all(cores);
  controllers = contiguous_all(controllers);
  std::vector<at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(cores[0].scalar_type(), "tt_chains_forward",
                             [&] { out = chains_forward<scalar_t>(cores, controllers, d, in_features, out_features); });
  return out;
}

// The gradients of the 2d cores, then of the 2d - 1 controllers.
std::vector<at::Tensor> tt_chains_backward(at::Tensor grad_left, at::Tensor grad_right,
                                           std::vector<at::Tensor> cores,
                                           std::vector<at::Tensor> controllers, std::vector<at::Tensor> saved,
                                           int64_t d) {
  check_chains(cores, controllers, d);
  TORCH_CHECK(static_cast<int64_t>(saved.size()) == 2 * (2 * d - 1), "tt_chains: ", saved.size(),
              " saved products for ", 2 * d - 1, " bonds");
  cores = contiguous_all(cores);
  controllers = contiguous_all(controllers);
  saved = contiguous_all(saved);
  grad_left = grad_left.contiguous();
  grad_right = grad_right.contiguous();
  std::vector<at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(cores[0].scalar_type(), "tt_chains_backward", [&] {
    out = chains_backward<scalar_t>(grad_left, grad_right, cores, controllers, saved, d);
  });
  return out;
}
