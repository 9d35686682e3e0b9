"""Is the embedded QA set learnable as built? One JSON line about a SQuAD v2.0 file.

Without any model: how many answerable questions have their answer *and* the whole quoted
line inside one feature window (--max_seq_length / --doc_stride / --max_query_length, as
tfbig-squad cuts them), how far (tokens) the answer is from the quote, and what shortcuts
score on "who says" questions: naming the context's first, last or most frequent speaker, or a
uniformly random one of its speakers (HasAns exact-match share, percent). With --train_file:
how many answers hold a piece that the training file's contexts hold fewer than 5 times (a
held-out play's new names: the fine-tuned model has never trained those pieces' embeddings).

    python benchmarks/squad_qa_analysis.py --tokenizer=runs/albert-data/tokenizer.model \\
        --file=runs/qa/shakespeare-qa-v2.0-dev.json \\
        --train_file=runs/qa/shakespeare-qa-v2.0-train.json
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import collections
import json
import re

import numpy as np

from data_prep.shakespeare_qa import _SPEAKER
from tfbig.data import Tokenizer
from tfbig.data.squad.features import convert_examples, read_squad, token_char_spans

RARE = 5  # a piece seen fewer times than this in the training contexts is barely trained
QUOTE = re.compile(r"Who says: '(.*)'\?|How does the line '(.*) \.\.\.' go on\?")


def window_coverage(examples, features, tokenizer):
    """(share with answer + whole quote in one labelled window, quote-to-answer distances)."""
    windows = collections.defaultdict(list)
    for feature, example in enumerate(features.arrays["example_index"].tolist()):
        windows[example].append(feature)
    located, distances, answerable = 0, [], 0
    for index, example in enumerate(examples):
        if example.is_impossible:
            continue
        answerable += 1
        quote = next(g for g in QUOTE.fullmatch(example.question).groups() if g)
        begin = example.context.index(quote)
        _, starts, ends = token_char_spans(tokenizer, example.context)
        answer = int(np.searchsorted(ends, example.answer_start, side="right"))
        first = int(np.searchsorted(ends, begin, side="right"))
        last = int(np.searchsorted(starts, begin + len(quote), side="left")) - 1
        distances.append(abs(first - answer))
        for feature in windows[index]:
            tokens = set(features.arrays["context_token"][feature].tolist())
            if features.arrays["start_positions"][feature] > 0 and \
                    {answer, first, last} <= tokens:
                located += 1
                break
    return located / answerable, distances


def speaker_shortcuts(dataset):
    """HasAns exact-match share (percent) of guesses that ignore the question."""
    hits, total = collections.Counter(), 0
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            blocks = [b.split("\n") for b in paragraph["context"].split("\n\n")]
            speakers = [b[0] for b in blocks if len(b) > 1 and _SPEAKER.match(b[0])]
            for qa in paragraph["qas"]:
                if not qa["answers"] or not qa["question"].startswith("Who says"):
                    continue
                answer, total = qa["answers"][0]["text"], total + 1
                hits["first_speaker"] += speakers[0] == answer
                hits["last_speaker"] += speakers[-1] == answer
                hits["most_frequent"] += collections.Counter(speakers).most_common(1)[0][0] \
                    == answer
                hits["random_speaker"] += speakers.count(answer) > 0 and 1 / len(set(speakers))
    return {k: round(100 * v / total, 1) for k, v in hits.items()}


def rare_answers(dataset, train, tokenizer):
    """Answers of `dataset` with a piece (as tfbig-squad tokenizes the context) seen fewer than
    RARE times in `train`'s contexts: (share of answerable questions, {answer: its pieces'
    counts in training} of the distinct answers with a rare piece)."""
    seen = collections.Counter()
    for article in train["data"]:
        for paragraph in article["paragraphs"]:
            seen.update(token_char_spans(tokenizer, paragraph["context"])[0].tolist())
    rare, total, hits = {}, 0, 0
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            ids, starts, ends = token_char_spans(tokenizer, paragraph["context"])
            for qa in paragraph["qas"]:
                if not qa["answers"]:
                    continue
                answer = qa["answers"][0]
                begin, end = answer["answer_start"], answer["answer_start"] + len(answer["text"])
                counts = [seen[int(i)] for i, s, e in zip(ids, starts, ends)
                          if s < end and e > begin]
                total += 1
                if min(counts) < RARE:
                    hits += 1
                    rare[answer["text"]] = counts
    return hits / total, rare


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--file", required=True, help="SQuAD v2.0 JSON of the embedded set")
    parser.add_argument("--train_file", default="",
                        help="the training file: count the answers whose pieces it hardly holds")
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--doc_stride", type=int, default=64)
    parser.add_argument("--max_query_length", type=int, default=32)
    args = parser.parse_args()
    tokenizer = Tokenizer.load(args.tokenizer)
    examples, _ = read_squad(args.file)
    features = convert_examples(examples, tokenizer, args.max_seq_length, args.doc_stride,
                                args.max_query_length)
    with open(args.file, encoding="utf-8") as file:
        dataset = json.load(file)
    located, distances = window_coverage(examples, features, tokenizer)
    questions = [len(tokenizer.encode(e.question)) for e in examples]
    extra = {}
    if args.train_file:
        with open(args.train_file, encoding="utf-8") as file:
            share, rare = rare_answers(dataset, json.load(file), tokenizer)
        extra = {"answers_with_a_piece_rare_in_training": round(share, 4),
                 "rare_answers_piece_counts": rare}
    _record.emit({
        "file": args.file, "questions": len(examples), "features": len(features),
        "answer_and_quote_in_one_window": round(located, 4),
        "questions_cut_by_max_query_length": round(float(np.mean(
            np.array(questions) > args.max_query_length)), 4),
        "quote_to_answer_tokens_mean": round(float(np.mean(distances)), 1),
        "quote_to_answer_tokens_max": int(np.max(distances)),
        "who_says_hasans_exact_of_shortcuts": speaker_shortcuts(dataset), **extra})


if __name__ == "__main__":
    main()
