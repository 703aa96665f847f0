// Input checks of a jagged batch in one pass: bag lengths, offsets and ids, where the tensor
// form (comparisons, a repeat_interleave of the bounds, any / nonzero) makes a handful of
// passes and temporaries over every id.

#include "aten_ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

// {code, position, lengths' sum, key}: code 0 all good; 1 a negative length at position;
// 2 offsets[p + 1] - offsets[p] != lengths[p] at bag p (offsets given: numel B + 1);
// 3 an id at position out of [0, bounds[key]) (bounds[key] < 0: key unchecked). The
// lengths are key-major, `batch` bags per key.
std::vector<int64_t> check_jagged(at::Tensor values, at::Tensor lengths, at::Tensor offsets, int64_t batch,
                                  std::vector<int64_t> bounds) {
  const int64_t keys = static_cast<int64_t>(bounds.size());
  TORCH_CHECK(lengths.numel() == keys * batch, "check_jagged: ", lengths.numel(), " lengths for ", keys,
              " keys x batch ", batch);
  values = values.contiguous();
  lengths = lengths.to(at::kLong).contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t n_len = lengths.numel();
  int64_t total = 0;
  for (int64_t p = 0; p < n_len; ++p) {
    if (len[p] < 0) return {1, p, 0, p / std::max<int64_t>(batch, 1)};
    total += len[p];
  }
  if (offsets.numel() > 0) {
    offsets = offsets.to(at::kLong).contiguous();
    TORCH_CHECK(offsets.numel() == n_len + 1, "check_jagged: ", offsets.numel(), " offsets for ", n_len, " lengths");
    const int64_t* off = offsets.data_ptr<int64_t>();
    for (int64_t p = 0; p < n_len; ++p)
      if (off[p + 1] - off[p] != len[p]) return {2, p, total, p / std::max<int64_t>(batch, 1)};
  }
  std::vector<int64_t> bad{0, -1, total, -1};
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "check_jagged", [&] {
    const index_t* v = values.data_ptr<index_t>();
    const int64_t n = values.numel();
    int64_t start = 0;
    for (int64_t k = 0; k < keys && bad[0] == 0; ++k) {
      int64_t count = 0;
      for (int64_t b = 0; b < batch; ++b) count += len[k * batch + b];
      const int64_t end = std::min(n, start + count), bound = bounds[k];
      if (bound >= 0)
        for (int64_t p = start; p < end; ++p)
          if (v[p] < 0 || v[p] >= bound) {
            bad = {3, p, total, k};
            break;
          }
      start = end;
    }
  });
  return bad;
}
