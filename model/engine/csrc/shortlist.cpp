// The shortlist's kernels: each sentence's candidates, and each row's logits over its own columns.
#include "kernels.h"
#include "tiles.h"

// Each sentence's own shortlist candidates (model.engine.shortlist.Shortlist.candidates_of): its
// pieces and the targets associated with them, sorted and unique. sources (B, S) int64 piece ids,
// real (B, S) bool (false: padding), offsets (V + 1,) int64 and targets (N,) integer: piece p's
// targets are targets[offsets[p] : offsets[p + 1]]. -> B int64 tensors.
std::vector<torch::Tensor> candidates(const torch::Tensor& sources, const torch::Tensor& real,
                                      const torch::Tensor& offsets, const torch::Tensor& targets) {
  TORCH_CHECK(sources.scalar_type() == torch::kInt64 && sources.dim() == 2 && real.scalar_type() == torch::kBool &&
                  real.sizes() == sources.sizes() && offsets.scalar_type() == torch::kInt64 && offsets.dim() == 1 &&
                  targets.dim() == 1 && sources.device().is_cpu(),
              "candidates: sources (B, S) int64, real (B, S) bool, offsets (V + 1) int64, targets (N) on the CPU");
  const auto src = sources.contiguous();
  const auto rl = real.contiguous();
  const auto off = offsets.contiguous();
  const auto tg = targets.contiguous();
  const int64_t b = src.size(0), s = src.size(1), v = off.numel() - 1;
  const int64_t* sp = src.data_ptr<int64_t>();
  const bool* rp = rl.data_ptr<bool>();
  const int64_t* op = off.data_ptr<int64_t>();
  std::vector<torch::Tensor> out;
  out.reserve(b);
  std::vector<uint8_t> mark(v);
  AT_DISPATCH_INTEGRAL_TYPES(tg.scalar_type(), "candidates", [&] {
    const scalar_t* tp = tg.data_ptr<scalar_t>();
    for (int64_t i = 0; i < b; i++) {
      std::fill(mark.begin(), mark.end(), 0);
      int64_t found = 0;
      auto add = [&](int64_t id) {
        TORCH_CHECK(id >= 0 && id < v, "candidates: piece ", id, " outside the vocabulary of ", v);
        found += mark[id] == 0;
        mark[id] = 1;
      };
      for (int64_t j = 0; j < s; j++) {
        if (!rp[i * s + j]) continue;
        const int64_t piece = sp[i * s + j];
        add(piece);
        for (int64_t t = op[piece]; t < op[piece + 1]; t++) add(static_cast<int64_t>(tp[t]));
      }
      auto ids = torch::empty({found}, src.options());
      int64_t* ip = ids.data_ptr<int64_t>();
      for (int64_t id = 0, n = 0; id < v; id++) {
        if (mark[id]) ip[n++] = id;
      }
      out.push_back(ids);
    }
  });
  return out;
}

// rows [r, r + Rows) of a sentence by its `count` own weight rows (p.w), ``linear``'s tiles, then
// the last count % kTileN<1> (the widest tile) by ``dot``: an output depends on its row, its weight
// row and `count` alone, not on how many of the sentence's rows are computed with it nor on the
// batch around the sentence (a tile sums each output in the same order whatever its shape).
template <int Rows>
void span_rows(const Product& p, int64_t r, int64_t count) {
  constexpr int64_t tn = kTileN<Rows>;
  static_assert(kTileN<1> % tn == 0, "every tile width divides the widest");
  const int64_t whole = count - count % kTileN<1>;
  for (int64_t j = 0; j < whole; j += tn) tile<Rows>(p, r, j);
  for (int64_t i = r; i < r + Rows; i++) {
    for (int64_t j = whole; j < count; j++) p.out[i * p.n + j] = dot(p.x + i * p.k, p.w + j * p.k, p.k);
  }
}

// Each row's logits over its own sentence's shortlist columns, those beyond the ones every sentence
// shares (model.engine.shortlist.Vocabulary). x (R, D) the rows' last hidden states, D a multiple of 16;
// sentences (R,) int64 each row's sentence, never decreasing (an empty tensor: row r's is r / W,
// W = R / A); rows (T, D) float32, or float16 (an output matrix shipped in float16, exact: widened
// here a sentence at a time, half the bytes read), the output matrix's rows of every sentence's own
// columns laid end to end, spans (A, 2) int64 (first, count): sentence i's are rows [first, first +
// count); width E at least every count. -> (R, E): row r's column j is x[r] . rows[first + j] for
// j < its sentence's count, -inf after (no candidate). The rows stream from L3 (every sentence's
// own, read once a step): this is bound by the bytes it reads.
torch::Tensor span_logits(const torch::Tensor& x, const torch::Tensor& sentences, const torch::Tensor& rows,
                          const torch::Tensor& spans, int64_t width) {
  check_rows(x, "x");
  const bool half = rows.scalar_type() == torch::kHalf;
  TORCH_CHECK(rows.is_cpu() && (half || rows.scalar_type() == torch::kFloat32) && rows.dim() == 2 &&
                  rows.is_contiguous(),
              "rows must be a contiguous float32 or float16 (T, D) CPU matrix");
  const int64_t r = x.size(0), d = x.size(1), t = rows.size(0);
  TORCH_CHECK(rows.size(1) == d && d % 16 == 0, "span_logits: x (R, D) and rows (T, D) need one D, a multiple of 16");
  const int64_t* span = span_data(spans, width, t, "span_logits");
  const int64_t a = spans.size(0);
  const int64_t* sentence_of = index_data(sentences, r, a, "sentences", false);
  TORCH_CHECK(sentence_of != nullptr || (a > 0 ? r % a == 0 : r == 0), "span_logits: ", r, " rows for ", a,
              " sentences");
  const int64_t w = a > 0 ? r / a : 0;
  std::vector<int64_t> runs(a + 1, r);  // sentence i's rows are [runs[i], runs[i + 1]): rows come in sentence order
  int64_t row = 0;
  for (int64_t i = 0; i < a; i++) {
    runs[i] = row;
    if (sentence_of == nullptr) {
      row += w;
    } else {
      while (row < r && sentence_of[row] == i) row++;
    }
  }
  TORCH_CHECK(row == r, "span_logits: each row's sentence must be in order (never decreasing)");
  auto out = torch::empty({r, width}, x.options());
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, std::max<int64_t>(1, w) * width * d));
  parallel_chunks(0, a, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(half ? width * d : 0);  // a sentence's rows widened from float16
    for (int64_t i = begin; i < end; i++) {
      const int64_t first = span[2 * i], count = span[2 * i + 1];
      const float* own = half ? wide.data() : rows.data_ptr<float>() + first * d;
      if (half) widen(rows.data_ptr<at::Half>() + first * d, wide.data(), count * d);
      const Product p{x.data_ptr<float>(), own, nullptr, op, d, width, false};
      int64_t j = runs[i];
      for (; j + 4 <= runs[i + 1]; j += 4) span_rows<4>(p, j, count);
      switch (runs[i + 1] - j) {
        case 3: span_rows<3>(p, j, count); break;
        case 2: span_rows<2>(p, j, count); break;
        case 1: span_rows<1>(p, j, count); break;
        default: break;
      }
      for (j = runs[i]; j < runs[i + 1]; j++) std::fill(op + j * width + count, op + (j + 1) * width, -INFINITY);
    }
  });
  return out;
}
