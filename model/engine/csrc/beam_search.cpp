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

// GNMT's length penalty ((5 + n) / 6) ** alpha, in float32 as model.engine.beams.length_penalty
inline float length_penalty(int64_t n, float alpha) {
  return alpha == 0.f ? 1.f : std::pow((5.f + static_cast<float>(n)) / 6.f, alpha);
}

// What a step of beam search chooses from: each sentence's rows of next-token logits, over the
// columns every sentence shares and, with a shortlist, over the sentence's own columns.
struct BeamCandidates {
  const float* logits;            // (rows, shared) the computed rows' logits over the shared columns
  const int64_t* logits_row;      // (A * W) sentence i's row r's logits row, -1: not computed; nullptr: i * W + r
  int64_t rows_each;              // W: rows a sentence has this step (1 at its first, else K)
  int64_t shared;                 // C: the columns every sentence shares
  const int64_t* shared_tokens;   // (C) the token of each shared column; nullptr: column j is token j
  const float* own_logits;        // (rows, own_width) each row's logits over its sentence's own columns
  int64_t own_width;              // E: own columns a row has room for (0: no shortlist)
  const int64_t* own_spans;       // (A, 2) sentence i's own columns are own_tokens[first .. first + count)
  const int64_t* own_tokens;      // the own columns' tokens, sentence after sentence
};

// The beams' state before the step: A sentences of K hypotheses each.
struct BeamState {
  int64_t sentences;              // A
  int64_t beam;                   // K
  const float* scores;            // (A, K) raw cumulative log P
  const int64_t* lengths;         // (A, K) each hypothesis' length (a finished one's, at its end)
  const bool* finished;           // (A, K)
  const bool* eos;                // (A, K) finished on EOS
  const int64_t* history;         // (A, K, T) the tokens so far
  int64_t history_length;         // T
  std::vector<int64_t> steps;     // (A) tokens each sentence has so far: where this step's token goes
};

// How a step scores and ends hypotheses.
struct BeamRules {
  float length_alpha;             // GNMT's length penalty exponent (0: none)
  int64_t eos_id, pad_id;
};

// The beams' state after the step (each (A, K) but back and history).
struct BeamOutputs {
  float* scores;
  int64_t* tokens;                // the token each hypothesis took this step
  int64_t* back;                  // (A * K) the row of the A * W each hypothesis continues (beam search only)
  int64_t* history;               // (A, K, T)
  bool* eos;
  int64_t* lengths;
  bool* finished;
};

// advance's arguments checked: shapes, dtypes, and every index within what it indexes.
void check_advance(const torch::Tensor& logits, const torch::Tensor& own, const torch::Tensor& vocab,
                   const torch::Tensor& extra, const torch::Tensor& spans, const torch::Tensor& start, int64_t now,
                   const torch::Tensor& scores, const torch::Tensor& lengths, const torch::Tensor& finished,
                   const torch::Tensor& eos, const torch::Tensor& history, const torch::Tensor& rows) {
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
  if (owned) span_data(spans, ec, extra.numel(), "advance");
  const auto joined = start.contiguous();
  for (int64_t i = 0; i < a; i++) {
    const int64_t step = now - joined.data_ptr<int64_t>()[i];
    TORCH_CHECK(step >= 0 && step < history.size(2), "history has no room at step ", step);
  }
}

// The step itself, on checked arguments: each sentence's rows' best K continuations, then its K
// best of those (the ``top_k``s keep the earlier of equal values, so the choice never depends on
// the thread), written to `out`.
void advance_beams(const BeamCandidates& in, const BeamState& state, const BeamRules& rules, const BeamOutputs& out) {
  const int64_t k = state.beam, w = in.rows_each, c = in.shared, t = state.history_length;
  parallel_chunks(0, state.sentences, std::max<int64_t>(1, kGrainWork / (w * c)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(c + in.own_width), row_best(w * k), best(k);
    std::vector<int64_t> row_index(w * k), index(k);
    for (int64_t i = begin; i < end; i++) {
      const int64_t step = state.steps[i];
      // the shared columns, then its own
      const int64_t candidates = in.own_spans != nullptr ? c + in.own_spans[2 * i + 1] : c;
      const float scale = length_penalty(step + 1, rules.length_alpha);
      for (int64_t r = 0; r < w; r++) {
        const int64_t hyp = i * k + r;
        float* rb = &row_best[r * k];
        if (state.finished[hyp]) {  // a finished hypothesis competes once, its normalized score in the live ones' raw scale
          std::fill(rb, rb + k, -INFINITY);
          rb[0] = state.scores[hyp] / length_penalty(state.lengths[hyp], rules.length_alpha) * scale;
          continue;
        }
        const int64_t from_row = in.logits_row == nullptr ? i * w + r : in.logits_row[i * w + r];
        if (from_row < 0) {  // not computed: a copy of the sentence's first row at -inf
          TORCH_CHECK(state.scores[hyp] == -INFINITY, "advance: row ", r, " of sentence ", i,
                      " has a score but no logits");
          std::fill(rb, rb + k, -INFINITY);
          for (int64_t j = 0; j < k; j++) row_index[r * k + j] = j;
          continue;
        }
        const float* logits = in.logits + from_row * c;  // log-softmax, then the row's k best columns
        std::copy(logits, logits + c, row.data());
        if (in.own_logits != nullptr) {
          const float* own = in.own_logits + from_row * in.own_width;
          std::copy(own, own + (candidates - c), row.data() + c);
        }
        const float top = maximum(row.data(), candidates);
        // fewer candidates than K (a shortlist with a tiny ``always``): the rest -inf, token PAD
        std::fill(rb, rb + k, -INFINITY);
        std::fill(&row_index[r * k], &row_index[r * k] + k, -1);
        top_k(candidates, std::min(k, candidates), [&row](int64_t j) { return row[j]; }, rb, &row_index[r * k]);
        const float log_sum = std::log(exp_shifted(row.data(), candidates, top));
        for (int64_t j = 0; j < k; j++) rb[j] = (rb[j] - top) - log_sum + state.scores[hyp];
      }
      top_k(w * k, k, [&](int64_t j) { return row_best[j]; }, best.data(), index.data());
      for (int64_t j = 0; j < k; j++) {
        const int64_t beam = index[j] / k, from = i * k + beam, to = i * k + j;
        const bool was_finished = state.finished[from];
        const int64_t column = row_index[index[j]];
        const int64_t token = was_finished || column < 0 ? rules.pad_id
                              : column >= c               ? in.own_tokens[in.own_spans[2 * i] + column - c]
                              : in.shared_tokens != nullptr ? in.shared_tokens[column]
                                                            : column;
        out.scores[to] = was_finished ? state.scores[from] : best[j];
        out.lengths[to] = was_finished ? state.lengths[from] : step + 1;
        out.tokens[to] = token;
        out.eos[to] = was_finished ? state.eos[from] : token == rules.eos_id;
        out.finished[to] = was_finished || out.eos[to];
        if (k > 1) {
          out.back[to] = i * w + beam;
          std::copy(state.history + from * t, state.history + (from + 1) * t, out.history + to * t);
        }
        out.history[to * t + step] = token;
      }
    }
  });
}

}  // namespace

// One step of beam search's bookkeeping: model.engine.beams.Beams.advance, the same rules.
// logits (A, W, C) float32 next-token logits of each sentence's first W rows (W = 1 at a batch's
// first step, else K), column j token j, or vocab[j] when vocab (C,) int64 is given (not empty).
// With a shortlist (model.engine.shortlist.Vocabulary) the logits are the N columns every sentence shares
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
// finished now]). Greedy search (K = 1) never sees a finished row. The arguments are checked by
// check_advance and gathered into the structs above once; advance_beams is the step itself.
std::tuple<std::vector<torch::Tensor>, std::vector<int64_t>> advance(
    const torch::Tensor& logits, const torch::Tensor& own, const torch::Tensor& vocab, const torch::Tensor& extra,
    const torch::Tensor& spans, const torch::Tensor& start, int64_t now, const torch::Tensor& scores,
    const torch::Tensor& lengths, const torch::Tensor& finished, const torch::Tensor& eos, torch::Tensor history,
    double alpha, int64_t eos_id, int64_t pad_id, const torch::Tensor& rows) {
  check_advance(logits, own, vocab, extra, spans, start, now, scores, lengths, finished, eos, history, rows);
  const bool some = rows.numel() > 0, mapped = vocab.numel() > 0, owned = spans.numel() > 0;
  const int64_t a = scores.size(0), k = scores.size(-1);
  BeamCandidates in;
  in.logits = logits.data_ptr<float>();
  in.logits_row = some ? rows.data_ptr<int64_t>() : nullptr;
  in.rows_each = some ? rows.numel() / a : logits.size(1);
  in.shared = logits.size(-1);
  in.shared_tokens = mapped ? vocab.data_ptr<int64_t>() : nullptr;
  in.own_logits = owned ? own.data_ptr<float>() : nullptr;
  in.own_width = owned ? own.size(-1) : 0;
  in.own_spans = owned ? spans.data_ptr<int64_t>() : nullptr;
  in.own_tokens = owned ? extra.data_ptr<int64_t>() : nullptr;
  // (contiguous copies where they are not, kept for the pointers)
  const auto state_scores = scores.contiguous(), state_lengths = lengths.expand({a, k}).contiguous();
  const auto state_finished = finished.contiguous(), state_eos = eos.contiguous(), joined = start.contiguous();
  BeamState state;
  state.sentences = a;
  state.beam = k;
  state.scores = state_scores.data_ptr<float>();
  state.lengths = state_lengths.data_ptr<int64_t>();
  state.finished = state_finished.data_ptr<bool>();
  state.eos = state_eos.data_ptr<bool>();
  state.history = history.data_ptr<int64_t>();
  state.history_length = history.size(2);
  state.steps.resize(a);
  for (int64_t i = 0; i < a; i++) state.steps[i] = now - joined.data_ptr<int64_t>()[i];
  auto out_scores = torch::empty({a, k}, scores.options());
  auto out_tokens = torch::empty({a, k}, start.options());
  auto out_eos = torch::empty({a, k}, eos.options());
  auto out_finished = torch::empty({a, k}, finished.options());
  auto out_length = torch::empty({a, k}, start.options());
  auto out_back = torch::empty({k > 1 ? a * k : 0}, start.options());
  auto out_history = k > 1 ? torch::empty_like(history) : history;  // greedy: written in place
  const BeamOutputs out{out_scores.data_ptr<float>(),  out_tokens.data_ptr<int64_t>(), out_back.data_ptr<int64_t>(),
                        out_history.data_ptr<int64_t>(), out_eos.data_ptr<bool>(),     out_length.data_ptr<int64_t>(),
                        out_finished.data_ptr<bool>()};
  advance_beams(in, state, BeamRules{static_cast<float>(alpha), eos_id, pad_id}, out);
  std::vector<int64_t> done;  // sentences whose every hypothesis is finished now
  for (int64_t i = 0; i < a; i++) {
    if (std::all_of(out.finished + i * k, out.finished + (i + 1) * k, [](bool x) { return x; })) done.push_back(i);
  }
  return {{out_scores, out_tokens, out_back, out_history, out_eos, out_length, out_finished}, done};
}
