"""tfbig-squad on a converted released ALBERT (Google's 30k-clean.model, Hugging Face's
spiece.model, copied by tfbig-convert as tokenizer.model): the run's tokenizer is
AlbertSentencePiece with ALBERT's text preparation, and its `char_spans` locates every piece in
the original text through whitespace collapsing, accent stripping and lower-casing, so answer
labels and predicted spans are characters of the original context.

The SentencePiece model is trained here the way ALBERT's was (tests/data/
test_prep_released_tokenizers.py): unigram, <pad> <unk> [CLS] [SEP] [MASK] at ids 0-4, no
newline piece, lower-cased text."""
import numpy as np
import pytest
import sentencepiece as spm

from tfbig.data.albert_spm import AlbertSentencePiece, preprocess_text
from tfbig.data.squad.features import char_span, convert_examples, examples_from_dataset

UNDERLINE = "\u2581"
ODD = ("  Héllo,  WÖRLD!! Ça va?\t«Quoi» naïve CAFÉ... In 1990, 42,5% (a+b)=c;\n\n"
       "Zürich’s  “Crème Brûlée” —  ΟΔΟΣ  東京は晴れ。 ``quoted'' ")
CONTEXT = "In 1990,  the Naïve CAFÉ of Zürich sold «Crème Brûlée» to 1,200 guests."
QUESTIONS = [("Which café?", "Naïve CAFÉ"), ("Where?", "Zürich"), ("When?", "1990"),
             ("What dessert?", "Crème Brûlée"), ("How many guests?", "1,200")]


@pytest.fixture(scope="module")
def albert_run(tmp_path_factory, qa_play_paths):
    """A tfbig-convert run directory of a (weightless) ALBERT with a released-form
    SentencePiece model as tokenizer.model, and that model's path."""
    from tfbig.convert import run_dir
    from tfbig.models.albert import AlbertConfig

    root = tmp_path_factory.mktemp("albert_squad")
    lines = [ODD, CONTEXT] + [q for q, _ in QUESTIONS]
    for path in qa_play_paths[0]:
        with open(path, encoding="utf-8") as file:
            lines += [line for line in file.read().split("\n") if line.strip()][:1500]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([preprocess_text(line, True) for line in lines]),
        model_prefix=str(root / "30k-clean"), vocab_size=500, model_type="unigram", pad_id=0,
        unk_id=1, eos_id=-1, bos_id=-1, control_symbols=["[CLS]", "[SEP]", "[MASK]"],
        user_defined_symbols=["(", ")", '"', "-", ".", "–", "£", "€",
                              "1990,"],  # digits then a comma, as ALBERT's "9,": split by encode
        character_coverage=0.99995, minloglevel=2)
    model = str(root / "30k-clean.model")
    config = AlbertConfig(vocab_size=500, embedding_size=16, hidden_size=32, num_layers=1,
                          num_heads=2, seq_length=64)
    run_dir.write(str(root / "run"), config, {}, model, False, "google:albert_base",
                  family="albert")
    return root / "run", model


def test_char_spans_locate_each_piece_in_the_original_text(albert_run):
    tokenizer = AlbertSentencePiece.load(albert_run[1])
    ids, starts, ends = tokenizer.char_spans(ODD)
    assert ids.tolist() == tokenizer.encode_line(ODD)  # ALBERT's ids, digit-comma split kept
    assert "1990," in tokenizer.processor.EncodeAsPieces(preprocess_text(ODD, True))
    assert tokenizer.piece_id("1990,") not in ids
    covered, unknown = 0, tokenizer.processor.unk_id()
    for i, s, e in zip(ids.tolist(), starts.tolist(), ends.tolist()):
        piece = tokenizer.processor.IdToPiece(i)
        assert covered <= s <= e and ODD[covered:s].strip() == "", (piece, s, e)  # in order
        if piece == UNDERLINE:  # a lone "▁" before a symbol piece: the space it stands for
            assert ODD[s:e].isspace()
        elif i != unknown:
            final_sigma = str.maketrans("ς", "σ")  # lower case of "Σ" by its neighbours
            assert preprocess_text(ODD[s:e], True).translate(final_sigma) == \
                piece.lstrip(UNDERLINE).translate(final_sigma), (piece, ODD[s:e])
        else:
            assert e > s
        covered = e
    assert ODD[covered:].strip() == ""
    for word in ("Héllo", "WÖRLD", "1990", "42,5", "Brûlée", "ΟΔΟΣ"):  # original case, accents
        begin = ODD.index(word)
        inside = (starts >= begin) & (ends <= begin + len(word)) & (ends > starts)
        assert ODD[starts[inside].min():ends[inside].max()] == word
        assert not np.any((starts < begin) & (ends > begin))  # no piece crosses into the word


def test_squad_tokenizer_of_a_converted_albert_is_albert_sentencepiece(albert_run):
    from tfbig.tasks.squad_model import pretrained_config

    config, tokenizer = pretrained_config(str(albert_run[0]))
    assert isinstance(tokenizer, AlbertSentencePiece) and tokenizer.lowercase
    assert config.vocab_size == tokenizer.vocab_size == 500
    processor = spm.SentencePieceProcessor()
    processor.Load(albert_run[1])
    text = "What did the Naïve CAFÉ\nsell?"  # a newline is whitespace: one segment, no [SEP]
    assert tokenizer.encode(text) == processor.EncodeAsIds(preprocess_text(text, True))
    assert tokenizer.encode("ZÜRICH") == tokenizer.encode("zurich") != processor.EncodeAsIds(
        "ZÜRICH")
    assert (tokenizer.piece_id("[CLS]"), tokenizer.piece_id("[SEP]"), tokenizer.pad_id) == (2, 3, 0)


def test_squad_features_label_the_answer_characters(albert_run):
    from tfbig.tasks.squad_model import pretrained_config

    _, tokenizer = pretrained_config(str(albert_run[0]))
    dataset = {"version": "v1.1", "data": [{"title": "t", "paragraphs": [{
        "context": CONTEXT, "qas": [
            {"id": f"q{n}", "question": q,
             "answers": [{"text": a, "answer_start": CONTEXT.index(a)}]}
            for n, (q, a) in enumerate(QUESTIONS)]}]}]}
    examples = examples_from_dataset(dataset)
    features = convert_examples(examples, tokenizer, max_seq_length=32, doc_stride=8,
                                max_query_length=8)
    found = {}
    arrays = features.arrays
    for feature in range(len(features)):
        first, last = int(arrays["start_positions"][feature]), int(arrays["end_positions"][feature])
        if first:
            example = examples[arrays["example_index"][feature]]
            begin, end = char_span(features, feature, first, last)
            found.setdefault(example.answer_text, set()).add(CONTEXT[begin:end])
    assert found == {answer: {answer} for _, answer in QUESTIONS}
    sep = tokenizer.piece_id("[SEP]")
    for row, example_index in zip(arrays["input_ids"], arrays["example_index"]):
        query = tokenizer.encode(examples[example_index].question)
        assert row[0] == tokenizer.piece_id("[CLS]") and list(row[1:len(query) + 2]) == query + [sep]


def test_shakespeare_answers_are_recovered_through_albert_preparation(albert_run, qa_sets):
    from tfbig.tasks.squad_model import pretrained_config

    _, tokenizer = pretrained_config(str(albert_run[0]))
    examples = examples_from_dataset(qa_sets["2.0", "train"])
    features = convert_examples(examples, tokenizer, max_seq_length=64, doc_stride=32,
                                max_query_length=16)
    arrays, labelled = features.arrays, set()
    for feature in np.flatnonzero(arrays["start_positions"]):
        example = examples[arrays["example_index"][feature]]
        begin, end = char_span(features, feature, int(arrays["start_positions"][feature]),
                               int(arrays["end_positions"][feature]))
        assert example.context[begin:end] == example.answer_text, example.qid
        labelled.add(example.qid)
    answerable = {e.qid for e in examples if not e.is_impossible}
    assert len(answerable) > 20 and labelled == answerable
