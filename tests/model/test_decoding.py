"""Incremental decoding with the KV cache, greedy and beam search, batching invariance."""

from __future__ import annotations

import math

import pytest
import torch

from bench import naive
from model.engine import fused
from model.engine.batches import pad
from model.engine.beams import TOP_K_BLOCK, Hypothesis, top_k
from model.engine.cache import Spare, init_cache
from model.engine.decoding import DecodeSession, decode, decode_stream
from model.engine.encoder import EncoderPass
from model.engine.features import detected, fused_variant
from model.engine.options import DecodingOptions
from model.engine.step import DecoderStep
from model.network.transformer import Transformer
from tests.factories import V, assert_steps_match, sources
from tests.factories import make_model as make_plain_model
from tests.helpers import require

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

# A vocabulary large enough for decoding's blocked top-k on the CPU (V = 60 uses torch.topk).
BIG_V = 40 * TOP_K_BLOCK + 17


STEP_KERNELS = fused_variant(detected())
_kernels_of_this_run: dict[str, str | None] = {"variant": None}


@pytest.fixture(autouse=True, params=["tensor-ops", "fused"])
def step_kernels(request: pytest.FixtureRequest) -> str | None:
    """Every test here twice: the decoder step and beam bookkeeping on torch's tensor operations,
    and on the fused kernels (``model.engine.fused``) this CPU runs."""
    variant = None
    if request.param == "fused":
        require(fused.load(STEP_KERNELS) is not None, f"the fused step kernels ({STEP_KERNELS}) do not build here")
        variant = STEP_KERNELS
    _kernels_of_this_run["variant"] = variant
    return variant


def make_model(seed: int = 0, vocab: int = V, **overrides: object) -> Transformer:
    """``tests.factories.make_model``, on the step kernels of the running parametrization."""
    model = make_plain_model(seed, vocab, **overrides)
    model.fused_step = _kernels_of_this_run["variant"]
    return model


@pytest.mark.parametrize("columns", [BIG_V, 40 * TOP_K_BLOCK, 3 * TOP_K_BLOCK + 5, 7])
@pytest.mark.parametrize("k", [1, 4, 5])
def test_top_k_matches_torch_topk(columns: int, k: int) -> None:
    x = torch.randn(33, columns, generator=torch.Generator().manual_seed(columns + k))
    x[3] = -float("inf")  # a row of a finished hypothesis: all blocked but one
    x[3, columns - 1] = 0.0
    expected = x.topk(k, dim=-1)
    values, columns_ = top_k(x, k)
    assert torch.equal(values, expected.values)
    assert torch.equal(columns_[:, 0], expected.indices[:, 0])  # later -inf ties may differ
    assert torch.equal(columns_[[i for i in range(33) if i != 3]], expected.indices[[i for i in range(33) if i != 3]])


@pytest.mark.parametrize("inference", [True, False], ids=["bound-kernels", "module-linears"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_cached_steps_match_full_recomputation(norm_first: bool, positions: str, inference: bool) -> None:
    """The incremental step (``model.engine.step``, on the KV cache, padded sources) = the modules'
    teacher-forced pass, with the weights bound to the CPU's kernels (inference mode, what
    decoding runs) and through the modules' linears (grad enabled)."""
    model = make_model(norm_first=norm_first, positions=positions)
    src = pad(sources(4), 0)
    assert (src == 0).any()  # the source mask blocks something
    tgt = torch.randint(4, V, (4, 9))
    tgt[:, 0] = 2
    with torch.no_grad():
        full = model(src, tgt)  # (B, T, V), teacher-forced, no cache
    with torch.inference_mode(inference):
        assert_steps_match(model, src, tgt, full, tol=1e-5)


@pytest.mark.parametrize("inference", [True, False], ids=["bound-kernels", "module-linears"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_the_encoder_pass_matches_the_modules(norm_first: bool, positions: str, inference: bool) -> None:
    """``EncoderPass`` (what a decoding session admits sentences with) gives the modules'
    encoder output and mask, for padded batches of short sources (the explicit attention path)
    and longer ones (SDPA), post-LN and pre-LN, on bound kernels (inference mode) and through
    the modules' linears (grad enabled); on the fused kernels' attention and joins (the
    ``step_kernels`` parametrization) to float rounding."""
    model = make_model(norm_first=norm_first, positions=positions)
    with torch.inference_mode(inference):
        encoder = EncoderPass(model)
        for rows in (sources(3, seed=2, min_len=1, max_len=6), sources(5, seed=3, min_len=2, max_len=30)):
            src = pad(rows, 0)
            expected, expected_mask, _ = model.encode(src)
            memory, mask = encoder(src)
            assert torch.equal(mask, expected_mask)
            torch.testing.assert_close(memory, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_encoder_pass_encodes_a_long_batch_in_groups_of_sentences(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More padded positions than ``ENCODER_CHUNK_TOKENS``: the sentences go through the layers
    in groups that fit it (at least one sentence each), and the batch's memory is the one-pass
    encoder's (float32: to rounding; int8 quantizes each group's activations with a scale of
    its own where fbgemm runs them, so both are as close to the float32 encoder as int8 gets; the
    fused kernels' int8 product quantizes each row apart, and then the two are equal)."""
    from model.engine import encoder as step_module
    from model.engine import kernels

    model = make_model(seed=5)
    src = pad(sources(7, seed=4, min_len=20, max_len=30), 0)  # (7, S), 21 <= S <= 31
    with torch.inference_mode():
        exact = model.encode(src)[0]  # float32, the modules' encoder
    if dtype == "int8":
        try:
            plan = kernels.choose("cpu", "int8")
        except kernels.UnsupportedPrecision as err:
            pytest.skip(str(err))
        kernels.install(model, plan, model.step_linears())
    with torch.inference_mode():
        encoder = EncoderPass(model)
        whole, whole_mask = encoder(src)  # 7 x S < 1,024 positions: one pass
        groups: list[int] = []
        one_pass = encoder._encode

        def counted(part: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            groups.append(part.shape[0])
            return one_pass(part, mask)

        monkeypatch.setattr(encoder, "_encode", counted)
        monkeypatch.setattr(step_module, "ENCODER_CHUNK_TOKENS", 2 * src.shape[1])
        memory, mask = encoder(src)
    assert groups == [2, 2, 2, 1]
    assert torch.equal(mask, whole_mask)
    if dtype == "float32":
        torch.testing.assert_close(memory, whole, atol=1e-6, rtol=1e-6)
    else:  # 8-bit weights and activations through three layers: a few percent either way
        for encoded in (memory, whole):
            assert (encoded - exact).norm() / exact.norm() < 0.05
        if fused.int8_rows_limit(model.fused_step) >= whole.numel() // whole.shape[-1]:
            # the fused kernels' int8 product quantizes each row apart: groups change nothing
            assert torch.equal(memory, whole)
        else:  # fbgemm's: each group had its own activation scales
            assert not torch.equal(memory, whole)


def test_a_step_with_beams_and_late_rows_matches_each_row_alone(step_kernels: str | None) -> None:
    """Rows sharing a sentence's memory (width 3) and rows masked to the keys after they
    joined, at their own positions: each row's logits are those of its history decoded alone
    (on the tensor operations and on the fused kernels)."""
    model = make_model(seed=7)
    src = pad(sources(2, seed=3), 0)
    history = torch.randint(4, V, (6, 4))
    history[:, 0] = 2
    with torch.inference_mode():
        memory, mask, _ = model.encode(src)
        width = 3
        full = model.decode(history, memory.repeat_interleave(width, 0), mask.repeat_interleave(width, 0))[0]
        cache = init_cache(model, memory, capacity=8)
        cache.reorder(torch.arange(2).repeat_interleave(width), width=width)
        step = DecoderStep(model)
        assert (step.fused is None) == (step_kernels is None)
        for t in range(4):
            logits = step(history[:, t], cache, mask)
            torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=1e-5)
        # rows 3-5 (the second sentence) start over at position 0, hiding the 4 keys before
        late = torch.tensor([3, 4, 5])
        positions = torch.tensor([4, 4, 4, 0, 0, 0])
        keys_seen = torch.ones(6, 1, 1, 5, dtype=torch.bool)
        keys_seen[late, :, :, :4] = False
        tokens = torch.cat([torch.randint(4, V, (3,)), history[late, 0]])
        logits = step(tokens, cache, mask, positions, keys_seen)
        alone = model.decode(history[late, :1], memory[1:].repeat(width, 1, 1), mask[1:].repeat(width, 1, 1, 1))[0]
        torch.testing.assert_close(logits[late], alone[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [V, BIG_V])
def test_greedy_matches_the_uncached_one_sentence_decoder(vocab: int) -> None:
    """Greedy search (a beam of one over the cache, batched) = argmax over a full recomputation
    of the prefix at every step, one sentence at a time (the tutorials' decoder)."""
    model = make_model(vocab=vocab)
    rows = sources(6, vocab=vocab)
    opts = DecodingOptions(beam_size=1)
    batched = decode(model, pad(rows, 0), opts).hypotheses
    for row, hyps in zip(rows, batched, strict=True):
        assert list(hyps[0].ids) == naive.greedy_ids(model, row[:-1], opts)


def test_confidence_is_the_geometric_mean_of_the_pieces_probabilities() -> None:
    """``Hypothesis.confidence`` (``details.confidence``): 100 * exp(log P / pieces), EOS counted
    where the hypothesis finished, log P the teacher-forced log-probabilities of the pieces
    greedy search returned (no options that change the scores)."""
    model = make_model()
    rows = sources(5)
    opts = DecodingOptions(beam_size=1, max_length=40)
    src = pad(rows, 0)
    hypotheses = [h[0] for h in decode(model, src, opts).hypotheses]
    for i, hyp in enumerate(hypotheses):
        ids = [*hyp.ids, 3] if hyp.finished else list(hyp.ids)  # (3: EOS)
        with torch.inference_mode():
            logits = model(src[i : i + 1], torch.tensor([[2, *ids[:-1]]]))[0]  # (T, V)
        log_p = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).sum().item()
        assert hyp.log_prob == pytest.approx(log_p, abs=1e-3)
        assert hyp.confidence == round(100 * math.exp(log_p / len(ids)))
    assert min(h.confidence for h in hypotheses) > 0 and max(h.confidence for h in hypotheses) <= 100
    sure = Hypothesis(ids=(5, 6, 7), score=0.0, log_prob=4 * math.log(0.5), finished=True)
    assert sure.confidence == 50 and Hypothesis((), 0.0, 0.0, False).confidence == 100


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_larger_beam_never_scores_worse_than_greedy(alpha: float) -> None:
    model = make_model(seed=3)
    src = pad(sources(16, seed=5), 0)
    greedy = decode(model, src, DecodingOptions(beam_size=1, length_penalty=alpha)).hypotheses
    for k in (2, 4, 8):
        beam = decode(model, src, DecodingOptions(beam_size=k, length_penalty=alpha)).hypotheses
        for g, b in zip(greedy, beam, strict=True):
            assert b[0].score >= g[0].score - 1e-5


@pytest.mark.parametrize("vocab", [V, BIG_V])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_mixed_length_batch_matches_each_sentence_alone(beam_size: int, vocab: int) -> None:
    model = make_model(seed=2, vocab=vocab)
    rows = sources(7, seed=9, min_len=1, max_len=20, vocab=vocab)
    opts = DecodingOptions(beam_size=beam_size, n_best=beam_size)
    batched = decode(model, pad(rows, 0), opts).hypotheses
    for row, together in zip(rows, batched, strict=True):
        alone = decode(model, pad([row], 0), opts).hypotheses[0]
        assert [h.ids for h in alone] == [h.ids for h in together]
        for a, t in zip(alone, together, strict=True):
            assert a.score == pytest.approx(t.score, abs=1e-4)


def reference_beam_search(
    model: torch.nn.Module, row: list[int], k: int, alpha: float, limit: int
) -> list[tuple[tuple[int, ...], float, bool]]:
    """Beam search as the textbook states it, one sentence, every prefix recomputed without a
    cache: each step, every live hypothesis's V continuations and every finished hypothesis
    itself compete on GNMT-normalized score; the K best stay; done when all K are finished
    (EOS) or ``limit`` tokens were generated. -> (ids without EOS, normalized score, finished)."""
    eos, bos = model.config.eos_id, model.config.bos_id
    src = torch.tensor([row])
    beams: list[tuple[list[int], float, bool]] = [([], 0.0, False)]  # ids (EOS included), raw log P, finished

    def lp(n: int) -> float:
        return ((5.0 + n) / 6.0) ** alpha

    for t in range(limit):
        candidates = []
        for ids, raw, finished in beams:
            if finished:
                candidates.append((raw / lp(len(ids)), ids, raw, True))
                continue
            with torch.no_grad():
                logits = model(src, torch.tensor([[bos, *ids]]))[0, -1]
            logp = torch.log_softmax(logits.double(), dim=-1).tolist()
            for tok, lp_tok in enumerate(logp):
                candidates.append(((raw + lp_tok) / lp(t + 1), [*ids, tok], raw + lp_tok, tok == eos))
        candidates.sort(key=lambda c: -c[0])
        beams = [(ids, raw, fin) for _, ids, raw, fin in candidates[:k]]
        if all(fin for _, _, fin in beams):
            break
    return [(tuple(ids[:-1] if fin else ids), raw / lp(len(ids)), fin) for ids, raw, fin in beams]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_beam_search_matches_the_textbook_search(beam_size: int, alpha: float) -> None:
    """The batched search (top-k per row first, finished hypotheses mapped into the live ones'
    raw scale, the shorter paths while nothing is finished, greedy's argmax) returns the
    n-best of the plain one, sentences of a batch finishing at different steps, some at the
    length limit."""
    model = make_model(seed=8)
    rows = sources(6, seed=17, max_len=10)
    with torch.no_grad():  # EOS about as likely as the token greedy search emits most
        greedy = decode(model, pad(rows, 0), DecodingOptions(beam_size=1)).hypotheses
        emitted = [t for hyps in greedy for t in hyps[0].ids]
        tokens = model.tgt_embed.tokens.weight
        tokens[model.config.eos_id] = tokens[max(set(emitted), key=emitted.count)] * 1.02
    opts = DecodingOptions(beam_size, n_best=beam_size, length_penalty=alpha, max_length_a=0.0, max_length_b=7)
    got = decode(model, pad(rows, 0), opts).hypotheses
    finished_flags = set()
    for row, hyps in zip(rows, got, strict=True):
        expected = reference_beam_search(model, row, beam_size, alpha, limit=7)
        assert [h.ids for h in hyps] == [ids for ids, _, _ in expected]
        for h, (_, score, finished) in zip(hyps, expected, strict=True):
            assert h.finished == finished
            assert h.score == pytest.approx(score, abs=1e-4)
            finished_flags.add(finished)
    assert finished_flags == {True, False}  # both EOS-finished and truncated hypotheses occur


@pytest.mark.parametrize("vocab", [V, BIG_V])
def test_n_best_sorted_and_distinct(vocab: int) -> None:
    model = make_model(seed=4, vocab=vocab)
    src = pad(sources(5, seed=11, vocab=vocab), 0)
    for hyps in decode(model, src, DecodingOptions(beam_size=6, n_best=6)).hypotheses:
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({h.ids for h in hyps}) == len(hyps) == 6


def test_length_limit_and_truncated_flag() -> None:
    model = make_model(seed=6)
    src = pad(sources(3), 0)
    for beam in (1, 3):
        out = decode(model, src, DecodingOptions(beam_size=beam, max_length=3)).hypotheses
        for hyps in out:
            h = hyps[0]
            assert len(h.ids) + int(h.finished) <= 3
            assert h.finished or len(h.ids) == 3
    # max_length_a * source + b, capped by the model's positions
    long_src = pad([[*list(range(4, 50)), 3]], 0)
    h = decode(model, long_src, DecodingOptions(beam_size=1, max_length_a=10, max_length_b=100)).hypotheses[0][0]
    assert len(h.ids) + int(h.finished) <= model.config.max_positions - 1


def test_options_are_validated() -> None:
    with pytest.raises(ValueError):
        DecodingOptions(beam_size=0)
    with pytest.raises(ValueError):
        DecodingOptions(beam_size=2, n_best=3)
    with pytest.raises(ValueError):
        DecodingOptions(max_length=0)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_stream_yields_each_sentence_once_when_it_is_done(beam_size: int) -> None:
    model = make_model(seed=2)
    src = pad(sources(9, seed=13, min_len=1, max_len=20), 0)
    opts = DecodingOptions(beam_size=beam_size)
    stream = list(decode_stream(model, src, opts))
    assert sorted(d.tag for d in stream) == list(range(9))
    steps = [d.steps for d in stream]
    assert steps == sorted(steps) and len(set(steps)) > 1  # in finishing order, not all at the end
    for d in stream:  # a sentence is yielded at the step it finished on
        h = d.hypotheses[0]
        assert not h.finished or len(h.ids) + 1 <= d.steps
    assert [d.hypotheses for d in sorted(stream, key=lambda d: d.tag)] == decode(model, src, opts).hypotheses


@pytest.mark.parametrize("vocab", [V, BIG_V])
@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("poisoned", [False, True])
def test_sentences_joining_a_running_batch_decode_as_if_alone(
    beam_size: int, vocab: int, poisoned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Continuous batching: sentences admitted between steps of a running session (shorter and
    longer sources than those decoding, while others finish and leave) get exactly the
    hypotheses and scores they get alone. ``poisoned``: every buffer the KV cache allocates to
    reorder into starts as NaN (``Spare.take``'s, rewritten here), so a position a reorder
    leaves uncopied (a late joiner's positions from before it joined, on the fused kernels)
    would show if anything read it."""
    if poisoned:

        def nan_filled(self: Spare, like: torch.Tensor, needed: int, extra: int) -> torch.Tensor:
            buffer = self._buffers.pop() if self._buffers else None
            if buffer is None or buffer.numel() < needed:
                buffer = like.new_full((needed + extra,), float("nan"))
            return buffer

        monkeypatch.setattr(Spare, "take", nan_filled)
    model = make_model(seed=2, vocab=vocab)
    opts = DecodingOptions(beam_size=beam_size, n_best=beam_size)
    rows = [sources(1, seed=3, min_len=30, max_len=30, vocab=vocab)[0], *sources(15, seed=21, max_len=24, vocab=vocab)]
    alone = [decode(model, pad([row], 0), opts) for row in rows]
    # The longest source starts alone; a short one joins a step before it finishes, so when it
    # leaves, the cache forgets positions and the encoder memory shrinks; the rest come and go.
    short = min((i for i in range(1, 16) if alone[i].steps >= 2), key=lambda i: len(rows[i]))
    arrivals: dict[int, list[int]] = {0: [0], alone[0].steps - 1: [short]}
    others = [i for i in range(1, 16) if i != short]
    for i, when in zip(others, [1, 2, 2, 3, 5, 5, 5, 6, 9, 9, 14, 14, 15, 32], strict=True):
        arrivals.setdefault(when, []).append(i)
    session = DecodeSession(model, opts)
    results: dict[int, list] = {}
    step, trace = 0, []
    while len(results) < len(rows):
        joining = arrivals.get(step, [])
        if joining:
            session.admit(pad([rows[i] for i in joining], 0), joining)
        for done in session.step():
            assert done.tag not in results and done.steps == alone[done.tag].steps
            results[done.tag] = done.hypotheses
        trace.append((session.active, session.source_width))
        step += 1
    assert max(active for active, _ in trace) > 4  # the batch really was shared
    assert (trace[alone[0].steps - 1][1] < len(rows[0])) and trace[alone[0].steps - 1][0] > 0
    for i, expected in enumerate(alone):
        got = results[i]
        assert [h.ids for h in got] == [h.ids for h in expected.hypotheses[0]], i
        for a, t in zip(expected.hypotheses[0], got, strict=True):
            assert t.finished == a.finished
            assert t.score == pytest.approx(a.score, abs=1e-4)
            assert t.log_prob == pytest.approx(a.log_prob, abs=1e-4)


def test_an_emptied_session_starts_over() -> None:
    model = make_model(seed=5)
    rows = sources(3, seed=2)
    opts = DecodingOptions(beam_size=3)
    session = DecodeSession(model, opts)
    expected = decode(model, pad(rows, 0), opts).hypotheses
    for _ in range(2):
        session.admit(pad(rows, 0), [7, 8, 9])
        got = {}
        while session.active:
            got.update({d.tag: d.hypotheses for d in session.step()})
        assert [got[t] for t in (7, 8, 9)] == expected
        assert session.steps == 0


def test_greedy_sentences_leave_without_copying_the_rows_that_stay() -> None:
    """When sentences finish in a greedy batch, the rows behind them fill their places in the
    same self-attention buffers (``KVCache.compact``): no step after a departure gathers the
    cache into another buffer unless its layout had to grow; the hypotheses are those of
    each sentence alone."""
    model = make_model(seed=2)
    rows = sources(12, seed=9, min_len=1, max_len=20)
    opts = DecodingOptions(beam_size=1)
    alone = [decode(model, pad([row], 0), opts).hypotheses[0] for row in rows]
    session = DecodeSession(model, opts)
    session.admit(pad(rows, 0), list(range(len(rows))))
    got: dict[int, list] = {}
    in_place = 0
    while session.active:
        left = session.step()
        got.update({d.tag: d.hypotheses for d in left})
        if not left or not session.active:
            continue
        cache = session._cache
        assert cache is not None
        layer = cache.layers[0].self_attention
        before = (layer._k.data_ptr(), layer.slots)
        got.update({d.tag: d.hypotheses for d in session.step()})  # its sync moves the rows
        if session._cache is cache and layer.slots == before[1]:
            assert layer._k.data_ptr() == before[0]
            in_place += 1
    assert in_place >= 2 and sorted(got) == list(range(len(rows)))
    for i, expected in enumerate(alone):
        assert [h.ids for h in got[i]] == [h.ids for h in expected], i
        assert got[i][0].score == pytest.approx(expected[0].score, abs=1e-4)


@pytest.mark.parametrize("inference", [True, False], ids=["bound-kernels", "module-linears"])
def test_the_step_projects_the_memory_as_the_modules_do(inference: bool) -> None:
    """``DecoderStep.project_memory`` (what sessions admit sentences with) = the modules' cross
    K/V projection, contiguous (B, H, S, Dh) for every layer."""
    model = make_model(seed=9)
    memory = torch.randn(3, 7, model.config.d_model)
    with torch.inference_mode(inference):
        expected = model.project_memory(memory)
        got = DecoderStep(model).project_memory(memory)
    assert len(got) == len(expected) == model.config.decoder_layers
    for (k, v), (ek, ev) in zip(got, expected, strict=True):
        assert k.is_contiguous() and v.is_contiguous() and k.shape == ek.shape == (3, 4, 7, 8)
        torch.testing.assert_close(k, ek, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v, ev, atol=1e-6, rtol=1e-6)


def test_the_step_projects_only_the_tokens_of_a_padded_memory(step_kernels: str | None) -> None:
    """With the memory's mask, the fused step projects the sentences' tokens alone: K, V equal
    the modules' at every token and are zeros at the padding (which the mask hides); on tensor
    operations the step projects every position, as the modules do."""
    model = make_model(seed=9)
    lengths = [7, 3, 5]
    mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]  # (3, 1, 1, 7)
    memory = torch.randn(3, 7, model.config.d_model)  # not zeros at the padding: they must not be projected
    with torch.inference_mode():
        step = DecoderStep(model)
        assert (step.fused is not None) == (step_kernels is not None)
        expected = model.project_memory(memory)
        got = step.project_memory(memory, mask)
    hidden = ~mask[:, 0, 0]  # (3, 7)
    seen = mask[:, 0, 0][:, None, :, None]  # (3, 1, 7, 1) over (B, H, S, Dh)
    for (k, v), (ek, ev) in zip(got, expected, strict=True):
        assert k.is_contiguous() and v.is_contiguous() and k.shape == ek.shape == (3, 4, 7, 8)
        for got_t, expected_t in ((k, ek), (v, ev)):
            torch.testing.assert_close(got_t * seen, expected_t * seen, atol=1e-6, rtol=1e-6)
            padding = got_t.permute(0, 2, 1, 3)[hidden]  # (padded positions, H, Dh)
            if step_kernels is None:
                torch.testing.assert_close(padding, expected_t.permute(0, 2, 1, 3)[hidden], atol=1e-6, rtol=1e-6)
            else:
                assert padding.abs().max() == 0
