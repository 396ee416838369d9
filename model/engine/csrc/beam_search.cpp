// A step of beam search's bookkeeping (model.engine.beams.Beams.advance).
#include "kernels.h"

namespace {

// The k largest of n values (ties: the earlier index first), best first, into value/index.
// The first k values fill the list; a later one enters only when strictly larger than its last.
template <typename Value>
inline void top_k(int64_t n, int64_t k, Value value, float* best, int64_t* index) {
  int64_t filled = 0;
  for (int64_t j = 0; j < n; j++) {
    const float x = value(j);
    if (filled == k && !(x > best[k - 1])) continue;
    int64_t at = filled < k ? filled++ : k - 1;
    while (at > 0 && x > best[at - 1]) {
      best[at] = best[at - 1];
      index[at] = index[at - 1];
      at--;
    }
    best[at] = x;
    index[at] = j;
  }
}

}  // namespace

// GNMT's length penalty ((5 + n) / 6) ** alpha, in float32 as model.beams.length_penalty
inline float length_penalty(int64_t n, float alpha) {
  return alpha == 0.f ? 1.f : std::pow((5.f + static_cast<float>(n)) / 6.f, alpha);
}

// One step of beam search's bookkeeping: model.beams.Beams.advance, the same rules.
// logits (A, W, C) float32 next-token logits of each sentence's first W rows (W = 1 at a batch's
// first step, else K), column j token j, or vocab[j] when vocab (C,) int64 is given (not empty).
// With a shortlist (model.shortlist.Vocabulary) the logits are the N columns every sentence shares
// (vocab (N,) their tokens), and own (A, W, E) or (R', E) float32 each row's over its sentence's own
// columns: extra (T,) int64 tokens and spans (A, 2) int64 (first, count), sentence i's own column j
// is token extra[first + j], for j < count (the rest are none of its candidates); own, extra and
// spans empty without. start (A,) int64 the
// step each sentence joined at and `now` the batch's step (a sentence has now - start tokens so
// far); the beams' state (A, K): scores (raw cumulative log P, float32), lengths
// (int64), finished and eos (bool), history (A, K, T) int64 (greedy: written in place).
// rows (A * W,) int64, or an empty tensor: where the step computed only some rows (a sentence that
// joins a running beam batch decodes one row at its first step; its other W - 1 are copies of it at
// -inf), logits is (R', C) and entry i * W + r the logits row of sentence i's row r, -1 for a row at
// -inf that was not computed. Such a row's candidates are all -inf, as they were when it was
// computed, and it is never chosen: its first row's K candidates come before it in the ranking,
// and top_k keeps the earlier of equal values.
// -> ({scores, tokens, back-pointers (A * K) into the A * W rows (empty for greedy), history,
// eos, lengths, finished}: the beams' next state, [the sentences all of whose hypotheses are
// finished now]). Greedy search (K = 1) never sees a finished row.
std::tuple<std::vector<torch::Tensor>, std::vector<int64_t>> advance(const torch::Tensor& logits, const torch::Tensor& own, const torch::Tensor& vocab,
                                   const torch::Tensor& extra, const torch::Tensor& spans,
                                   const torch::Tensor& start, int64_t now, const torch::Tensor& scores, const torch::Tensor& lengths,
                                   const torch::Tensor& finished, const torch::Tensor& eos, torch::Tensor history,
                                   double alpha, int64_t eos_id, int64_t pad_id, const torch::Tensor& rows) {
  const bool some = rows.numel() > 0;
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == (some ? 2 : 3) &&
                  logits.is_contiguous(),
              "logits must be a contiguous float32 (A, W, C) CPU tensor, or (R', C) with rows");
  const int64_t a = scores.size(0), k = scores.size(-1);
  const int64_t w = some ? (a > 0 ? rows.numel() / a : 0) : logits.size(1), c = logits.size(-1);
  TORCH_CHECK(some || logits.size(0) == a, "advance: logits of ", logits.size(0), " sentences for ", a);
  TORCH_CHECK(!some || (rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous() &&
                        rows.is_cpu() && a > 0 && rows.numel() == a * w),
              "rows must be a contiguous int64 CPU vector of A x W entries");
  const int64_t* logits_row = some ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; some && i < a * w; i++) {
    TORCH_CHECK(logits_row[i] >= -1 && logits_row[i] < logits.size(0), "rows: ", logits_row[i], " out of range");
  }
  TORCH_CHECK(k >= 1 && c >= 1 && (w == 1 || w == k), "advance: ", w, " rows per sentence for a beam of ", k);
  TORCH_CHECK(scores.scalar_type() == torch::kFloat32 && scores.dim() == 2 && scores.size(0) == a,
              "scores must be float32 (A, K)");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.dim() == 2 && lengths.size(0) == a &&
                  (lengths.size(1) == k || lengths.size(1) == 1),
              "lengths must be int64 (A, K) or (A, 1)");
  TORCH_CHECK(finished.scalar_type() == torch::kBool && eos.scalar_type() == torch::kBool &&
                  finished.sizes() == scores.sizes() && eos.sizes() == scores.sizes(),
              "finished and eos must be bool (A, K)");
  TORCH_CHECK(start.scalar_type() == torch::kInt64 && start.numel() == a, "start must be int64 (A,)");
  TORCH_CHECK(history.scalar_type() == torch::kInt64 && history.dim() == 3 && history.size(0) == a &&
                  history.size(1) == k && history.is_contiguous(),
              "history must be a contiguous int64 (A, K, T) tensor");
  const bool mapped = vocab.numel() > 0, owned = spans.numel() > 0;
  const int64_t ec = owned ? own.size(-1) : 0;  // each row's own columns, after the c shared ones
  TORCH_CHECK(!mapped || (vocab.scalar_type() == torch::kInt64 && vocab.dim() == 1 && vocab.is_contiguous() &&
                          vocab.numel() == c),
              "vocab must be a contiguous int64 (C,) vector");
  TORCH_CHECK(!owned || (mapped && own.scalar_type() == torch::kFloat32 && own.is_contiguous() &&
                         own.dim() == logits.dim() && own.numel() == (logits.numel() / c) * ec &&
                         is_vector(extra, torch::kInt64) && spans.dim() == 2 && spans.size(0) == a),
              "own must be float32 logits of the same rows, extra an int64 vector and spans (A, 2), with vocab");
  const int64_t* span = owned ? span_data(spans, ec, extra.numel(), "advance") : nullptr;
  const int64_t* extra_ids = owned ? extra.data_ptr<int64_t>() : nullptr;
  const float* own_x = owned ? own.data_ptr<float>() : nullptr;
  const auto sc = scores.contiguous();
  const auto len = lengths.expand({a, k}).contiguous();
  const auto fin = finished.contiguous();
  const auto eo = eos.contiguous();
  const auto st = start.contiguous();
  const int64_t t = history.size(2);
  const int64_t* joined = st.data_ptr<int64_t>();
  std::vector<int64_t> steps(a);
  for (int64_t i = 0; i < a; i++) {
    steps[i] = now - joined[i];
    TORCH_CHECK(steps[i] >= 0 && steps[i] < t, "history has no room at step ", steps[i]);
  }
  const float* x = logits.data_ptr<float>();
  const float* s = sc.data_ptr<float>();
  const int64_t* l = len.data_ptr<int64_t>();
  const bool* f = fin.data_ptr<bool>();
  const bool* e = eo.data_ptr<bool>();
  const int64_t* ids = mapped ? vocab.data_ptr<int64_t>() : nullptr;
  auto out_scores = torch::empty({a, k}, scores.options());
  auto out_tokens = torch::empty({a, k}, start.options());
  auto out_eos = torch::empty({a, k}, eos.options());
  auto out_finished = torch::empty({a, k}, finished.options());
  auto out_length = torch::empty({a, k}, start.options());
  auto out_back = torch::empty({k > 1 ? a * k : 0}, start.options());
  auto out_history = k > 1 ? torch::empty_like(history) : history;
  float* os = out_scores.data_ptr<float>();
  int64_t* ot = out_tokens.data_ptr<int64_t>();
  bool* oe = out_eos.data_ptr<bool>();
  bool* of = out_finished.data_ptr<bool>();
  int64_t* ol = out_length.data_ptr<int64_t>();
  int64_t* ob = out_back.data_ptr<int64_t>();
  const int64_t* h = history.data_ptr<int64_t>();
  int64_t* oh = out_history.data_ptr<int64_t>();
  const float penalty_alpha = static_cast<float>(alpha);
  parallel_chunks(0, a, std::max<int64_t>(1, kGrainWork / (w * c)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(c + ec), row_best(w * k), best(k);
    std::vector<int64_t> row_index(w * k), index(k);
    for (int64_t i = begin; i < end; i++) {
      const int64_t candidates = owned ? c + span[2 * i + 1] : c;  // the shared columns, then its own
      const float scale = length_penalty(steps[i] + 1, penalty_alpha);
      for (int64_t r = 0; r < w; r++) {
        float* rb = &row_best[r * k];
        if (f[i * k + r]) {  // a finished hypothesis competes once, its normalized score in the live ones' raw scale
          std::fill(rb, rb + k, -INFINITY);
          rb[0] = s[i * k + r] / length_penalty(l[i * k + r], penalty_alpha) * scale;
          continue;
        }
        const int64_t from_row = logits_row == nullptr ? i * w + r : logits_row[i * w + r];
        if (from_row < 0) {  // not computed: a copy of the sentence's first row at -inf
          TORCH_CHECK(s[i * k + r] == -INFINITY, "advance: row ", r, " of sentence ", i, " has a score but no logits");
          std::fill(rb, rb + k, -INFINITY);
          for (int64_t j = 0; j < k; j++) row_index[r * k + j] = j;
          continue;
        }
        const float* xr = x + from_row * c;  // log-softmax, then the row's k best columns
        std::copy(xr, xr + c, row.data());
        if (owned) std::copy(own_x + from_row * ec, own_x + from_row * ec + (candidates - c), row.data() + c);
        const float top = maximum(row.data(), candidates);
        // fewer candidates than K (a shortlist with a tiny ``always``): the rest -inf, token PAD
        std::fill(rb, rb + k, -INFINITY);
        std::fill(&row_index[r * k], &row_index[r * k] + k, -1);
        top_k(candidates, std::min(k, candidates), [&row](int64_t j) { return row[j]; }, rb, &row_index[r * k]);
        const float log_sum = std::log(exp_shifted(row.data(), candidates, top));
        for (int64_t j = 0; j < k; j++) rb[j] = (rb[j] - top) - log_sum + s[i * k + r];
      }
      top_k(w * k, k, [&](int64_t j) { return row_best[j]; }, best.data(), index.data());
      for (int64_t j = 0; j < k; j++) {
        const int64_t beam = index[j] / k, from = i * k + beam, to = i * k + j;
        const bool was_finished = f[from];
        const int64_t column = row_index[index[j]];
        const int64_t token = was_finished || column < 0 ? pad_id
                              : column >= c  ? extra_ids[span[2 * i] + column - c]
                              : mapped       ? ids[column]
                                             : column;
        os[to] = was_finished ? s[from] : best[j];
        ol[to] = was_finished ? l[from] : steps[i] + 1;
        ot[to] = token;
        oe[to] = was_finished ? e[from] : token == eos_id;
        of[to] = was_finished || oe[to];
        if (k > 1) {
          ob[to] = i * w + beam;
          std::copy(h + from * t, h + (from + 1) * t, oh + to * t);
        }
        oh[to * t + steps[i]] = token;
      }
    }
  });
  std::vector<int64_t> done;  // sentences whose every hypothesis is finished now
  for (int64_t i = 0; i < a; i++) {
    if (std::all_of(of + i * k, of + (i + 1) * k, [](bool x) { return x; })) done.push_back(i);
  }
  return {{out_scores, out_tokens, out_back, out_history, out_eos, out_length, out_finished}, done};
}
