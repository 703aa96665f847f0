// Fused CPU TTM embedding-bag lookup: forward and backward of the de-duplicated lookup.
//
// A train of d = 2..4 cores (T, r_{k-1}, n_k, m_k, r_k) is split into a left half (the
// first h = ceil(d / 2) cores) and a right half. Row i of table t is
//
//     row(t, i) = P(t, i / N_r) @ S(t, i % N_r)^T        P: (M_l, r), S: (M_r, r)
//
// with P the left half's product for the prefix index, S the right half's product for
// the suffix index (stored transposed: rank last), r the middle rank. The lookup
//
//   1. maps every id's prefix and suffix key to a slot, in key order, through
//      direct-address arrays over the (small) key spaces T * N_l and T * N_r: the
//      tensor-index-level de-duplication without a sort;
//   2. contracts each distinct prefix and suffix once (a few small matrix products);
//   3. contracts and pools per bag: out[b] = sum_i w_i row_i (threads own bags).
//
// Backward: the ids' row gradients summed per distinct row (ids of one table and id);
// per row, that gradient is sent into its prefix's and its suffix's slot gradient; then
// each slot gradient into the core slices it came from. Every write has
// one owner thread (slot or core index modulo the thread count), so there are no
// atomics and the result does not depend on the number of threads except for the order
// of additions. Nothing of the size of a table or a half table is formed.

#include "aten_ops.h"
#ifndef COMERA_OPERATOR_LIBRARY  // the operator library binds no Python module
#include "python_module.h"
#endif

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace comera;

constexpr int64_t kAhead = 4;  // ids ahead whose rows are prefetched in the per-id loops

// Multiply-adds of the lookup's contraction phases (products of core slices, the work that
// shrinks with the rank) since the last take_contraction_madds(): benchmarks set them against
// those phases' time. Counted at the true rank (not the padded lanes), forward and backward.
std::atomic<int64_t> g_contraction_madds{0};

// The lookup's phases as scopes of torch's profiler, so that a profile shows where a
// lookup's time goes: the contractions, whose FLOPs shrink with the rank, apart from the
// work per id and per distinct row, which does not. Nothing is recorded while no profiler
// is on. The names are ttm_cpu.py's PHASE_KINDS.
class ProfiledPhases {
 public:
  // end the running phase (if any) and start `name` (a string literal)
  void start(const char* name) {
    running_.reset();
    running_.emplace(at::RecordScope::USER_SCOPE);
    if (running_->isActive()) running_->before(name);
  }

 private:
  std::optional<at::RecordFunction> running_;  // ended when reset or destroyed
};

// sum_i a[i] b[i] over n = C whole vectors
template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> acc = vload(a) * vload(b);
  for (int64_t c = W; c < n; c += W) acc += vload(a + c) * vload(b + c);
  return hsum(acc);
}

// A small contraction summed over a list of entries (ids or slots), the shape of every
// gradient product of the backward and of the forward's half products:
//
//   out[j * ostride + c] = sum_e sum_{k1 < K1, k2 < K2} a(e)[k1 * ak1 + k2 * ak2 + j * aj] * b(e)[k1 * bk1 + k2 * bk2 + c]
//
// for rows j < rows and columns c < cols (a whole number of vectors). The output is made
// tile by tile in registers, JB rows by CB vectors: each (k1, k2) step broadcasts JB
// values of a and loads CB vectors of b for JB * CB multiply-adds (a loop that made one
// output vector at a time did one multiply-add per two loads), and each tile is stored
// once. Small tiles alternate two sets of accumulators over k2, so that consecutive
// multiply-adds do not wait on each other.
struct Contraction {
  int64_t rows = 1, cols = 0, ostride = 0;  // output: rows x cols, rows ostride apart
  int64_t K1 = 1, K2 = 1;                   // summed indices per entry
  int64_t ak1 = 0, ak2 = 0, aj = 0;         // strides of a: k1, k2, row
  int64_t bk1 = 0, bk2 = 0;                 // strides of b: k1, k2 (columns contiguous)
};

template <int JB, int CB, int U, typename T, typename AOf, typename BOf, typename Ahead>
inline void contract_tile(T* out, const Contraction& k, const int64_t* entries, int64_t count, AOf a_of, BOf b_of,
                          Ahead ahead, int64_t j0, int64_t c0) {
  constexpr int64_t W = kLanes<T>;
  vec_t<T> acc[U][JB][CB];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < JB; ++j)
      for (int c = 0; c < CB; ++c) acc[u][j][c] = vzero<T>();
  auto step = [&](vec_t<T>(&sum)[JB][CB], const T* ak, const T* bk) {
    vec_t<T> bv[CB];
    for (int c = 0; c < CB; ++c) bv[c] = vload_held(bk + c * W);  // not folded into each row's multiply-add
    for (int j = 0; j < JB; ++j) {
      const T s = ak[j * k.aj];
      for (int c = 0; c < CB; ++c) sum[j][c] += s * bv[c];
    }
  };
  for (int64_t q = 0; q < count; ++q) {
    if (j0 == 0 && c0 == 0 && q + kAhead < count) ahead(entries[q + kAhead]);
    const T* a = a_of(entries[q]) + j0 * k.aj;
    const T* b = b_of(entries[q]) + c0;
    for (int64_t k1 = 0; k1 < k.K1; ++k1) {
      const T* a1 = a + k1 * k.ak1;
      const T* b1 = b + k1 * k.bk1;
      int64_t k2 = 0;
      if constexpr (U == 2)
        for (; k2 + 2 <= k.K2; k2 += 2) {
          step(acc[0], a1 + k2 * k.ak2, b1 + k2 * k.bk2);
          step(acc[1], a1 + (k2 + 1) * k.ak2, b1 + (k2 + 1) * k.bk2);
        }
      for (; k2 < k.K2; ++k2) step(acc[0], a1 + k2 * k.ak2, b1 + k2 * k.bk2);
    }
  }
  for (int j = 0; j < JB; ++j)
    for (int c = 0; c < CB; ++c) {
      vec_t<T> v = acc[0][j][c];
      if constexpr (U == 2) v += acc[1][j][c];
      vstore(out + (j0 + j) * k.ostride + c0 + c * W, v);
    }
}

// Rows of a tile of CB vectors: JB x CB accumulators and CB loaded vectors fill at most the
// vector registers (16 or 8 accumulators with AVX-512's 32; with AVX2's 16, fewer rows).
template <int CB>
constexpr int tile_rows() {
  if constexpr (kVectorRegisters >= 32) return CB >= 4 ? 4 : 8;
  return std::max(1, std::min(8, (kVectorRegisters - CB - 1) / CB));
}
// Two sets of accumulators for a small tile, where they fit.
template <int JB, int CB>
constexpr int tile_sets() { return 2 * JB * CB + CB < kVectorRegisters ? 2 : 1; }

template <int CB, typename T, typename AOf, typename BOf, typename Ahead>
inline void contract_rows(T* out, const Contraction& k, const int64_t* entries, int64_t count, AOf a_of, BOf b_of,
                          Ahead ahead, int64_t c0) {
  constexpr int JB = tile_rows<CB>();
  int64_t j = 0;
  for (; j + JB <= k.rows; j += JB) contract_tile<JB, CB, 1>(out, k, entries, count, a_of, b_of, ahead, j, c0);
  if (JB > 4 && j + 4 <= k.rows) {
    contract_tile<4, CB, 1>(out, k, entries, count, a_of, b_of, ahead, j, c0);
    j += 4;
  }
  if (JB > 2 && j + 2 <= k.rows) {
    contract_tile<2, CB, tile_sets<2, CB>()>(out, k, entries, count, a_of, b_of, ahead, j, c0);
    j += 2;
  }
  for (; j < k.rows; ++j) contract_tile<1, CB, tile_sets<1, CB>()>(out, k, entries, count, a_of, b_of, ahead, j, c0);
}

constexpr auto kNoPrefetch = [](int64_t) {};

// The output in tiles of 4, 2 and 1 vectors of columns.
template <typename T, typename AOf, typename BOf, typename Ahead>
inline void contract_columns(T* out, const Contraction& k, const int64_t* entries, int64_t count, AOf a_of, BOf b_of,
                             Ahead ahead) {
  constexpr int64_t W = kLanes<T>;
  const int64_t cv = k.cols / W;
  int64_t c = 0;
  for (; c + 4 <= cv; c += 4) contract_rows<4>(out, k, entries, count, a_of, b_of, ahead, c * W);
  for (; c + 2 <= cv; c += 2) contract_rows<2>(out, k, entries, count, a_of, b_of, ahead, c * W);
  for (; c < cv; ++c) contract_rows<1>(out, k, entries, count, a_of, b_of, ahead, c * W);
}

// Contractions of at most this many (k1, k2) steps per entry are packed first (contract):
// the backward's core gradients summed over slots with one x index each (K1 = m = 2) ran
// 13% faster so (AVX2, the Kaggle DLRM's 4-core tables); at 4 the slot gradients ran slower.
constexpr int64_t kPackMaxSteps = 2;

// out = the contraction over entries[0 : count]; ahead(e) is called for the entry kAhead
// places on (prefetching what a_of / b_of will read).
template <typename T, typename AOf, typename BOf, typename Ahead>
inline void contract(T* out, const Contraction& k, const int64_t* entries, int64_t count, AOf a_of, BOf b_of,
                     Ahead ahead) {
  if (count > 1 && k.K1 * k.K2 <= kPackMaxSteps) {
    // Few multiply-adds per entry and tile: pack the entries' a values and b rows into two
    // panels, so that every tile runs one loop over count * K1 * K2 steps instead of a
    // short loop per entry. Panels: a as (K, rows), b as (K, cols).
    thread_local std::vector<T> apack, bpack;
    const int64_t K = count * k.K1 * k.K2;
    apack.resize(K * k.rows);
    bpack.resize(K * k.cols);
    T* ap = apack.data();
    T* bp = bpack.data();
    for (int64_t q = 0; q < count; ++q) {
      if (q + kAhead < count) ahead(entries[q + kAhead]);
      const T* a = a_of(entries[q]);
      const T* b = b_of(entries[q]);
      for (int64_t k1 = 0; k1 < k.K1; ++k1)
        for (int64_t k2 = 0; k2 < k.K2; ++k2) {
          const T* ak = a + k1 * k.ak1 + k2 * k.ak2;
          const T* bk = b + k1 * k.bk1 + k2 * k.bk2;
          for (int64_t j = 0; j < k.rows; ++j) ap[j] = ak[j * k.aj];
          std::copy(bk, bk + k.cols, bp);
          ap += k.rows;
          bp += k.cols;
        }
    }
    Contraction packed;
    packed.rows = k.rows, packed.cols = k.cols, packed.ostride = k.ostride;
    packed.K2 = K, packed.ak2 = k.rows, packed.aj = 1, packed.bk2 = k.cols;
    const T* a0 = apack.data();
    const T* b0 = bpack.data();
    const int64_t entry = 0;
    contract_columns(out, packed, &entry, 1, [a0](int64_t) { return a0; }, [b0](int64_t) { return b0; }, kNoPrefetch);
    return;
  }
  contract_columns(out, k, entries, count, a_of, b_of, ahead);
}

// The contraction of one entry whose a and b are given directly.
template <typename T>
inline void contract_one(T* out, const Contraction& k, const T* a, const T* b) {
  const int64_t entry = 0;
  contract(out, k, &entry, 1, [a](int64_t) { return a; }, [b](int64_t) { return b; }, kNoPrefetch);
}

// out[:dim] += w * row for a float row of (M_l, M_r) columns, col = x * M_r + a the dot
// product of p's row x and q's row a (rp values each, whole vectors): the dot products as
// vectors, W at a time, each group's lane sums by one transposing sum (hsum_transpose)
// instead of W separate lane sums and scalar stores; a last group of fewer than W columns
// one by one. Returns false (nothing done) for other types. At MLPerf's dim 128 (8 x 16,
// rank 16, AVX2) the per-column sums were ~2.5x the instructions.
template <typename T>
inline bool pool_row_vectors(T*, const T*, const T*, int64_t, int64_t, int64_t, T) { return false; }

template <>
inline bool pool_row_vectors<float>(float* out, const float* p, const float* q, int64_t Mr, int64_t rp, int64_t dim,
                                    float w) {
  constexpr int64_t W = kLanes<float>;
  int64_t g = 0, x = 0, a = 0;  // column g is (x, a): counted, not divided (an idiv per column cost more than its sums)
  for (; g + W <= dim; g += W) {  // columns g .. g + W - 1
    const float* pr[W];
    const float* qr[W];
    for (int c = 0; c < W; ++c) {
      pr[c] = p + x * rp;
      qr[c] = q + a * rp;
      if (++a == Mr) a = 0, ++x;
    }
    vec_t<float> acc[W];
    for (int c = 0; c < W; ++c) acc[c] = vload(pr[c]) * vload(qr[c]);
    for (int64_t k = W; k < rp; k += W)
      for (int c = 0; c < W; ++c) acc[c] += vload(pr[c] + k) * vload(qr[c] + k);
    vstore(out + g, vload(out + g) + w * hsum_transpose(acc));
  }
  for (; g < dim; ++g) {
    out[g] += w * dot(p + x * rp, q + a * rp, rp);
    if (++a == Mr) a = 0, ++x;
  }
  return true;
}

// Shape of one half: 1 or 2 cores.
struct Half {
  int64_t cores = 0;    // 1 or 2
  int64_t n0 = 1, n1 = 1;  // row factors
  int64_t m0 = 1, m1 = 1;  // column factors
  int64_t r_mid = 1;    // rank between the half's two cores (2-core halves)
  int64_t r_out = 1;    // rank leaving the half's last core
  int64_t rows() const { return n0 * n1; }
  int64_t cols() const { return m0 * m1; }
};

Half half_of(const std::vector<at::Tensor>& cores, int64_t begin, int64_t end) {
  Half h;
  h.cores = end - begin;
  const auto& a = cores[begin];
  h.n0 = a.size(2);
  h.m0 = a.size(3);
  if (h.cores == 2) {
    const auto& b = cores[begin + 1];
    h.r_mid = a.size(4);
    h.n1 = b.size(2);
    h.m1 = b.size(3);
    h.r_out = b.size(4);
  } else {
    h.r_out = a.size(4);
  }
  return h;
}

// Slots of keys in ascending key order; returns the distinct keys. Two passes over a
// direct-address array: mark the keys present, number them in key order (so slots that
// share a core slice are neighbours, and the loops over slots read the cores in order).
std::vector<int64_t> assign_slots(const std::vector<int64_t>& keys, int64_t key_space, int32_t* slot) {
  std::vector<int32_t> map(static_cast<size_t>(key_space), -1);
  for (const int64_t key : keys) map[static_cast<size_t>(key)] = 0;
  std::vector<int64_t> distinct;
  distinct.reserve(keys.size() / 2 + 16);
  for (int64_t key = 0; key < key_space; ++key)
    if (map[key] == 0) {
      map[key] = static_cast<int32_t>(distinct.size());
      distinct.push_back(key);
    }
  for (size_t i = 0; i < keys.size(); ++i) slot[i] = map[static_cast<size_t>(keys[i])];
  return distinct;
}

// Ids grouped by slot (a counting sort, O(N + U)): order[start[s] : start[s + 1]] lists
// the ids of slot s, so each slot's gradient is summed by one thread, written once.
struct Groups {
  std::vector<int64_t> start, order;
};

template <typename Index>
Groups group_by(const Index* slot, int64_t n, int64_t num_slots) {
  Groups g;
  g.start.assign(num_slots + 1, 0);
  g.order.resize(n);
  for (int64_t i = 0; i < n; ++i) ++g.start[slot[i] + 1];
  for (int64_t s = 0; s < num_slots; ++s) g.start[s + 1] += g.start[s];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t i = 0; i < n; ++i) g.order[fill[slot[i]]++] = i;
  return g;
}

// The distinct rows among a batch's ids (the same prefix and the same suffix slot): ids
// drawn from a skewed distribution repeat within a batch (the Kaggle bench's Zipf(1.1)
// batch: 5,049 rows for the 10,240 ids of its 4-core group), and the backward's per-id
// products need running only once per row, on the sum of its ids' gradients. Rows are
// numbered in prefix-slot order, each prefix slot's in the order its ids first name them.
struct DistinctRows {
  Groups by_prefix;                     // rows of each prefix slot: start[p] .. start[p + 1] (order: 0, 1, ...)
  Groups by_suffix;                     // rows of each suffix slot
  std::vector<int32_t> pslot, sslot;    // each row's prefix / suffix slot
  std::vector<int64_t> of_id;           // each id's row
};

DistinctRows distinct_rows(const Groups& ids_by_prefix, const int32_t* sslot, int64_t num_prefix,
                           int64_t num_suffix) {
  DistinctRows d;
  const int64_t n = static_cast<int64_t>(ids_by_prefix.order.size());
  d.of_id.resize(n);
  d.by_prefix.start.resize(num_prefix + 1);
  std::vector<int64_t> seen_in(num_suffix, -1), row_of(num_suffix);  // per suffix slot: the prefix slot it last met
  int64_t rows = 0;
  for (int64_t p = 0; p < num_prefix; ++p) {
    d.by_prefix.start[p] = rows;
    for (int64_t k = ids_by_prefix.start[p]; k < ids_by_prefix.start[p + 1]; ++k) {
      const int64_t i = ids_by_prefix.order[k], s = sslot[i];
      if (seen_in[s] != p) {
        seen_in[s] = p;
        row_of[s] = rows++;
        d.pslot.push_back(static_cast<int32_t>(p));
        d.sslot.push_back(static_cast<int32_t>(s));
      }
      d.of_id[i] = row_of[s];
    }
  }
  d.by_prefix.start[num_prefix] = rows;
  d.by_prefix.order.resize(rows);
  std::iota(d.by_prefix.order.begin(), d.by_prefix.order.end(), int64_t(0));
  d.by_suffix = group_by(d.sslot.data(), rows, num_suffix);
  return d;
}

// The slots of a 2-core half grouped by the index of each of its cores: by (t, i0) and
// by (t, i1), from the slots' keys t * N + i0 * n1 + i1; key0 / key1 are each slot's
// (t, i0) / (t, i1).
struct CoreGroups {
  std::vector<int64_t> key0, key1;
  Groups by0, by1;
};

CoreGroups group_by_cores(const int64_t* keys, int64_t num_slots, int64_t n0, int64_t n1, int64_t tables) {
  CoreGroups cg;
  cg.key0.resize(num_slots);
  cg.key1.resize(num_slots);
  for (int64_t s = 0; s < num_slots; ++s) {
    cg.key0[s] = keys[s] / n1;
    cg.key1[s] = keys[s] / (n0 * n1) * n1 + keys[s] % n1;
  }
  cg.by0 = group_by(cg.key0.data(), num_slots, tables * n0);
  cg.by1 = group_by(cg.key1.data(), num_slots, tables * n1);
  return cg;
}

// Run fn(begin, end) over the groups [0, G) of `groups`, split into one contiguous range
// per thread of torch's intra-op pool with about equal numbers of entries (each group
// stays whole, so each group's sum is one thread's, in a fixed order: results do not
// depend on the thread count).
template <typename F>
void for_each_group_range(const Groups& groups, F fn) {
  const int64_t G = static_cast<int64_t>(groups.start.size()) - 1;
  const int64_t total = groups.start[G];
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), G));
  std::vector<int64_t> cut(nt + 1, G);
  cut[0] = 0;
  for (int64_t k = 1; k < nt; ++k)  // first group whose entries start at or after k / nt of all
    cut[k] = std::lower_bound(groups.start.begin(), groups.start.end() - 1, total * k / nt) - groups.start.begin();
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t tid = b; tid < e; ++tid)
      if (cut[tid] < cut[tid + 1]) fn(cut[tid], cut[tid + 1]);
  });
}

// Where bag `bag`'s row starts in the output: (bags, dim) rows, or with batch > 0 the
// bags f * batch + b (stream f, sample b) as (batch, streams * dim), stream f's columns
// at f * dim: the layout a KeyedTensor's values take, so no transposing copy follows.
inline int64_t bag_offset(int64_t bag, int64_t dim, int64_t batch, int64_t streams) {
  return batch > 0 ? ((bag % batch) * streams + bag / batch) * dim : bag * dim;
}

// Everything both passes derive from the cores: the halves' shapes, the padded rank and
// the cores in the layouts the loops read (rank vectors last and padded).
struct Train {
  Half L, R;
  int64_t d = 0, split = 0, T = 0, r = 0, rp = 0, Ml = 0, Mr = 0, Nl = 0, Nr = 0;
  at::Tensor left1;   // left 2-core halves: core 1 as (T, r_mid, n1, m1, rp)
  at::Tensor right0;  // right 2-core halves: core 0 as (T, n0, m0, r_mid, rp)
};

// A core (T, r, ...) with its first rank moved last and zero-padded to whole vectors:
// (T, r, n, m, r') -> (T, n, m, r', rp), the same as pad_last(core.permute({0, 2, 3, 4, 1})).
// Each table's (r, X) matrix is transposed in 8 x 8 blocks of float32 held in registers
// (8 row loads, 24 shuffles, 8 row stores), the blocks of one run of 16 columns in turn so
// that the source lines read stay in L1: 1.5x faster than a copy of one value per load
// and store (a right core of the Kaggle 4-core group alone, AVX2 EPYC). The loads and
// stores are unaligned vectors: through memcpy, GCC moved each row in 16-byte halves via
// the stack. float64 and the blocks' edges are copied value by value.
using Lanes8 = float __attribute__((vector_size(32)));
using Lanes8u = float __attribute__((vector_size(32), aligned(4)));  // loads and stores at any float
using Index8 = int32_t __attribute__((vector_size(32)));

#if defined(__clang__)
#define COMERA_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define COMERA_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, Index8{__VA_ARGS__})
#endif

// out[j * out_stride + i] = in[i * in_stride + j] for i, j < 8.
template <typename T>
inline void transpose_8x8(const T* in, int64_t in_stride, T* out, int64_t out_stride) {
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) out[j * out_stride + i] = in[i * in_stride + j];
}

template <>
inline void transpose_8x8<float>(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
  Lanes8 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = *reinterpret_cast<const Lanes8u*>(in + i * in_stride);
  for (int i = 0; i < 4; ++i) {  // pairs of rows interleaved: t[2i] lanes 0, 1, 4, 5; t[2i + 1] lanes 2, 3, 6, 7
    t[2 * i] = COMERA_SHUFFLE8(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = COMERA_SHUFFLE8(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int h = 0; h < 2; ++h)  // rows 4h .. 4h + 3: four columns in each 128-bit half
    for (int q = 0; q < 2; ++q) {
      u[4 * h + 2 * q] = COMERA_SHUFFLE8(t[4 * h + q], t[4 * h + q + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * h + 2 * q + 1] = COMERA_SHUFFLE8(t[4 * h + q], t[4 * h + q + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int c = 0; c < 4; ++c) {  // column c from the low halves, column c + 4 from the high
    const Lanes8 lo = COMERA_SHUFFLE8(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    const Lanes8 hi = COMERA_SHUFFLE8(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    *reinterpret_cast<Lanes8u*>(out + c * out_stride) = lo;
    *reinterpret_cast<Lanes8u*>(out + (c + 4) * out_stride) = hi;
  }
}
#undef COMERA_SHUFFLE8

at::Tensor rank_last(const at::Tensor& core, int64_t lanes) {
  const auto c = core.contiguous();
  const int64_t T = c.size(0), r = c.size(1), X = c.numel() / std::max<int64_t>(1, T * r), rp = padded(r, lanes);
  auto out = rp == r ? at::empty({T, X, rp}, c.options()) : at::zeros({T, X, rp}, c.options());
  constexpr int64_t kCols = 16;
  const int64_t blocks = (X + kCols - 1) / kCols;
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "rank_last", [&] {
    const scalar_t* src = c.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, T * blocks, 64, [&](int64_t b, int64_t e) {
      for (int64_t tb = b; tb < e; ++tb) {
        const int64_t t = tb / blocks, x0 = tb % blocks * kCols, x1 = std::min(X, x0 + kCols);
        const scalar_t* in = src + t * r * X;
        scalar_t* o = dst + t * X * rp;
        const int64_t x8 = x0 + (x1 - x0) / 8 * 8, k8 = r / 8 * 8;  // the 8 x 8 blocks' end
        for (int64_t x = x0; x < x8; x += 8)
          for (int64_t k = 0; k < k8; k += 8) transpose_8x8(in + k * X + x, X, o + x * rp + k, rp);
        for (int64_t x = x0; x < x1; ++x)  // the edges: ranks past the blocks, columns past them
          for (int64_t k = x < x8 ? k8 : 0; k < r; ++k) o[x * rp + k] = in[k * X + x];
      }
    });
  });
  std::vector<int64_t> shape(c.sizes().begin() + 2, c.sizes().end());
  shape.insert(shape.begin(), T);
  shape.push_back(rp);
  return out.view(shape);
}

// `layouts`: also make the forward's permuted, padded copies (left1, right0), or take them
// from `given` ({left1, right0} made earlier by ttm_forward_layouts from the same cores,
// kept by the caller while the cores do not change); the backward needs only the shapes.
Train describe(std::vector<at::Tensor>& cores, const char* who, bool layouts,
               const std::vector<at::Tensor>& given = {}) {
  Train tr;
  tr.d = static_cast<int64_t>(cores.size());
  TORCH_CHECK(tr.d >= 2 && tr.d <= 4, who, ": need 2 to 4 cores, got ", tr.d);
  for (auto& c : cores) {
    TORCH_CHECK(c.dim() == 5, who, ": cores must be (T, r, n, m, r'), got ", c.sizes());
    c = c.contiguous();
  }
  tr.split = (tr.d + 1) / 2;
  tr.L = half_of(cores, 0, tr.split);
  tr.R = half_of(cores, tr.split, tr.d);
  tr.T = cores[0].size(0);
  tr.r = tr.L.r_out;
  const int64_t lanes = cores[0].scalar_type() == at::kDouble ? kLanes<double> : kLanes<float>;
  tr.rp = padded(tr.r, lanes);
  tr.Ml = tr.L.cols();
  tr.Mr = tr.R.cols();
  tr.Nl = tr.L.rows();
  tr.Nr = tr.R.rows();
  if (!layouts) return tr;
  TORCH_CHECK(given.empty() || given.size() == 2, who, ": layouts must be {} or {left1, right0}, got ", given.size());
  if (tr.L.cores == 2) tr.left1 = given.empty() ? pad_last(cores[1], lanes) : given[0];
  if (tr.R.cores == 2) tr.right0 = given.empty() ? rank_last(cores[tr.split], lanes) : given[1];
  if (!given.empty()) {  // a kept layout must still match these cores' shapes
    if (tr.L.cores == 2)
      TORCH_CHECK(tr.left1.defined() && tr.left1.is_contiguous() && tr.left1.dim() == 5 && tr.left1.size(0) == tr.T &&
                      tr.left1.size(1) == tr.L.r_mid && tr.left1.size(2) == tr.L.n1 && tr.left1.size(3) == tr.L.m1 &&
                      tr.left1.size(4) == tr.rp,
                  who, ": the kept left layout does not match the cores");
    if (tr.R.cores == 2)
      TORCH_CHECK(tr.right0.defined() && tr.right0.is_contiguous() && tr.right0.dim() == 5 &&
                      tr.right0.size(0) == tr.T && tr.right0.size(1) == tr.R.n0 && tr.right0.size(2) == tr.R.m0 &&
                      tr.right0.size(3) == tr.R.r_mid && tr.right0.size(4) == tr.rp,
                  who, ": the kept right layout does not match the cores");
  }
  return tr;
}

// The forward's contraction multiply-adds for Ul distinct prefixes and Ur distinct suffixes:
// a 2-core half's slot is an (m0, r_mid) x (r_mid, m1 r) product; a 1-core half's is a copy.
// The backward does two products of that size per slot (each core's gradient).
int64_t contraction_madds(const Train& tr, int64_t Ul, int64_t Ur) {
  int64_t madds = 0;
  if (tr.L.cores == 2) madds += Ul * tr.L.m0 * tr.L.r_mid * tr.L.m1 * tr.r;
  if (tr.R.cores == 2) madds += Ur * tr.R.m0 * tr.R.r_mid * tr.R.m1 * tr.r;
  return madds;
}

// The forward's derived layouts of these cores, {left1, right0} (an empty tensor where a
// half has one core), for a caller that keeps them between lookups with unchanged cores.
std::vector<at::Tensor> ttm_forward_layouts(std::vector<at::Tensor> cores) {
  const Train tr = describe(cores, "ttm_forward_layouts", true);
  const auto empty = at::empty({0}, cores[0].options());
  return {tr.left1.defined() ? tr.left1 : empty, tr.right0.defined() ? tr.right0 : empty};
}

}  // namespace

namespace {

// Every id's prefix key t * N_l + id / N_r and suffix key t * N_r + id % N_r (Key: int64_t,
// or int32_t where the keys are the rows of whole halves); an id outside the TT row shape
// or a table index outside the stack is an error naming it.
template <typename Key>
void keys_of_ids(const int64_t* id, const int64_t* trp, int64_t N, int64_t T, int64_t Nl, int64_t Nr, Key* pkeys,
                 Key* skeys) {
  const int64_t num_rows = Nl * Nr;
  std::atomic<bool> bad{false};
  at::parallel_for(0, N, 2048, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = trp ? trp[i] : 0;
      if (id[i] < 0 || id[i] >= num_rows || t < 0 || t >= T) bad = true;
      pkeys[i] = static_cast<Key>(t * Nl + id[i] / Nr);
      skeys[i] = static_cast<Key>(t * Nr + id[i] % Nr);
    }
  });
  if (bad) {  // name the first bad id or table index
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = trp ? trp[i] : 0;
      TORCH_CHECK(id[i] >= 0 && id[i] < num_rows, "TTM lookup: id ", id[i], " out of range [0, ", num_rows,
                  ") of the TT row shape");
      TORCH_CHECK(t >= 0 && t < T, "TTM lookup: table index ", t, " out of range [0, ", T, ")");
    }
  }
}

// P (M_l, rp) of each prefix key keys[0 .. U): row s of P for keys[s].
template <typename T_>
void contract_prefixes(const Train& tr, const std::vector<at::Tensor>& cores, const int64_t* keys, int64_t U, T_* P) {
  const Half& L = tr.L;
  const int64_t Nl = tr.Nl, Ml = tr.Ml, r = tr.r, rp = tr.rp;
  const T_* g0 = cores[0].data_ptr<T_>();
  at::parallel_for(0, U, 64, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      const int64_t t = keys[s] / Nl, pi = keys[s] % Nl;
      T_* p = P + s * Ml * rp;
      if (L.cores == 1) {  // P[x, :r] = G0[t, 0, pi, x, :]
        for (int64_t x = 0; x < L.m0; ++x) {
          const T_* src = g0 + ((t * L.n0 + pi) * L.m0 + x) * r;
          std::copy(src, src + r, p + x * rp);
        }
      } else {  // P[x0, (x1, :)] = sum_j G0[t, 0, i0, x0, j] G1[t, j, i1, x1, :]
        const T_* g1 = tr.left1.data_ptr<T_>();
        const int64_t i0 = pi / L.n1, i1 = pi % L.n1, rm = L.r_mid, blk = L.m1 * rp;
        const T_* rows = g1 + (t * rm * L.n1 + i1) * blk;  // row j at + j * n1 * blk
        Contraction k;
        k.rows = L.m0, k.cols = blk, k.ostride = blk, k.K1 = rm, k.ak1 = 1, k.aj = rm, k.bk1 = L.n1 * blk;
        contract_one(p, k, g0 + (t * L.n0 + i0) * L.m0 * rm, rows);
      }
    }
  });
}

// S (M_r, rp) of each suffix key keys[0 .. U), row (x0, x1) of the right half's columns.
template <typename T_>
void contract_suffixes(const Train& tr, const std::vector<at::Tensor>& cores, const int64_t* keys, int64_t U,
                       T_* S) {
  const Half& R = tr.R;
  const int64_t Nr = tr.Nr, Mr = tr.Mr, r = tr.r, rp = tr.rp;
  at::parallel_for(0, U, 64, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      const int64_t t = keys[s] / Nr, si = keys[s] % Nr;
      T_* q = S + s * Mr * rp;
      if (R.cores == 1) {  // S[a, k] = G[t, k, si, a, 0]
        const T_* g = cores[tr.split].data_ptr<T_>();
        for (int64_t k = 0; k < r; ++k)
          for (int64_t a = 0; a < R.m0; ++a) q[a * rp + k] = g[((t * r + k) * R.n0 + si) * R.m0 + a];
      } else {  // S[(x0, x1), :] = sum_j G1[t, j, i1, x1, 0] G0[t, :, i0, x0, j]
        const T_* a0 = tr.right0.data_ptr<T_>();
        const T_* c1 = cores[tr.split + 1].data_ptr<T_>();
        const int64_t i0 = si / R.n1, i1 = si % R.n1, rm = R.r_mid;
        const T_* coef = c1 + (t * rm * R.n1 + i1) * R.m1;  // (j, x1) at + j * n1 * m1 + x1
        Contraction k;
        k.rows = R.m1, k.cols = rp, k.ostride = rp, k.K1 = rm, k.ak1 = R.n1 * R.m1, k.aj = 1, k.bk1 = rp;
        for (int64_t x0 = 0; x0 < R.m0; ++x0)  // rows j of G0 at + j * rp
          contract_one(q + x0 * R.m1 * rp, k, coef, a0 + ((t * R.n0 + i0) * R.m0 + x0) * rm * rp);
      }
    }
  });
}

// Shapes of the pooling pass: P rows (M_l, rp), S rows (M_r, rp), the output's layout.
struct PoolShape {
  int64_t Ml = 0, Mr = 0, rp = 0, dim = 0, batch = 0, streams = 1;
  // where bag (stream f, sample b) goes, with batch > 0: row b at row_stride values apart,
  // columns from stream_cols[f]; unset: bag_offset's layout (batch, streams * dim)
  int64_t row_stride = 0;
  const int64_t* stream_cols = nullptr;

  int64_t offset(int64_t bag) const {
    if (stream_cols == nullptr) return bag_offset(bag, dim, batch, streams);
    return (bag % batch) * row_stride + stream_cols[bag / batch];
  }
};

// out[bag] = sum over the bag's ids i of w_i P[ps[i]] S[ss[i]]^T (its first dim columns);
// threads own bags, so every output value has one writer.
template <typename T_>
void pool_bags(const PoolShape& sh, const T_* P, const T_* S, const int32_t* ps, const int32_t* ss,
               const int64_t* off, int64_t B, const T_* w, T_* o) {
  const int64_t Ml = sh.Ml, Mr = sh.Mr, rp = sh.rp, dim = sh.dim;
  at::parallel_for(0, B, 128, [&](int64_t b, int64_t e) {
    const int64_t last = off[e];
    for (int64_t bag = b; bag < e; ++bag) {
      T_* ob = o + sh.offset(bag);
      std::fill(ob, ob + dim, T_(0));
      for (int64_t i = off[bag]; i < off[bag + 1]; ++i) {
        if (i + kAhead < last) {
          prefetch_range(P + ps[i + kAhead] * Ml * rp, Ml * rp * sizeof(T_));
          prefetch_range(S + ss[i + kAhead] * Mr * rp, Mr * rp * sizeof(T_));
        }
        const T_ wi = w ? w[i] : T_(1);
        const T_* p = P + ps[i] * Ml * rp;
        const T_* q = S + ss[i] * Mr * rp;
        if (pool_row_vectors(ob, p, q, Mr, rp, dim, wi)) continue;
        for (int64_t x = 0; x < Ml; ++x)
          for (int64_t a = 0; a < Mr; ++a) {
            const int64_t col = x * Mr + a;
            if (col < dim) ob[col] += wi * dot(p + x * rp, q + a * rp, rp);
          }
      }
    }
  });
}

// The checks and conversions both forwards share. Returns the bags' count.
struct BagInputs {
  at::Tensor ids, offsets, trains, weights;
  bool has_trains = false, weighted = false;
  int64_t N = 0, B = 0, streams = 1;
};

BagInputs bag_inputs(const char* who, at::Tensor ids, at::Tensor trains, at::Tensor offsets,
                     at::Tensor weights, at::ScalarType dtype, int64_t batch) {
  BagInputs in;
  in.ids = ids.to(at::kLong).contiguous();
  in.offsets = offsets.to(at::kLong).contiguous();
  in.has_trains = trains.numel() > 0;
  in.weighted = weights.numel() > 0;
  if (in.has_trains) in.trains = trains.to(at::kLong).contiguous();
  if (in.weighted) in.weights = weights.to(dtype).contiguous();
  in.N = in.ids.numel();
  in.B = in.offsets.numel() - 1;
  TORCH_CHECK(in.B >= 0, who, ": offsets must hold at least one value");
  TORCH_CHECK(batch >= 0 && (batch == 0 || in.B % batch == 0), who, ": ", in.B, " bags are not whole streams of batch ",
              batch);
  in.streams = batch > 0 ? in.B / batch : 1;
  TORCH_CHECK(!in.has_trains || in.trains.numel() == in.N, who, ": ", in.trains.numel(), " table indices for ", in.N,
              " ids");
  TORCH_CHECK(!in.weighted || in.weights.numel() == in.N, who, ": ", in.weights.numel(), " weights for ", in.N, " ids");
  return in;
}

// Checks an output the caller lays the bags out in: bag (stream f, sample b) at
// out + b * row_stride + stream_cols[f], inside a contiguous `out` of dtype `dtype`.
void check_output_layout(const at::Tensor& out, at::ScalarType dtype, const BagInputs& in, int64_t dim,
                         int64_t batch, int64_t row_stride, const std::vector<int64_t>& stream_cols, const char* who) {
  TORCH_CHECK(batch > 0 && static_cast<int64_t>(stream_cols.size()) == in.streams && out.is_contiguous() &&
                  out.scalar_type() == dtype,
              who, ": ", stream_cols.size(), " column offsets for ", in.streams,
              " streams, or an output not contiguous of the cores' dtype");
  for (const int64_t col : stream_cols)
    TORCH_CHECK(col >= 0 && col + dim <= row_stride && (batch - 1) * row_stride + col + dim <= out.numel(), who,
                ": a stream's columns [", col, ", ", col + dim, ") outside rows of ", row_stride,
                " values, or the output");
}

at::Tensor bag_output(const BagInputs& in, int64_t dim, int64_t batch, const at::TensorOptions& fopt) {
  // each bag's dim values are zeroed by the thread that pools it (the bags tile the output)
  return batch > 0 ? at::empty({batch, in.streams * dim}, fopt) : at::empty({in.B, dim}, fopt);
}

// The middle bond's controller (T, r), when the caller leaves it out of the cores: as (T, rp),
// zero-padded, or an undefined tensor when `middle` is empty. Row t of P then stands for
// P(t, .) diag(c_t): the forward scales a copy of the prefix slots by it (scale_slots), the
// backward works out its gradient from the slots' own (middle_gradient), so the caller
// folds no controller into a core of the size of the two cores it sits between.
at::Tensor middle_of(const at::Tensor& middle, const Train& tr, const at::Tensor& like, const char* who) {
  if (middle.numel() == 0) return at::Tensor();
  TORCH_CHECK(middle.dim() == 2 && middle.size(0) == tr.T && middle.size(1) == tr.r, who,
              ": the middle controller must be (T, r) = (", tr.T, ", ", tr.r, "), got ", middle.sizes());
  TORCH_CHECK(middle.scalar_type() == like.scalar_type(), who, ": the middle controller must be ", like.scalar_type(),
              ", got ", middle.scalar_type());
  return tr.rp == tr.r ? middle.contiguous() : pad_last(middle, tr.rp);
}

// out[s] = P[s] diag(c_t) for the slots s < U of keys t * N + i: each row of M rank vectors
// scaled by its table's controller (rp values a row).
template <typename T_>
void scale_slots(const T_* P, const int64_t* keys, int64_t U, int64_t N, int64_t M, int64_t rp, const T_* c, T_* out) {
  at::parallel_for(0, U, 256, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      const T_* cs = c + keys[s] / N * rp;
      for (int64_t x = 0; x < M; ++x) {
        const T_* in = P + (s * M + x) * rp;
        T_* o = out + (s * M + x) * rp;
        for (int64_t k = 0; k < rp; ++k) o[k] = in[k] * cs[k];
      }
    }
  });
}

// Slots per partial of the middle controller's gradient: fixed, so the sums' order (and
// the result) does not depend on the number of threads.
constexpr int64_t kSlotsPerPartial = 256;

// With dP[s] = sum over slot s's rows of G S (the gradient of the scaled prefix P diag(c)):
// grad_c[t] = sum over table t's slots of sum_x P[s][x, :] * dP[s][x, :], then dP[s] scaled by
// c_t in place (the gradient of the unscaled P). Slots (T, rp) partials of kSlotsPerPartial
// slots each, summed in slot order into the (T, r) gradient: a tensor of its own, not a
// narrowed (T, rp) one, whose strides (T = 1: stride rp on a dim of size 1) would differ from
// the parameter's and make DDP warn of its bucket views.
template <typename T_>
at::Tensor middle_gradient(T_* dP, const T_* P, const int64_t* keys, int64_t U, int64_t N, int64_t M, int64_t T,
                           int64_t r, int64_t rp, const T_* c, const at::TensorOptions& fopt) {
  const int64_t parts = std::max<int64_t>(1, (U + kSlotsPerPartial - 1) / kSlotsPerPartial);
  std::vector<T_> partial(parts * T * rp, T_(0));
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t part = b; part < e; ++part) {
      T_* acc = partial.data() + part * T * rp;
      for (int64_t s = part * kSlotsPerPartial; s < std::min(U, (part + 1) * kSlotsPerPartial); ++s) {
        const int64_t t = keys[s] / N;
        const T_* cs = c + t * rp;
        T_* gt = acc + t * rp;
        for (int64_t x = 0; x < M; ++x) {
          T_* d = dP + (s * M + x) * rp;
          const T_* p = P + (s * M + x) * rp;
          for (int64_t k = 0; k < rp; ++k) {
            gt[k] += p[k] * d[k];
            d[k] *= cs[k];
          }
        }
      }
    }
  });
  auto grad = at::zeros({T, r}, fopt);
  T_* g = grad.data_ptr<T_>();
  for (int64_t part = 0; part < parts; ++part)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < r; ++k) g[t * r + k] += partial[(part * T + t) * rp + k];
  return grad;
}

}  // namespace

// Forward. Returns {out (B, D), prefix slot (N,), suffix slot (N,), distinct prefix keys,
// distinct suffix keys, P table (U_l, M_l, rp), S table (U_r, M_r, rp)}. With `into`
// not empty (batch > 0), the bags go there instead, as ttm_bag_forward_halves_into lays
// them (row_stride, stream_cols), and out is `into`.
std::vector<at::Tensor> ttm_bag_forward(
    std::vector<at::Tensor> cores, at::Tensor ids, at::Tensor trains, at::Tensor offsets,
    at::Tensor weights, int64_t dim, int64_t batch, std::vector<at::Tensor> layouts, at::Tensor middle,
    at::Tensor into, int64_t row_stride, std::vector<int64_t> stream_cols) {
  ProfiledPhases phase;
  phase.start("ttm_lookup: core layouts");
  const Train tr = describe(cores, "ttm_bag_forward", true, layouts);
  const at::Tensor mid = middle_of(middle, tr, cores[0], "ttm_bag_forward");
  const int64_t T = tr.T, r = tr.r, rp = tr.rp, Ml = tr.Ml, Mr = tr.Mr, Nl = tr.Nl, Nr = tr.Nr;
  TORCH_CHECK(dim >= 1 && dim <= Ml * Mr, "ttm_bag_forward: embedding_dim ", dim, " outside [1, ", Ml * Mr, "]");
  const BagInputs in = bag_inputs("ttm_bag_forward", ids, trains, offsets, weights, cores[0].scalar_type(), batch);
  const int64_t N = in.N;

  // 1. keys -> slots
  phase.start("ttm_lookup: keys and slots");
  std::vector<int64_t> pkeys(N), skeys(N);
  keys_of_ids(in.ids.data_ptr<int64_t>(), in.has_trains ? in.trains.data_ptr<int64_t>() : nullptr, N, T, Nl, Nr,
              pkeys.data(), skeys.data());
  auto iopt = at::TensorOptions().dtype(at::kInt);
  auto pslot = at::empty({N}, iopt), sslot = at::empty({N}, iopt);
  std::vector<int64_t> pdistinct, sdistinct;
  at::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) {  // prefixes and suffixes side by side
    for (int64_t half = b; half < e; ++half) {
      if (half == 0) pdistinct = assign_slots(pkeys, T * Nl, pslot.data_ptr<int32_t>());
      else sdistinct = assign_slots(skeys, T * Nr, sslot.data_ptr<int32_t>());
    }
  });
  const int64_t Ul = static_cast<int64_t>(pdistinct.size()), Ur = static_cast<int64_t>(sdistinct.size());
  g_contraction_madds += contraction_madds(tr, Ul, Ur);
  auto lopt = at::TensorOptions().dtype(at::kLong);
  auto pkey_t = at::from_blob(pdistinct.data(), {Ul}, lopt).clone();
  auto skey_t = at::from_blob(sdistinct.data(), {Ur}, lopt).clone();

  auto fopt = cores[0].options();
  // every value of P and S is written below; only rank padding (rp > r) needs zeros
  auto table = [&](int64_t U, int64_t M) { return rp == r ? at::empty({U, M, rp}, fopt) : at::zeros({U, M, rp}, fopt); };
  auto ptab = table(Ul, Ml), stab = table(Ur, Mr);
  PoolShape sh{Ml, Mr, rp, dim, batch, in.streams};
  at::Tensor out;
  if (into.defined() && into.numel() > 0) {
    check_output_layout(into, cores[0].scalar_type(), in, dim, batch, row_stride, stream_cols, "ttm_bag_forward");
    out = into;
    sh.row_stride = row_stride;
    sh.stream_cols = stream_cols.data();
  } else {
    out = bag_output(in, dim, batch, fopt);
  }

  AT_DISPATCH_FLOATING_TYPES(cores[0].scalar_type(), "ttm_bag_forward", [&] {
    using T_ = scalar_t;
    T_* P = ptab.data_ptr<T_>();
    T_* S = stab.data_ptr<T_>();
    phase.start("ttm_lookup: contractions");
    contract_prefixes(tr, cores, pdistinct.data(), Ul, P);  // 2. each distinct prefix and suffix once
    contract_suffixes(tr, cores, sdistinct.data(), Ur, S);
    const T_* pooled = P;  // the prefixes the bags read: with a middle controller, P diag(c_t)
    at::Tensor scaled;
    if (mid.defined()) {
      phase.start("ttm_lookup: controller");
      scaled = at::empty_like(ptab);
      scale_slots(P, pdistinct.data(), Ul, Nl, Ml, rp, mid.data_ptr<T_>(), scaled.data_ptr<T_>());
      pooled = scaled.data_ptr<T_>();
    }
    phase.start("ttm_lookup: pooling");
    pool_bags(sh, pooled, S, pslot.data_ptr<int32_t>(), sslot.data_ptr<int32_t>(), in.offsets.data_ptr<int64_t>(),
              in.B, in.weighted ? in.weights.data_ptr<T_>() : nullptr, out.data_ptr<T_>());  // 3.
  });
  return {out, pslot, sslot, pkey_t, skey_t, ptab, stab};
}

// Both halves contracted over all their row indices: {P (T * N_l, M_l, rp), S (T * N_r,
// M_r, rp)}, row t * N + i for index i of table t. For scoring: a lookup over these
// (ttm_bag_forward_halves) reads two rows per id and contracts nothing else.
std::vector<at::Tensor> ttm_halves(std::vector<at::Tensor> cores) {
  const Train tr = describe(cores, "ttm_halves", true);  // its own core layouts, dropped after
  const int64_t Ul = tr.T * tr.Nl, Ur = tr.T * tr.Nr;
  TORCH_CHECK(std::max(Ul, Ur) < (int64_t(1) << 31), "ttm_halves: ", std::max(Ul, Ur), " rows of a half exceed int32");
  auto fopt = cores[0].options();
  auto table = [&](int64_t U, int64_t M) {
    return tr.rp == tr.r ? at::empty({U, M, tr.rp}, fopt) : at::zeros({U, M, tr.rp}, fopt);
  };
  auto ptab = table(Ul, tr.Ml), stab = table(Ur, tr.Mr);
  std::vector<int64_t> pkeys(Ul), skeys(Ur);
  std::iota(pkeys.begin(), pkeys.end(), int64_t(0));
  std::iota(skeys.begin(), skeys.end(), int64_t(0));
  AT_DISPATCH_FLOATING_TYPES(cores[0].scalar_type(), "ttm_halves", [&] {
    contract_prefixes(tr, cores, pkeys.data(), Ul, ptab.data_ptr<scalar_t>());
    contract_suffixes(tr, cores, skeys.data(), Ur, stab.data_ptr<scalar_t>());
  });
  return {ptab, stab};
}

namespace {

// The forward over whole halves (ttm_halves of T tables whose suffix index has N_r values)
// of the bags in, into out: row_stride / stream_cols as PoolShape takes them (null:
// bag_offset's layout); nothing kept for a backward.
void pool_over_halves(const at::Tensor& ptab, const at::Tensor& stab, const BagInputs& in, int64_t dim,
                      int64_t batch, int64_t T, int64_t Nr, int64_t row_stride, const int64_t* stream_cols,
                      at::Tensor& out) {
  TORCH_CHECK(ptab.dim() == 3 && stab.dim() == 3 && ptab.size(2) == stab.size(2) && ptab.is_contiguous() &&
                  stab.is_contiguous() && ptab.scalar_type() == stab.scalar_type(),
              "ttm_bag_forward_halves: halves must be contiguous (U, M, rp) of one rank and dtype, got ", ptab.sizes(),
              " and ", stab.sizes());
  TORCH_CHECK(T >= 1 && Nr >= 1 && ptab.size(0) % T == 0 && stab.size(0) == T * Nr, "ttm_bag_forward_halves: halves of ",
              ptab.size(0), " and ", stab.size(0), " rows are not ", T, " tables with ", Nr, " suffixes");
  const int64_t Nl = ptab.size(0) / T, Ml = ptab.size(1), Mr = stab.size(1), rp = ptab.size(2);
  TORCH_CHECK(dim >= 1 && dim <= Ml * Mr, "ttm_bag_forward_halves: embedding_dim ", dim, " outside [1, ", Ml * Mr, "]");
  auto iopt = at::TensorOptions().dtype(at::kInt);
  auto pkeys = at::empty({in.N}, iopt), skeys = at::empty({in.N}, iopt);
  keys_of_ids(in.ids.data_ptr<int64_t>(), in.has_trains ? in.trains.data_ptr<int64_t>() : nullptr, in.N, T, Nl, Nr,
              pkeys.data_ptr<int32_t>(), skeys.data_ptr<int32_t>());
  PoolShape sh{Ml, Mr, rp, dim, batch, in.streams};
  sh.row_stride = row_stride;
  sh.stream_cols = stream_cols;
  AT_DISPATCH_FLOATING_TYPES(ptab.scalar_type(), "ttm_bag_forward_halves", [&] {
    using T_ = scalar_t;
    pool_bags(sh, ptab.data_ptr<T_>(), stab.data_ptr<T_>(), pkeys.data_ptr<int32_t>(), skeys.data_ptr<int32_t>(),
              in.offsets.data_ptr<int64_t>(), in.B, in.weighted ? in.weights.data_ptr<T_>() : nullptr,
              out.data_ptr<T_>());
  });
}

}  // namespace

// The forward over whole halves, out (B, D) as ttm_bag_forward gives it.
at::Tensor ttm_bag_forward_halves(at::Tensor ptab, at::Tensor stab, at::Tensor ids, at::Tensor trains,
                                  at::Tensor offsets, at::Tensor weights, int64_t dim, int64_t batch,
                                  int64_t T, int64_t Nr) {
  const BagInputs in = bag_inputs("ttm_bag_forward_halves", ids, trains, offsets, weights, ptab.scalar_type(), batch);
  auto out = bag_output(in, dim, batch, ptab.options());
  pool_over_halves(ptab, stab, in, dim, batch, T, Nr, 0, nullptr, out);
  return out;
}

// The same forward into out: bag (stream f, sample b) at out + b * row_stride +
// stream_cols[f] (batch > 0, a column offset per stream), every bag written. A caller that
// lays several lookups' bags side by side (the scoring operator's (B, F, D)) has them
// written there, with no copy after.
void ttm_bag_forward_halves_into(at::Tensor ptab, at::Tensor stab, at::Tensor ids, at::Tensor trains,
                                 at::Tensor offsets, at::Tensor weights, int64_t dim, int64_t batch, int64_t T,
                                 int64_t Nr, at::Tensor out, int64_t row_stride,
                                 const std::vector<int64_t>& stream_cols) {
  const BagInputs in = bag_inputs("ttm_bag_forward_halves", ids, trains, offsets, weights, ptab.scalar_type(), batch);
  check_output_layout(out, ptab.scalar_type(), in, dim, batch, row_stride, stream_cols, "ttm_bag_forward_halves");
  pool_over_halves(ptab, stab, in, dim, batch, T, Nr, row_stride, stream_cols.data(), out);
}

// Backward. Returns the gradients of the d cores, then of the weights (undefined unless
// weights_need_grad).
std::vector<at::Tensor> ttm_bag_backward(
    at::Tensor grad_out, std::vector<at::Tensor> cores, at::Tensor offsets, at::Tensor weights,
    at::Tensor pslot, at::Tensor sslot, at::Tensor pkeys, at::Tensor skeys, at::Tensor ptab,
    at::Tensor stab, bool weights_need_grad, int64_t dim, int64_t batch, at::Tensor middle, int64_t row_stride,
    std::vector<int64_t> stream_cols) {
  ProfiledPhases phase;
  phase.start("ttm_lookup backward: grouping");
  const Train tr = describe(cores, "ttm_bag_backward", false);
  const at::Tensor mid = middle_of(middle, tr, cores[0], "ttm_bag_backward");
  at::Tensor dmiddle;  // (T, r) with a middle controller
  const Half &L = tr.L, &R = tr.R;
  const int64_t r = tr.r, rp = tr.rp, Ml = tr.Ml, Mr = tr.Mr, Nl = tr.Nl, Nr = tr.Nr;
  grad_out = grad_out.to(cores[0].scalar_type()).contiguous();
  offsets = offsets.to(at::kLong).contiguous();
  const bool weighted = weights.numel() > 0;
  if (weighted) weights = weights.to(cores[0].scalar_type()).contiguous();
  const int64_t B = offsets.numel() - 1, N = pslot.numel(), streams = batch > 0 ? B / batch : 1;
  const int64_t Ul = pkeys.numel(), Ur = skeys.numel();
  // where each bag's gradient row is: the forward's layout (its `into`'s, or bag_offset's)
  const bool laid_out = !stream_cols.empty();
  TORCH_CHECK(!laid_out || (batch > 0 && static_cast<int64_t>(stream_cols.size()) == streams &&
                            grad_out.numel() >= batch * row_stride),
              "ttm_bag_backward: ", stream_cols.size(), " column offsets for ", streams, " streams, or a gradient of ",
              grad_out.numel(), " values for rows of ", row_stride);
  const auto grad_row = [&](int64_t bag) {
    return laid_out ? (bag % batch) * row_stride + stream_cols[bag / batch] : bag_offset(bag, dim, batch, streams);
  };
  g_contraction_madds += 2 * contraction_madds(tr, Ul, Ur);  // two products per slot, each the forward's size

  auto dptab = at::empty_like(ptab), dstab = at::empty_like(stab);  // every row written once
  // Core gradients: a 1-core half's slices are summed into (zeroed); a 2-core half's are
  // each written once, every slice (slices no slot uses get zeros), in the cores' own
  // layouts or (rank padding) padded ones.
  std::vector<at::Tensor> dcores(cores.size());
  if (L.cores == 1) dcores[0] = at::zeros_like(cores[0]);
  if (R.cores == 1) dcores[tr.split] = at::zeros_like(cores[tr.split]);
  const auto fopt = cores[0].options();
  at::Tensor dleft1 = L.cores == 2 ? at::empty({tr.T, L.r_mid, L.n1, L.m1, rp}, fopt) : at::Tensor();
  at::Tensor dweights = weights_need_grad ? at::empty({N}, grad_out.options()) : at::Tensor();

  const int64_t* off = offsets.data_ptr<int64_t>();
  const int32_t* ps = pslot.data_ptr<int32_t>();
  const int32_t* ss = sslot.data_ptr<int32_t>();
  const int64_t* pk = pkeys.data_ptr<int64_t>();
  const int64_t* sk = skeys.data_ptr<int64_t>();
  // The distinct rows of the ids, grouped by prefix and by suffix slot, and the slots of
  // every core slice of a 2-core half: counting sorts, one chain per task.
  Groups ids_by_prefix;
  DistinctRows rows;
  CoreGroups left_groups, right_groups;
  at::parallel_for(0, 3, 1, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      if (task == 0) {
        ids_by_prefix = group_by(ps, N, Ul);
        rows = distinct_rows(ids_by_prefix, ss, Ul, Ur);
      }
      if (task == 1 && L.cores == 2) left_groups = group_by_cores(pk, Ul, L.n0, L.n1, tr.T);
      if (task == 2 && R.cores == 2) right_groups = group_by_cores(sk, Ur, R.n0, R.n1, tr.T);
    }
  });
  const int64_t U = static_cast<int64_t>(rows.pslot.size());

  AT_DISPATCH_FLOATING_TYPES(cores[0].scalar_type(), "ttm_bag_backward", [&] {
    using T_ = scalar_t;
    constexpr int64_t W = kLanes<T_>;
    const T_* w = weighted ? weights.data_ptr<T_>() : nullptr;
    const T_* g = grad_out.data_ptr<T_>();
    const T_* P = ptab.data_ptr<T_>();
    const T_* S = stab.data_ptr<T_>();
    T_* dP = dptab.data_ptr<T_>();
    T_* dS = dstab.data_ptr<T_>();

    phase.start("ttm_lookup backward: row gradients");
    // Each id's row gradient as (M_l, M_r) starts at grows + goff[id]: its bag's gradient
    // row itself when unweighted and unpadded, else a zero-padded weighted copy. The
    // offsets are worked out once here, not in the loops below.
    const int64_t MM = Ml * Mr;
    const bool direct = !w && dim == MM;
    std::vector<int64_t> goff(N);
    std::vector<T_> gpad(direct ? 0 : N * MM, T_(0));
    T_* dw = weights_need_grad ? dweights.data_ptr<T_>() : nullptr;
    at::parallel_for(0, B, 128, [&](int64_t b, int64_t e) {
      for (int64_t bag = b; bag < e; ++bag) {
        const int64_t row = grad_row(bag);
        const T_* gb = g + row;
        for (int64_t i = off[bag]; i < off[bag + 1]; ++i) {
          if (direct) {
            goff[i] = row;
            continue;
          }
          const T_ wi = w ? w[i] : T_(1);
          for (int64_t col = 0; col < dim; ++col) gpad[i * MM + col] = wi * gb[col];
          goff[i] = i * MM;
          if (dw) {  // d out[b] / d w_i = <row_i, g[b]>
            const T_* p = P + ps[i] * Ml * rp;
            const T_* q = S + ss[i] * Mr * rp;
            const T_* c = mid.defined() ? mid.data_ptr<T_>() + pk[ps[i]] / Nl * rp : nullptr;
            T_ acc = 0;
            for (int64_t x = 0; x < Ml; ++x)
              for (int64_t a = 0; a < Mr; ++a) {
                if (x * Mr + a >= dim) continue;
                T_ row = 0;
                if (c == nullptr) {
                  row = dot(p + x * rp, q + a * rp, rp);
                } else {
                  for (int64_t k = 0; k < rp; ++k) row += p[x * rp + k] * c[k] * q[a * rp + k];
                }
                acc += gb[x * Mr + a] * row;
              }
            dw[i] = acc;
          }
        }
      }
    });
    const T_* grows = direct ? g : gpad.data();
    // Each distinct row's gradient, the sum of its ids' (M_l, M_r) row gradients; a prefix
    // slot's rows take only its own ids, so threads own whole prefix slots.
    std::vector<T_> row_grads(U * MM);
    for_each_group_range(ids_by_prefix, [&](int64_t b, int64_t e) {
      std::fill(row_grads.begin() + rows.by_prefix.start[b] * MM, row_grads.begin() + rows.by_prefix.start[e] * MM, T_(0));
      for (int64_t k = ids_by_prefix.start[b]; k < ids_by_prefix.start[e]; ++k) {
        const int64_t i = ids_by_prefix.order[k];
        const T_* src = grows + goff[i];
        T_* dst = row_grads.data() + rows.of_id[i] * MM;
        for (int64_t c = 0; c < MM; ++c) dst[c] += src[c];
      }
    });
    // Slot gradients, each distinct row read once; a slot's rows stay in L1 while its rows
    // are summed into them. For slot s of one half: d[s][u, :] = sum over its rows of
    // sum_v g[u * row_step + v * stride] other[v, :], g the row's gradient and `other` its
    // row of the other half.
    auto slot_grads = [&](const Groups& by, T_* out, int64_t n_out, const T_* other, const int32_t* other_slot,
                          int64_t n_other, int64_t row_step, int64_t stride) {
      Contraction k;
      k.rows = n_out, k.cols = rp, k.ostride = rp, k.K1 = n_other, k.ak1 = stride, k.aj = row_step, k.bk1 = rp;
      auto a_of = [&](int64_t q) { return row_grads.data() + q * MM; };
      auto b_of = [&](int64_t q) { return other + other_slot[q] * n_other * rp; };
      auto ahead = [&](int64_t q) {
        prefetch_range(row_grads.data() + q * MM, MM * sizeof(T_));
        prefetch_range(other + other_slot[q] * n_other * rp, n_other * rp * sizeof(T_));
      };
      for_each_group_range(by, [&](int64_t b, int64_t e) {
        for (int64_t s = b; s < e; ++s)
          contract(out + s * n_out * rp, k, by.order.data() + by.start[s], by.start[s + 1] - by.start[s], a_of, b_of, ahead);
      });
    };
    phase.start("ttm_lookup backward: slot gradients");
    // 1a. prefix slots: dP[s][x, :] = sum over its rows of sum_a g[x, a] S[a, :]
    slot_grads(rows.by_prefix, dP, Ml, S, rows.sslot.data(), Mr, Mr, 1);
    // 1b. suffix slots: dS[s][a, :] = sum over its rows of sum_x g[x, a] P[x, :]
    slot_grads(rows.by_suffix, dS, Mr, P, rows.pslot.data(), Ml, 1, Mr);
    if (mid.defined()) {  // rows P diag(c) S^T: both slot gradients scaled by c, and c's own
      phase.start("ttm_lookup backward: controller");
      const T_* c = mid.data_ptr<T_>();
      dmiddle = middle_gradient(dP, P, pk, Ul, Nl, Ml, tr.T, r, rp, c, grad_out.options());
      at::parallel_for(0, Ur, 256, [&](int64_t b, int64_t e) {
        for (int64_t s = b; s < e; ++s) {
          const T_* cs = c + sk[s] / Nr * rp;
          for (int64_t a = 0; a < Mr; ++a) {
            T_* d = dS + (s * Mr + a) * rp;
            for (int64_t k = 0; k < rp; ++k) d[k] *= cs[k];
          }
        }
      });
    }

    phase.start("ttm_lookup backward: core gradients");
    // 2. prefix slot gradients -> left cores. Slots sharing a core slice are summed into it
    // by one thread (slots grouped by that core's index), so there are no write conflicts.
    const T_* g0 = cores[0].data_ptr<T_>();
    if (L.cores == 1) {  // slot <-> core slice, one to one
      T_* dg0 = dcores[0].data_ptr<T_>();
      at::parallel_for(0, Ul, 64, [&](int64_t b, int64_t e) {
        for (int64_t s = b; s < e; ++s) {
          const int64_t t = pk[s] / Nl, i0 = pk[s] % Nl;
          for (int64_t x = 0; x < L.m0; ++x) {
            const T_* src = dP + (s * Ml + x) * rp;
            T_* dst = dg0 + ((t * L.n0 + i0) * L.m0 + x) * r;
            for (int64_t k = 0; k < r; ++k) dst[k] += src[k];
          }
        }
      });
    } else {
      // dG0 is summed as vectors over its rank j: G1 read as (T, n1, m1, r, rm_p), dG0 as (T, n0, m0, rm_p)
      const int64_t rm = L.r_mid, blk = L.m1 * rp, rmp = padded(rm, W);
      phase.start("ttm_lookup backward: core layouts");
      const auto g1t_t = rank_last(cores[1], W);
      phase.start("ttm_lookup backward: core gradients");
      auto dg0t_t = at::empty({tr.T, L.n0, L.m0, rmp}, cores[0].options());  // every slice written
      const T_* g1t = g1t_t.data_ptr<T_>();
      T_* d0 = dg0t_t.data_ptr<T_>();
      T_* d1 = dleft1.data_ptr<T_>();
      const Groups &by0 = left_groups.by0, &by1 = left_groups.by1;
      const std::vector<int64_t>&key0 = left_groups.key0, &key1 = left_groups.key1;
      // Each core slice's gradient is summed over its slots in registers and stored once.
      // dG0[t, i0][x0, :] = sum over its slots of sum_{x1, k} dP[x0, x1, k] G1[t, :, i1, x1, k]
      Contraction k0;
      k0.rows = L.m0, k0.cols = rmp, k0.ostride = rmp, k0.K1 = L.m1, k0.K2 = r;
      k0.ak1 = rp, k0.ak2 = 1, k0.aj = blk, k0.bk1 = r * rmp, k0.bk2 = rmp;
      auto dp_of = [&](int64_t s) { return dP + s * Ml * rp; };
      auto g1_of = [&](int64_t s) { return g1t + key1[s] * L.m1 * r * rmp; };
      for_each_group_range(by0, [&](int64_t b, int64_t e) {
        for (int64_t key = b; key < e; ++key)
          contract(d0 + key * L.m0 * rmp, k0, by0.order.data() + by0.start[key], by0.start[key + 1] - by0.start[key],
                   dp_of, g1_of, kNoPrefetch);
      });
      // dG1[t, j, i1][:] = sum over its slots of sum_x0 G0[t, 0, i0, x0, j] dP[x0, :]
      Contraction k1;
      k1.rows = rm, k1.cols = blk, k1.ostride = L.n1 * blk, k1.K1 = L.m0, k1.ak1 = rm, k1.aj = 1, k1.bk1 = blk;
      auto g0_of = [&](int64_t s) { return g0 + key0[s] * L.m0 * rm; };
      for_each_group_range(by1, [&](int64_t b, int64_t e) {
        for (int64_t key = b; key < e; ++key) {
          const int64_t t = key / L.n1, i1 = key % L.n1;
          contract(d1 + (t * rm * L.n1 + i1) * blk, k1, by1.order.data() + by1.start[key],
                   by1.start[key + 1] - by1.start[key], g0_of, dp_of, kNoPrefetch);
        }
      });
      dcores[0] = dg0t_t.narrow(-1, 0, rm).reshape(cores[0].sizes()).contiguous();
    }

    // 3. suffix slot gradients -> right cores
    if (R.cores == 1) {  // slot <-> core slice, one to one
      T_* dg = dcores[tr.split].data_ptr<T_>();
      at::parallel_for(0, Ur, 64, [&](int64_t b, int64_t e) {
        for (int64_t s = b; s < e; ++s) {
          const int64_t t = sk[s] / Nr, si = sk[s] % Nr;
          const T_* dq = dS + s * Mr * rp;
          for (int64_t k = 0; k < r; ++k)
            for (int64_t a = 0; a < R.m0; ++a) dg[((t * r + k) * R.n0 + si) * R.m0 + a] += dq[a * rp + k];
        }
      });
    } else {
      // dG1 is summed as vectors over its rank j, dG1 as (T, n1, m1, rm_p). When rm is whole
      // vectors, G0 is read and dG0 written in G0's own layout (T, r, n0, m0, rm), summed as
      // vectors over j too; else both in (T, n0, m0, r, rm_p) / (T, n0, m0, rm, rp) copies.
      const int64_t rm = R.r_mid, rmp = padded(rm, W);
      const bool own_layout = rm == rmp;
      const auto g0_src = own_layout ? cores[tr.split] : pad_last(cores[tr.split].permute({0, 2, 3, 1, 4}), W);
      const T_* g0r = g0_src.data_ptr<T_>();
      auto dc1t_t = at::empty({tr.T, R.n1, R.m1, rmp}, fopt);  // every slice written
      const T_* c1 = cores[tr.split + 1].data_ptr<T_>();
      T_* dC = dc1t_t.data_ptr<T_>();
      const Groups &by0 = right_groups.by0, &by1 = right_groups.by1;
      const std::vector<int64_t>&key0 = right_groups.key0, &key1 = right_groups.key1;
      if (own_layout) {
        // dG0[t, :, i0, x0, :] (r rows of rm) = sum over its slots of sum_x1 dS[(x0, x1), :]^T G1[t, :, i1, x1]
        dcores[tr.split] = at::empty_like(cores[tr.split]);  // every slice written
        T_* dA = dcores[tr.split].data_ptr<T_>();
        const auto c1t_t = cores[tr.split + 1].permute({0, 2, 3, 4, 1}).contiguous();  // (T, n1, m1, 1, rm): small
        const T_* c1t = c1t_t.data_ptr<T_>();
        Contraction ka;
        ka.rows = r, ka.cols = rm, ka.ostride = R.n0 * R.m0 * rm, ka.K1 = R.m1, ka.ak1 = rp, ka.aj = 1, ka.bk1 = rm;
        auto c1t_of = [&](int64_t s) { return c1t + key1[s] * R.m1 * rm; };
        for_each_group_range(by0, [&](int64_t b, int64_t e) {
          for (int64_t key = b; key < e; ++key) {
            const int64_t t = key / R.n0, i0 = key % R.n0;
            for (int64_t x0 = 0; x0 < R.m0; ++x0) {
              auto ds_of = [&](int64_t s) { return dS + s * Mr * rp + x0 * R.m1 * rp; };
              contract(dA + ((t * r * R.n0 + i0) * R.m0 + x0) * rm, ka, by0.order.data() + by0.start[key],
                       by0.start[key + 1] - by0.start[key], ds_of, c1t_of, kNoPrefetch);
            }
          }
        });
      } else {
        auto dright0 = at::empty({tr.T, R.n0, R.m0, rm, rp}, fopt);  // every slice written
        T_* dA = dright0.data_ptr<T_>();
        // each slot's G1[t, 0, i1, :, 0] (rank j at + j * n1 * m1), worked out once
        std::vector<const T_*> c1_of(Ur);
        for (int64_t s = 0; s < Ur; ++s) c1_of[s] = c1 + (key1[s] / R.n1 * rm * R.n1 + key1[s] % R.n1) * R.m1;
        // dG0[t, :, i0, x0, j] = sum over its slots of sum_x1 G1[t, j, i1, x1] dS[(x0, x1), :]
        Contraction ka;
        ka.rows = rm, ka.cols = rp, ka.ostride = rp, ka.K1 = R.m1, ka.ak1 = 1, ka.aj = R.n1 * R.m1, ka.bk1 = rp;
        auto c1_at = [&](int64_t s) { return c1_of[s]; };
        for_each_group_range(by0, [&](int64_t b, int64_t e) {
          for (int64_t key = b; key < e; ++key)
            for (int64_t x0 = 0; x0 < R.m0; ++x0) {
              auto ds_of = [&](int64_t s) { return dS + s * Mr * rp + x0 * R.m1 * rp; };
              contract(dA + (key * R.m0 + x0) * rm * rp, ka, by0.order.data() + by0.start[key],
                       by0.start[key + 1] - by0.start[key], c1_at, ds_of, kNoPrefetch);
            }
        });
        // (T, n0, m0, rm, rp) -> (T, r, n0, m0, rm)
        dcores[tr.split] = dright0.narrow(-1, 0, r).permute({0, 4, 1, 2, 3}).contiguous();
      }
      // dG1[t, :, i1, x1] = sum over its slots of sum_{x0, k} dS[(x0, x1), k] G0[t, k, i0, x0, :]
      Contraction kc;
      kc.rows = R.m1, kc.cols = rmp, kc.ostride = rmp, kc.K1 = R.m0, kc.K2 = r;
      kc.ak1 = R.m1 * rp, kc.ak2 = 1, kc.aj = rp;
      kc.bk1 = own_layout ? rm : r * rmp, kc.bk2 = own_layout ? R.n0 * R.m0 * rm : rmp;
      auto ds_of = [&](int64_t s) { return dS + s * Mr * rp; };
      auto g0_of = [&](int64_t s) {
        const int64_t t = key0[s] / R.n0, i0 = key0[s] % R.n0;
        return own_layout ? g0r + (t * r * R.n0 + i0) * R.m0 * rm : g0r + key0[s] * R.m0 * r * rmp;
      };
      for_each_group_range(by1, [&](int64_t b, int64_t e) {
        for (int64_t key = b; key < e; ++key)
          contract(dC + key * R.m1 * rmp, kc, by1.order.data() + by1.start[key], by1.start[key + 1] - by1.start[key],
                   ds_of, g0_of, kNoPrefetch);
      });
      // (T, n1, m1, rm) -> (T, rm, n1, m1, 1)
      dcores[tr.split + 1] = dc1t_t.narrow(-1, 0, rm).permute({0, 3, 1, 2}).unsqueeze(-1).contiguous();
    }
  });
  // the padded layout back to the core's own: drop the rank padding (no copy without)
  if (L.cores == 2) dcores[1] = rp == r ? dleft1 : dleft1.narrow(-1, 0, r).contiguous();
  dcores.push_back(dweights);
  dcores.push_back(dmiddle);  // undefined without a middle controller
  return dcores;
}

// Column blocks of several (B, C_s) matrices gathered into one (B, K * width) matrix:
// block k of every row is columns [col[k], col[k] + width) of source src[k]. One pass
// over the rows; the backward is the same map read the other way (scatter_blocks).
at::Tensor gather_blocks(std::vector<at::Tensor> sources, std::vector<int64_t> src, std::vector<int64_t> col,
                         int64_t width) {
  TORCH_CHECK(!sources.empty() && src.size() == col.size(), "gather_blocks: bad block map");
  const int64_t B = sources[0].size(0), K = static_cast<int64_t>(src.size());
  for (auto& s : sources) {
    TORCH_CHECK(s.dim() == 2 && s.size(0) == B, "gather_blocks: sources must be (B, C) with one B");
    s = s.contiguous();
  }
  auto out = at::empty({B, K * width}, sources[0].options());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "gather_blocks", [&] {
    std::vector<const scalar_t*> base(K);
    std::vector<int64_t> stride(K);
    for (int64_t k = 0; k < K; ++k) {
      base[k] = sources[src[k]].data_ptr<scalar_t>() + col[k];
      stride[k] = sources[src[k]].size(1);
    }
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, 64, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row)
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(o + (row * K + k) * width, base[k] + row * stride[k], width * sizeof(scalar_t));
    });
  });
  return out;
}

// The gradient of gather_blocks: each source's (B, C_s) gradient, zero where no block reads.
std::vector<at::Tensor> scatter_blocks(at::Tensor grad, std::vector<int64_t> widths_of_sources,
                                       std::vector<int64_t> src, std::vector<int64_t> col, int64_t width) {
  grad = grad.contiguous();
  const int64_t B = grad.size(0), K = static_cast<int64_t>(src.size());
  std::vector<at::Tensor> out;
  for (size_t s = 0; s < widths_of_sources.size(); ++s) out.push_back(at::empty({B, widths_of_sources[s]}, grad.options()));
  {  // sources whose columns are not all read get zeros first
    std::vector<int64_t> read(widths_of_sources.size(), 0);
    for (int64_t k = 0; k < K; ++k) read[src[k]] += width;
    for (size_t s = 0; s < out.size(); ++s)
      if (read[s] != widths_of_sources[s]) out[s].zero_();
  }
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "scatter_blocks", [&] {
    std::vector<scalar_t*> base(K);
    std::vector<int64_t> stride(K);
    for (int64_t k = 0; k < K; ++k) {
      base[k] = out[src[k]].data_ptr<scalar_t>() + col[k];
      stride[k] = widths_of_sources[src[k]];
    }
    const scalar_t* g = grad.data_ptr<scalar_t>();
    at::parallel_for(0, B, 64, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row)
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(base[k] + row * stride[k], g + (row * K + k) * width, width * sizeof(scalar_t));
    });
  });
  return out;
}

// The other sources' functions, bound in this (the extension's one) module.
// tt_linear_cpu.cpp: the fused TT linear
std::vector<at::Tensor> tt_linear_forward(at::Tensor x, at::Tensor left, at::Tensor right,
                                          at::Tensor bias, bool relu);
std::vector<at::Tensor> tt_linear_backward(at::Tensor grad_y, at::Tensor x, at::Tensor left,
                                           at::Tensor right, at::Tensor t, at::Tensor y,
                                           bool need_grad_x, bool need_grad_bias, bool need_grad_left);
std::vector<at::Tensor> tt_linear_pack(at::Tensor left, at::Tensor right, at::Tensor bias);
at::Tensor tt_linear_forward_packed(at::Tensor x, std::vector<at::Tensor> packed, int64_t r, int64_t n_out,
                                    bool relu);
at::Tensor tt_cross_forward(std::vector<at::Tensor> x0_parts, std::vector<at::Tensor> lefts,
                            std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                            int64_t block_rows, std::vector<at::Tensor> next_lefts,
                            std::vector<at::Tensor> next_rights, std::vector<at::Tensor> next_biases,
                            std::vector<bool> next_relus);
std::vector<at::Tensor> tt_chain_forward(at::Tensor x, std::vector<at::Tensor> lefts,
                                         std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                                         std::vector<bool> relus);
std::vector<at::Tensor> tt_chain_backward(at::Tensor grad_y, at::Tensor x, std::vector<at::Tensor> lefts,
                                          std::vector<at::Tensor> rights, std::vector<at::Tensor> biases,
                                          std::vector<bool> relus, std::vector<at::Tensor> ts, at::Tensor y,
                                          bool need_grad_x, std::vector<bool> need_grad_left,
                                          std::vector<bool> need_grad_bias);
std::vector<at::Tensor> tt_chains_forward(std::vector<at::Tensor> cores, std::vector<at::Tensor> controllers,
                                          int64_t d, int64_t in_features, int64_t out_features);
std::vector<at::Tensor> tt_chains_backward(at::Tensor grad_left, at::Tensor grad_right,
                                           std::vector<at::Tensor> cores,
                                           std::vector<at::Tensor> controllers, std::vector<at::Tensor> saved,
                                           int64_t d);

// The TTM lookup's contraction multiply-adds counted since the last call; the count restarts.
int64_t take_contraction_madds() { return g_contraction_madds.exchange(0); }

// checks_cpu.cpp: input checks of a jagged batch
std::vector<int64_t> check_jagged(at::Tensor values, at::Tensor lengths, at::Tensor offsets, int64_t batch,
                                  std::vector<int64_t> bounds);

// The Python module's bindings; the operator library (comera_rec/dlrm/serving_ops_cpu.cpp)
// compiles these sources without them, registering PyTorch operators instead.
#ifndef COMERA_OPERATOR_LIBRARY
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_bytes", [] { return comera::kVectorBytes; }, "the vector width this build's kernels use");
  m.def("take_contraction_madds", &take_contraction_madds, COMERA_RELEASE_GIL,
        "the TTM lookup's contraction multiply-adds since the last call (and reset the count)");
  m.def("ttm_bag_forward", &ttm_bag_forward, COMERA_RELEASE_GIL, "fused de-duplicated TTM embedding-bag lookup (forward)");
  m.def("ttm_halves", &ttm_halves, COMERA_RELEASE_GIL, "both halves of a TTM train contracted over all their row indices");
  m.def("ttm_bag_forward_halves", &ttm_bag_forward_halves, COMERA_RELEASE_GIL, "the TTM embedding-bag lookup over whole halves (scoring)");
  m.def("ttm_forward_layouts", &ttm_forward_layouts, COMERA_RELEASE_GIL, "the lookup forward's permuted, padded core layouts");
  m.def("ttm_bag_backward", &ttm_bag_backward, COMERA_RELEASE_GIL, "fused de-duplicated TTM embedding-bag lookup (backward)");
  m.def("gather_blocks", &gather_blocks, COMERA_RELEASE_GIL, "column blocks of several matrices side by side");
  m.def("scatter_blocks", &scatter_blocks, COMERA_RELEASE_GIL, "the gradient of gather_blocks");
  m.def("tt_linear_forward", &tt_linear_forward, COMERA_RELEASE_GIL, "fused TT linear (+ ReLU): forward");
  m.def("tt_linear_backward", &tt_linear_backward, COMERA_RELEASE_GIL, "fused TT linear (+ ReLU): backward");
  m.def("tt_linear_pack", &tt_linear_pack, COMERA_RELEASE_GIL, "a TT linear's weights packed once for repeated scoring calls");
  m.def("tt_linear_forward_packed", &tt_linear_forward_packed, COMERA_RELEASE_GIL, "fused TT linear (+ ReLU) on packed weights, scoring");
  m.def("tt_cross_forward", &tt_cross_forward, COMERA_RELEASE_GIL, "a DCN cross net, each layer's projections one TT weight, then optionally TT linears (scoring)");
  m.def("tt_chain_forward", &tt_chain_forward, COMERA_RELEASE_GIL, "an MLP's consecutive fused TT linears (+ ReLU): forward, keeping each layer's t");
  m.def("tt_chain_backward", &tt_chain_backward, COMERA_RELEASE_GIL, "the backward of tt_chain_forward, the hidden outputs recomputed from t");
  m.def("tt_chains_forward", &tt_chains_forward, COMERA_RELEASE_GIL, "a TT weight's cores and controllers merged into its two chains");
  m.def("tt_chains_backward", &tt_chains_backward, COMERA_RELEASE_GIL, "the gradient of tt_chains_forward");
  m.def("check_jagged", &check_jagged, COMERA_RELEASE_GIL, "input checks of a jagged batch in one pass");
}
#endif
