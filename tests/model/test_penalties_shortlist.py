"""``repetition_penalty`` and ``no_repeat_ngram_size`` with a lexical shortlist: applied in the
shortlist's columns (the ``always`` ones and each sentence's own) rather than by turning the
shortlist off, on the fused kernels and the tensor operations, greedy and beam."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from model.engine import fused, loading
from model.engine.batches import pad
from model.engine.decoding import DecodeSession, decode
from model.engine.features import detected, fused_variant
from model.engine.kernels.tables import TokenTable
from model.engine.options import DecodingOptions
from model.engine.penalties import apply_penalties
from model.engine.shortlist import Shortlist, ShortlistColumns, Vocabulary
from model.engine.translator import Translator
from model.network.transformer import Transformer
from model.training.data import read_lines
from tests.factories import V, make_model, sources
from tests.helpers import require

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

STEP_KERNELS = fused_variant(detected())
INF = math.inf


@pytest.fixture(params=["tensor-ops", "fused"])
def step_kernels(request: pytest.FixtureRequest) -> str | None:
    """The decoder step and beams on torch's tensor operations, or on this CPU's fused kernels."""
    if request.param == "tensor-ops":
        return None
    require(fused.load(STEP_KERNELS) is not None, f"the fused step kernels ({STEP_KERNELS}) do not build here")
    return STEP_KERNELS


def hand_made_columns() -> tuple[list[int], list[list[int]], ShortlistColumns]:
    """``always`` 0-3, 10 and 20 (columns 0-5); sentence 0's own 5, 7, 30 (columns 6-8), sentence
    1's own 8 (column 6)."""
    always = [0, 1, 2, 3, 10, 20]
    table = Shortlist.from_table(torch.zeros(50, 1, dtype=torch.long), torch.tensor(always))
    vocab = Vocabulary(table, TokenTable(torch.randn(50, 4)), torch.float32)
    vocab.join([torch.tensor([3, 5, 7, 10, 30]), torch.tensor([8, 20])])
    columns = vocab.columns()
    assert columns.always.tolist() == always and columns.width == 3
    return always, [[5, 7, 30], [8]], columns


def test_column_of_finds_always_and_own_columns() -> None:
    _, _, columns = hand_made_columns()
    sentence = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 0])
    ids = torch.tensor([10, 7, 30, 8, 8, 20, 7, 49, 3])
    assert columns.column_of(sentence, ids).tolist() == [4, 7, 8, -1, 6, 5, -1, -1, 3]


def test_repetition_penalty_on_an_own_column_and_an_always_column() -> None:
    """Rows 0-1 are sentence 0's, 2-3 sentence 1's: each held piece's logit, at its column in
    that row, is divided by p where positive and multiplied by p where negative; nothing else."""
    _, _, columns = hand_made_columns()
    logits = torch.arange(24, dtype=torch.float32).view(4, 6) - 10  # (R, N)
    own = torch.tensor([[1.5, -2.0, 3.0], [4.0, 0.5, -1.0], [-3.0, -INF, -INF], [2.0, -INF, -INF]])  # (R, E)
    history = torch.tensor([[10, 7, 7], [5, 3, 0], [8, 20, 30], [0, 0, 0]])  # 30: past row 2's length
    lengths = torch.tensor([3, 2, 2, 0])
    got_logits, got_own = logits.clone(), own.clone()
    options = DecodingOptions(repetition_penalty=2.0)
    apply_penalties(got_logits, history, lengths, options, columns, got_own, torch.tensor([0, 0, 1, 1]))
    want_logits, want_own = logits.clone(), own.clone()
    want_logits[0, 4] = -12.0  # row 0's 10 (always column 4): -6 x 2
    want_own[0, 1] = -4.0  # row 0's 7, held twice, penalized once (own column 1): -2 x 2
    want_logits[1, 3] = -2.0  # row 1's EOS (always column 3): -1 x 2
    want_own[1, 0] = 2.0  # row 1's 5 (own column 0): 4 / 2
    want_own[2, 0] = -6.0  # row 2's 8 (sentence 1's own column 0): -3 x 2
    want_logits[2, 5] = 3.5  # row 2's 20 (always column 5): 7 / 2
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got_own, want_own)


def test_no_repeat_bans_an_own_column_and_an_always_column() -> None:
    """The n-gram matching is on ids; the banned piece's column in its row gets -inf (a piece that
    is none of the row's columns has nowhere to go)."""
    _, _, columns = hand_made_columns()
    logits, own = torch.randn(4, 6), torch.randn(4, 3)
    own[2:, 1:] = -INF
    history = torch.tensor([[10, 7, 10], [5, 20, 5], [8, 40, 8], [8, 20, 3]])
    lengths = torch.tensor([3, 3, 3, 3])
    got_logits, got_own = logits.clone(), own.clone()
    options = DecodingOptions(no_repeat_ngram_size=2)
    apply_penalties(got_logits, history, lengths, options, columns, got_own, torch.tensor([0, 0, 1, 1]))
    want_logits, want_own = logits.clone(), own.clone()
    want_own[0, 1] = -INF  # 10 7 10 -> 7, sentence 0's own column 1
    want_logits[1, 5] = -INF  # 5 20 5 -> 20, always column 5
    # row 2: 8 40 8 -> 40, none of sentence 1's columns; row 3: no repeat
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got_own, want_own)


def in_columns(model: Transformer, table: Shortlist, options: DecodingOptions, rows: list[list[int]]) -> dict:
    """Decode with one sentence first, the others joining at the second step (so the fused kernels
    compute only the joiners' first rows), checking at every step that the shortlist's logits
    changed exactly as the whole vocabulary's penalties say -> the hypotheses by tag, and how
    many logits were penalized in always and in own columns."""
    session = DecodeSession(model, options, table)
    assert session.shortlist is not None  # kept, not turned off
    changed = {"always": 0, "own": 0}
    penalize = session._penalize

    def checked(
        logits: torch.Tensor,
        computed: torch.Tensor | None,
        columns: ShortlistColumns | None = None,
        own: torch.Tensor | None = None,
    ) -> None:
        assert columns is not None and own is not None
        before_logits, before_own = logits.clone(), own.clone()
        penalize(logits, computed, columns, own)
        a, w = session.active, session._rows.width
        index = torch.arange(a * w) if computed is None else computed
        generated = (session.steps - session._rows.row_start())[index]
        history = session._rows.beams.history[:, :w].reshape(a * w, -1)[index]
        for r, row in enumerate(index.tolist()):  # the row's scores by piece id, penalized by id
            first, count = columns.spans[row // w].tolist()
            ids = torch.cat([columns.always, columns.extra_ids[first : first + count]])
            by_id = torch.full((V,), -7.0)
            by_id[ids] = torch.cat([before_logits[r], before_own[r, :count]])
            apply_penalties(by_id[None], history[r : r + 1], generated[r : r + 1], options)
            want = by_id[ids]
            n = columns.always.numel()
            assert torch.equal(logits[r], want[:n]), (session.steps, row)
            assert torch.equal(own[r, :count], want[n:]), (session.steps, row)
            assert torch.equal(own[r, count:], before_own[r, count:])
            changed["always"] += int((logits[r] != before_logits[r]).sum())
            changed["own"] += int((own[r, :count] != before_own[r, :count]).sum())

    session._penalize = checked  # type: ignore[method-assign]
    session.admit(pad(rows[:1], 0), [0])
    done = {f.tag: f.hypotheses for f in session.step()}
    session.admit(pad(rows[1:], 0), range(1, len(rows)))
    while session.active:
        done.update({f.tag: f.hypotheses for f in session.step()})
    return {"hypotheses": done, **changed}


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize(("penalty", "n"), [(1.3, 0), (1.0, 2), (1.2, 3)])
def test_a_random_models_penalized_logits_in_columns_are_the_whole_vocabularys(
    step_kernels: str | None, beam_size: int, penalty: float, n: int
) -> None:
    """A random tiny model (which loops by nature) and a narrow hand-made shortlist (``always``
    the specials and every fifth piece, three targets a source piece): at every step each
    row's penalized logits are exactly those of its scores laid out by piece id and penalized
    there, pieces in both kinds of columns are penalized, and no hypothesis repeats an n-gram."""
    model = make_model(seed=4)
    model.fused_step = step_kernels
    gen = torch.Generator().manual_seed(0)
    always = torch.cat([torch.arange(4), torch.arange(5, V, 5)])
    table = Shortlist.from_table(torch.randint(4, V, (V, 3), generator=gen), always)
    options = DecodingOptions(beam_size=beam_size, n_best=beam_size, repetition_penalty=penalty, no_repeat_ngram_size=n)
    got = in_columns(model, table, options, sources(6, seed=3))
    assert got["always"] > 0 and got["own"] > 0
    for hyps in got["hypotheses"].values():
        for h in hyps:
            grams = [tuple(h.ids[i : i + n]) for i in range(len(h.ids) - n + 1)] if n else []
            assert len(grams) == len(set(grams)), h.ids


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize(("penalty", "n"), [(1.3, 0), (1.0, 2), (1.2, 3)])
def test_a_shortlist_of_every_piece_penalizes_exactly_as_the_whole_vocabulary(
    step_kernels: str | None, beam_size: int, penalty: float, n: int
) -> None:
    """Every piece a candidate, half of them ``always`` and half each sentence's own: the
    penalized hypotheses and scores of the whole vocabulary's, and other than unpenalized."""
    model = make_model(seed=3)
    model.fused_step = step_kernels
    table = Shortlist.from_table(torch.arange(V)[None, :].expand(V, V), torch.arange(0, V, 2))
    rows = sources(8, seed=1)
    options = DecodingOptions(beam_size=beam_size, n_best=beam_size, repetition_penalty=penalty, no_repeat_ngram_size=n)
    full = decode(model, pad(rows, 0), options).hypotheses
    short = decode(model, pad(rows, 0), options, table).hypotheses
    plain = decode(model, pad(rows, 0), DecodingOptions(beam_size=beam_size, n_best=beam_size), table).hypotheses
    for f, s in zip(full, short, strict=True):
        assert [h.ids for h in f] == [h.ids for h in s]
        assert [h.score for h in f] == pytest.approx([h.score for h in s], abs=1e-5)
    assert [h[0].ids for h in plain] != [h[0].ids for h in short]


def repeats(ids: tuple[int, ...], n: int) -> bool:
    grams = [ids[i : i + n] for i in range(len(ids) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("beam_size", [1, 5])
@pytest.mark.parametrize("direction", ["de-en", "en-de"])
def test_the_shipped_shortlists_keep_the_penalized_translations(
    shipped: Path, data_dir: Path, direction: str, beam_size: int
) -> None:
    """On the first 100 test_2016 sentences, with ``no_repeat_ngram_size`` 2 and 4 and with
    ``repetition_penalty`` 1.3: the shortlist (in use) gives the whole vocabulary's penalized
    translation for nearly all (the shortlist's own approximation aside: the bar of
    ``test_shortlist``'s unpenalized comparison), follows it on most of the sentences whose
    translation the options change (where it ignored them it would keep the unpenalized one),
    and repeats no n-gram of the size banned."""
    folder = shipped.parent / direction
    ckpt = loading.load(folder)
    table = loading.load_shortlist(folder, ckpt.config.tgt_vocab_size)
    assert table is not None
    texts = read_lines(data_dir / f"test_2016_flickr.{direction[:2]}.gz")[:100]
    full, short = Translator(ckpt.model, ckpt.tokenizer), Translator(ckpt.model, ckpt.tokenizer, shortlist=table)
    ids = full.encode(texts)
    card = loading.decoding_options(ckpt.meta, beam_size)
    plain = [h[0].ids for h in full.decode_ids(ids, dataclasses.replace(card, no_repeat_ngram_size=0))]
    changed = followed = 0
    for penalty, n in ((1.0, 2), (1.0, 4), (1.3, 0)):
        options = dataclasses.replace(card, repetition_penalty=penalty, no_repeat_ngram_size=n)
        assert DecodeSession(ckpt.model, options, table).shortlist is not None
        whole = [h[0].ids for h in full.decode_ids(ids, options)]
        listed = [h[0].ids for h in short.decode_ids(ids, options)]
        assert sum(a == b for a, b in zip(whole, listed, strict=True)) >= 0.9 * len(texts), (penalty, n)
        moved = [i for i, (w, p) in enumerate(zip(whole, plain, strict=True)) if w != p]
        changed += len(moved)
        followed += sum(listed[i] == whole[i] for i in moved)
        assert not (n and any(repeats(row, n) for row in listed)), n
    assert changed >= 10 and followed >= 2 / 3 * changed, (followed, changed)
