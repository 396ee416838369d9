"""The lexical shortlist (model/engine/shortlist.py): how it is built, how a session keeps its sentences'
own candidates beside the shared ones, and that decoding through it maps columns back to the right
tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from model import checkpoint
from model.engine import fused, kernels, loading
from model.engine.batches import pad
from model.engine.decoding import DecodeSession, decode
from model.engine.features import detected, fused_variant
from model.engine.kernels.tables import TokenTable
from model.engine.options import DecodingOptions
from model.engine.shortlist import Shortlist, ShortlistColumns, Vocabulary, build
from model.engine.translator import Translator
from model.network.transformer import Transformer
from model.training import shortlists
from model.training.data import read_lines
from tests.factories import V, make_model
from tests.helpers import require

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]


def sources(n: int, seed: int, max_len: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, V) for _ in range(rng.randint(2, max_len))] + [3] for _ in range(n)]


def test_build_keeps_each_source_pieces_associated_targets_and_the_frequent_ones() -> None:
    # source 10 always comes with target 20, 11 with 21 (and half the time 22); 30 is everywhere
    pairs = [([10, 4], [20, 30]), ([10], [20, 30]), ([11, 4], [21, 30]), ([11], [21, 22, 30]), ([5], [30])] * 3
    table = build(pairs, vocab_size=40, per_source=2, frequent=1)
    assert table.vocab_size == 40 and table.per_source == 2
    assert table.row(10).tolist() == [20, 30]  # Dice 1.0, then 12 / 21
    assert table.row(11).tolist() == [21, 22]  # Dice 1.0, then 6 / 9 (above 30's 12 / 21)
    assert table.row(5).tolist() == [30]  # one association only
    assert table.row(4).tolist()[0] == 30 and table.row(4).numel() == 2  # 12 / 21, then 20 or 21 (6 / 12 each)
    assert table.row(6).tolist() == []  # never seen
    assert table.always.tolist() == [0, 1, 2, 3, 30]  # specials and the most frequent target
    assert table.targets.numel() == 7  # only what rows hold: 2 + 2 + 1 + 2


def test_candidates_are_the_pieces_and_their_associations() -> None:
    rows = torch.tensor([[0, 0], [0, 0], [0, 0], [0, 0], [7, 8], [9, 0], [0, 0], [0, 0], [0, 0], [0, 0]])
    table = Shortlist.from_table(rows, torch.tensor([0, 1, 2, 3]))
    assert table.offsets.tolist() == [0, 0, 0, 0, 0, 2, 3, 3, 3, 3, 3] and table.targets.tolist() == [7, 8, 9]
    assert table.candidates(torch.tensor([4, 5, 3, 0, 4])).tolist() == [0, 3, 4, 5, 7, 8, 9]
    batch = torch.tensor([[4, 5, 3, 0], [9, 3, 0, 0], [6, 4, 3, 0]])  # padded with 0, whose row holds 7
    real = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    rows = Shortlist.from_table(torch.tensor([[7, 0]] + [[0, 0]] * 3 + [[7, 8], [9, 0]] + [[0, 0]] * 4), table.always)
    each = [c.tolist() for c in rows.candidates_of(batch, real)]
    assert each == [[3, 4, 5, 7, 8, 9], [3, 9], [3, 4, 6, 7, 8]]  # padding adds no candidates


def own_ids(columns: ShortlistColumns) -> list[list[int]]:
    """Each sentence's own columns' ids, in batch order."""
    return [columns.extra_ids[first : first + count].tolist() for first, count in columns.spans.tolist()]


def test_each_sentence_scores_always_and_its_own_candidates_beyond_them() -> None:
    """``Vocabulary``: the ``always`` columns every sentence shares, their rows gathered once, and
    each sentence's own candidates beyond them (none of ``always`` twice), their rows gathered as
    it joins; sentences leave and reorder without their rows moving, the buffers grow and are
    compacted keeping every sentence's own, and a clear lets a large batch's buffers go."""
    table = Shortlist.from_table(torch.zeros(100, 1, dtype=torch.long), torch.tensor([0, 1, 2, 3]))
    matrix = torch.arange(100.0)[:, None].expand(100, 2)  # row i is (i, i)
    vocab = Vocabulary(table, TokenTable(matrix), torch.float32)
    columns = vocab.columns()
    assert columns.always.tolist() == [0, 1, 2, 3] and torch.equal(columns.always_rows[:, 0], columns.always.float())
    assert columns.width == 0 and columns.spans.shape == (0, 2) and vocab.columns() is columns  # made once a change

    def check(expected: list[list[int]]) -> None:
        columns = vocab.columns()
        assert own_ids(columns) == expected and columns.width == max(map(len, expected), default=0)
        for first, count in columns.spans.tolist():  # each column's own row
            assert torch.equal(
                columns.extra_rows[first : first + count, 0], columns.extra_ids[first : first + count].float()
            )

    vocab.join([torch.tensor([1, 10, 11, 12]), torch.tensor([2, 3]), torch.tensor([40])])
    check([[10, 11, 12], [], [40]])
    vocab.leave([2, 0])  # the second leaves, the third comes first: nothing moves
    check([[40], [10, 11, 12]])
    vocab.join([torch.arange(50, 60)])
    check([[40], [10, 11, 12], list(range(50, 60))])
    before = vocab.compacted
    for i in range(30):  # 96 own columns a sentence: past the buffers' room, compacted (moved to the front)
        vocab.join([torch.arange(4 + i % 7, 100)])
        vocab.leave(list(range(1, vocab.sentences)))  # the oldest leaves: its places are free
    check([list(range(4 + i % 7, 100)) for i in range(27, 30)])
    assert vocab.compacted > before and vocab._ids.numel() == 1024  # compacted, never grown past 2 x what is live
    vocab.leave([])
    check([])
    vocab.KEPT = 4  # (a large batch's worth, here)
    vocab.join([torch.arange(4, 90)])
    vocab.clear()
    check([])
    assert vocab._ids.numel() == 4 and vocab._rows.shape == (4, 2)
    vocab.join([torch.tensor([95])])
    check([[95]])
    # a float16 output matrix (the shipped ones): kept so
    half = Vocabulary(table, TokenTable(matrix.half()), torch.float32)
    half.join([torch.tensor([7, 8])])
    assert half.always_rows.dtype == torch.float32 and half.columns().extra_rows.dtype == torch.float16
    assert own_ids(half.columns()) == [[7, 8]] and half.columns().extra_rows[:2, 0].tolist() == [7.0, 8.0]


def test_the_shared_columns_are_packed_once_and_score_as_their_rows() -> None:
    """``Vocabulary.panels``: ``always``'s rows packed for the fused kernels' ``panel_product``
    once, whose logits are the rows' (to float rounding) over exactly those columns."""
    variant = fused_variant(detected())
    module = fused.load(variant)
    require(module is not None, f"the fused step kernels ({variant}) do not build here: see the log")
    table = Shortlist.from_table(torch.zeros(200, 1, dtype=torch.long), torch.arange(37))
    vocab = Vocabulary(table, TokenTable(torch.randn(200, 32)), torch.float32)
    panels = vocab.panels(module)
    assert vocab.panels(module) is panels and panels.shape[0] == -(-37 // module.panel_width())
    x = torch.randn(9, 32)
    got = module.panel_product(x, panels, 37)
    torch.testing.assert_close(got, x @ vocab.always_rows.t(), atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_shortlist_of_every_piece_decodes_exactly_as_the_whole_vocabulary(beam_size: int) -> None:
    """The shortlist's path (the output matrix's rows gathered, the beams given the columns'
    ids) with every piece a candidate gives the whole vocabulary's hypotheses and scores."""
    model = make_model(seed=3)
    everything = Shortlist.from_table(torch.arange(V)[None, :].expand(V, V), torch.tensor([0, 1, 2, 3]))
    rows = sources(6, seed=1)
    opts = DecodingOptions(beam_size=beam_size, n_best=beam_size)
    full = decode(model, pad(rows, 0), opts).hypotheses
    short = decode(model, pad(rows, 0), opts, everything).hypotheses
    for f, s in zip(full, short, strict=True):
        assert [h.ids for h in f] == [h.ids for h in s]
        assert [h.score for h in f] == pytest.approx([h.score for h in s], abs=1e-5)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_each_sentence_is_translated_from_its_own_candidates_alone_or_in_any_batch(beam_size: int) -> None:
    """A narrow shortlist: each source piece allows three targets. A sentence emits only its
    own candidates (and ``always``), and gets the same hypotheses alone, in a batch, and when
    it joins a running session beside others (whose candidates the step also scores)."""
    model = make_model(seed=4)
    gen = torch.Generator().manual_seed(0)
    table = Shortlist.from_table(torch.randint(4, V, (V, 3), generator=gen), torch.tensor([0, 1, 2, 3]))
    opts = DecodingOptions(beam_size=beam_size, n_best=beam_size)
    rows = sources(8, seed=2)
    allowed = [set(table.candidates(torch.tensor(r)).tolist()) | {0, 1, 2, 3} for r in rows]
    alone = [decode(model, pad([row], 0), opts, table).hypotheses[0] for row in rows]
    for hyps, own in zip(alone, allowed, strict=True):
        assert all(set(h.ids) <= own for h in hyps)
    together = decode(model, pad(rows, 0), opts, table).hypotheses
    session = DecodeSession(model, opts, table)
    session.admit(pad(rows[:4], 0), range(4))
    joined: dict[int, list] = {}
    step = 0
    while session.active:
        if step == 2:
            session.admit(pad(rows[4:], 0), range(4, 8))
        for finished in session.step():
            joined[finished.tag] = finished.hypotheses
        step += 1
    for i, expected in enumerate(alone):
        assert [h.ids for h in together[i]] == [h.ids for h in expected], i
        assert [h.ids for h in joined[i]] == [h.ids for h in expected], i
        assert [h.score for h in joined[i]] == pytest.approx([h.score for h in expected], abs=1e-4)


def decode_with_a_joiner(model: Transformer, table: Shortlist, opts: DecodingOptions, rows: list[list[int]]) -> dict:
    """The first sentence decoded alone for a step, then the others join -> best ids by tag."""
    session = DecodeSession(model, opts, table)
    session.admit(pad(rows[:1], 0), [0])
    done = {f.tag: f.hypotheses[0].ids for f in session.step()}
    session.admit(pad(rows[1:], 0), range(1, len(rows)))
    while session.active:
        done.update({f.tag: f.hypotheses[0].ids for f in session.step()})
    return done


@pytest.mark.parametrize("width", [32, 40])
@pytest.mark.parametrize("beam_size", [1, 3, 6])
def test_beams_wider_than_a_sentences_candidates_and_widths_the_kernels_do_not_take(width: int, beam_size: int) -> None:
    """A beam wider than a sentence's candidates (``always`` is the 4 specials; a sentence of EOS
    alone has nothing of its own), and a model width (40) whose own-columns product the kernels
    do not take (the tensor operations' then, for every row or only the rows a joining step
    computes): the fused kernels' path gives the tensor operations' hypotheses, every token a
    real one."""
    variant = fused_variant(detected())
    require(fused.load(variant) is not None, f"the fused step kernels ({variant}) do not build here: see the log")
    model = make_model(seed=5, d_model=width, n_heads=4)
    gen = torch.Generator().manual_seed(1)
    targets = torch.randint(4, V, (V, 2), generator=gen)
    targets[3] = 0  # EOS: no targets of its own
    table = Shortlist.from_table(targets, torch.tensor([0, 1, 2, 3]))
    rows = [[3], *sources(5, seed=7)]
    opts = DecodingOptions(beam_size=beam_size)
    results = {}
    for step_kernels in (variant, None):
        model.fused_step = step_kernels
        results[step_kernels] = decode_with_a_joiner(model, table, opts, rows)
    assert results[variant] == results[None]
    assert all(0 <= t < V for ids in results[variant].values() for t in ids)


def test_the_shipped_shortlists_load_and_keep_the_translations(shipped: Path, data_dir: Path) -> None:
    """Each shipped one-direction checkpoint has a shortlist that matches its vocabulary; on
    de-en validation sentences decoded one at a time (the narrowest union) it gives the
    whole vocabulary's translation for nearly all of them."""
    for folder in sorted(shipped.parent.iterdir()):
        meta = json.loads((folder / "config.json").read_text())
        table = loading.load_shortlist(folder, meta["model"]["tgt_vocab_size"])
        assert (table is None) == bool(meta.get("target_tags")), folder  # every direction model has one
    ckpt, listed = loading.load(shipped), loading.load(shipped)
    table = loading.use_shortlist(listed)
    assert table is not None and table.per_source == 200
    texts = read_lines(data_dir / "val.de.gz")[:60]
    opts = loading.decoding_options(ckpt.meta, 1)
    full, short = Translator(ckpt.model, ckpt.tokenizer), Translator(listed.model, ckpt.tokenizer, shortlist=table)
    same = 0
    for ids in full.encode(texts):
        same += full.decode_ids([ids], opts)[0][0].ids == short.decode_ids([ids], opts)[0][0].ids
    assert same >= 0.9 * len(texts)


def test_write_shortlist_from_training_data_and_refuse_what_does_not_fit(
    tiny_weights_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "de-en"
    folder.mkdir()
    for f in (tiny_weights_dir / "de-en").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    train = tmp_path / "data"
    train.mkdir()
    for lang in ("de", "en"):
        (train / f"train.{lang}").write_text("\n".join(read_lines(data_dir / f"train.{lang}.gz")[:500]) + "\n")
    written = shortlists.write_shortlist(folder, train, per_source=20, frequent=50)
    vocab = json.loads((folder / "config.json").read_text())["model"]["tgt_vocab_size"]
    table = loading.load_shortlist(folder, vocab)
    assert written.name == "shortlist.safetensors" and table is not None
    assert table.vocab_size == vocab and table.per_source == 20 and table.always.numel() == 54
    assert max(table.row(s).numel() for s in range(vocab)) == 20
    with pytest.raises(checkpoint.CheckpointError, match="vocabulary of 999"):
        loading.load_shortlist(folder, 999)
    with pytest.raises(checkpoint.CheckpointError, match="training data not found"):
        shortlists.write_shortlist(folder, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="vocabulary"):
        DecodeSession(make_model(), DecodingOptions(), table)


def test_float_precisions_use_the_shortlist_and_int8_the_whole_vocabulary(shipped: Path) -> None:
    assert loading.use_shortlist(loading.load(shipped)) is not None
    whole = loading.load(shipped)
    assert loading.use_shortlist(whole, wanted=False) is None
    # the packed copy kept for the whole vocabulary: oneDNN's, or the fused kernels' panels
    assert kernels.is_packed(whole.model.kernel) == (whole.plan.kernel in ("onednn", "panels"))
    if not detected().avx2:
        pytest.skip("int8 needs AVX2")
    assert loading.use_shortlist(loading.load(shipped, precision="int8")) is None


def narrow_translator(seed: int) -> tuple[Transformer, Shortlist, Translator]:
    """A small model, a random shortlist of 3 targets a piece (the specials always), and a
    translator of ids (no tokenizer) that decodes through it."""
    model = make_model(seed=4)
    gen = torch.Generator().manual_seed(seed)
    table = Shortlist.from_table(torch.randint(4, V, (V, 3), generator=gen), torch.tensor([0, 1, 2, 3]))
    return model, table, Translator(model, tokenizer=None, shortlist=table)  # type: ignore[arg-type]


def test_a_translators_sessions_hand_the_columns_on_only_when_done() -> None:
    model, table, translator = narrow_translator(seed=0)
    opts = DecodingOptions(beam_size=2)
    rows = sources(3, seed=5)
    alone = [decode(model, pad([r], 0), opts, table).hypotheses[0][0].ids for r in rows]
    first = translator.open_session(opts)
    first.admit([rows[0][:-1]], [0])
    second = translator.open_session(opts)  # the first is still decoding: the second makes its own
    second.admit([rows[1][:-1]], [1])
    assert second.session._vocab is not first.session._vocab
    done = {}
    for session in (first, second):
        while session.active:
            done.update({f.tag: f.hypotheses[0].ids for f in session.step()})
    third = translator.open_session(opts)  # the holder is done: it takes the columns over
    third.admit([rows[2][:-1]], [2])
    while third.active:
        done.update({f.tag: f.hypotheses[0].ids for f in third.step()})
    assert third.session._vocab is first.session._vocab or third.session._vocab is translator._vocabulary
    assert [done[i] for i in range(3)] == alone
    first.admit([rows[0][:-1]], [0])  # the first, used again, makes its own columns
    assert first.session._vocab is not third.session._vocab
    while first.active:
        assert [f.hypotheses[0].ids for f in first.step()] in ([], [alone[0]])


def test_a_translators_batches_take_the_columns_over_instead_of_gathering_them_again() -> None:
    model, table, translator = narrow_translator(seed=1)
    opts = DecodingOptions(beam_size=3)
    rows = [r[:-1] for r in sources(4, seed=6)]
    alone = [decode(model, pad([[*r, 3]], 0), opts, table).hypotheses[0][0].ids for r in rows]
    got = [translator.decode_ids([r], opts)[0][0].ids for r in rows]
    vocab = translator._vocabulary
    assert vocab is not None and vocab.sentences == 0  # made once, by the first batch; cleared after each
    shared = vocab.always_rows
    assert got == alone
    assert [h[0].ids for h in translator.decode_ids(rows, opts)] == alone and translator._vocabulary is vocab
    assert vocab.always_rows is shared  # never gathered again
    holder = translator.open_session(opts)  # a session still decoding holds the columns
    holder.admit([rows[0]], [0])
    assert [h[0].ids for h in translator.decode_ids(rows[1:], opts)] == alone[1:]  # with columns of its own
    assert holder.session._vocab is vocab and vocab.sentences and translator._vocabulary is vocab


def test_streams_made_before_either_runs_each_decode_with_their_own_columns() -> None:
    model, table, translator = narrow_translator(seed=2)
    opts = DecodingOptions(beam_size=2)
    rows = [r[:-1] for r in sources(4, seed=7)]
    alone = [decode(model, pad([[*r, 3]], 0), opts, table).hypotheses[0][0].ids for r in rows]
    streams = {0: translator.decode_stream(rows[:2], opts), 2: translator.decode_stream(rows[2:], opts)}
    done: dict[int, list[int]] = {}
    while streams:  # a sentence of each in turn: both sessions live at once
        for first, stream in list(streams.items()):
            finished = next(stream, None)
            if finished is None:
                del streams[first]
            else:
                done[first + finished.tag] = finished.hypotheses[0].ids
    assert [done[i] for i in range(4)] == alone


def test_with_the_shortlist_the_packed_output_projection_goes_and_the_whole_one_still_runs(shipped: Path) -> None:
    """``use_shortlist`` takes the whole-vocabulary projection off the decoding path (decoding
    reads the shortlist's rows): its packed copy freed where there was one, the token table kept
    in float16; the teacher-forced pass (``/attention``) projects from that table, to the same
    logits."""
    packed, ckpt = loading.load(shipped), loading.load(shipped)
    src, tgt = torch.tensor([[5, 80, 300, 3]]), torch.tensor([[2, 7, 90, 41]])
    with torch.inference_mode():
        before, _ = packed.model.attention_maps(src, tgt)
        table = loading.use_shortlist(ckpt)
        after, _ = ckpt.model.attention_maps(src, tgt)
    assert table is not None and ckpt.model.kernel is kernels.upcast
    assert ckpt.model.output_matrix().dtype == torch.float16  # shipped in float16: the table is exact
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert loading.shortlist_output(ckpt.model) == 0  # nothing left to release
    texts = ["Ein Mann fährt mit dem Fahrrad.", "Zwei Hunde spielen im Schnee."]
    opts = loading.decoding_options(ckpt.meta, 4)
    listed = loading.load(shipped, keep_float_weights=True)
    expected = Translator(listed.model, listed.tokenizer, shortlist=table).translate(texts, opts)
    assert [t.text for t in Translator(ckpt.model, ckpt.tokenizer, shortlist=table).translate(texts, opts)] == [
        t.text for t in expected
    ]
