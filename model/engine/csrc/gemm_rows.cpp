// A linear layer for a few rows, the weights streamed as they are (the design: tiles.h).
#include "kernels.h"
#include "tiles.h"

// x (R, K) times w (N, K) transposed, plus bias (N; an empty tensor: none), ReLU'd when `relu`
// -> (R, N): a linear layer for a few rows (see "Matrix products of a few rows"). K a multiple of 16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, bool relu) {
  check_rows(x, "x");
  check_rows(w, "w");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && k % 16 == 0, "x (R, K) and w (N, K) need the same K, a multiple of 16");
  auto out = torch::empty({rows, n}, x.options());
  const Product p{x.data_ptr<float>(), w.data_ptr<float>(), bias_data(bias, n), out.data_ptr<float>(), k, n, relu};
  const int64_t blocks = n / kBlockN;
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, kBlockN * k * rows));
  parallel_chunks(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) tiles<4>(p, r, b * kBlockN);
      switch (rows - r) {
        case 3: tiles<3>(p, r, b * kBlockN); break;
        case 2: tiles<2>(p, r, b * kBlockN); break;
        case 1: tiles<1>(p, r, b * kBlockN); break;
        default: break;
      }
    }
  });
  for (int64_t j = blocks * kBlockN; j < n; j++) {  // the last weight rows, fewer than a block
    for (int64_t r = 0; r < rows; r++) p.out[r * n + j] = finish(p, j, dot(p.x + r * k, p.w + j * k, k));
  }
  return out;
}
