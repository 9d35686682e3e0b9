"""Our scores equal the official SQuAD evaluation (tf-models-official's copy of the authors'
evaluate-v1.1.py / evaluate-v2.0.py) on a handmade predictions file, and hand-computed values."""
import pytest
from official.nlp.tools import squad_evaluate_v1_1, squad_evaluate_v2_0

from tfbig.data.squad.evaluate import evaluate, tune_null_threshold
from tfbig.data.squad.postprocess import apply_null_threshold

# (gold answers, prediction, exact match, F1) -- the normalisation lower-cases, drops ASCII
# punctuation and the articles a/an/the, and squeezes whitespace.
CASES = {
    "case": (["Sir Toby Belch"], "SIR TOBY BELCH", 1, 1.0),
    "punctuation": (["Viola"], "Viola!", 1, 1.0),
    "inner_punctuation": (["o'er-leaps"], "oerleaps", 1, 1.0),
    "article": (["the Duke"], "Duke", 1, 1.0),
    "article_inside": (["a king of shreds"], "king of  shreds", 1, 1.0),
    "an_in_word": (["Antonio"], "tonio", 0, 0.0),  # "an" is only dropped as a word
    "whitespace": (["First  Citizen"], " first\tcitizen\n", 1, 1.0),
    "unicode_quotes": (["‘tis"], "'tis", 0, 0.0),  # ‘ is not ASCII punctuation: kept
    "partial": (["Lady Macbeth"], "Macbeth", 0, 2 / 3),  # P = 1, R = 1/2
    "longer": (["Macbeth"], "Macbeth and Banquo", 0, 0.5),  # P = 1/3, R = 1
    "repeated_tokens": (["to be or not to be"], "to be to be", 0, 2 * (4 / 4) * (4 / 6) / (4 / 4 + 4 / 6)),
    "best_of_several": (["Feste", "the Clown", "Clown"], "a clown", 1, 1.0),
    "only_articles": (["the"], "a", 1, 1.0),  # both normalise to ""; EM counts, F1 is 0 for v1.1
    "wrong": (["Orsino"], "Olivia", 0, 0.0),
}


def dataset_v1():
    qas = [{"id": qid, "question": "Who?", "answers": [{"text": t, "answer_start": 0}
                                                       for t in gold]}
           for qid, (gold, _, _, _) in CASES.items()]
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "x",
                                                                       "qas": qas}]}]}


def test_v1_agrees_with_the_official_script_and_by_hand():
    predictions = {qid: case[1] for qid, case in CASES.items()}
    ours = evaluate(dataset_v1(), predictions, "1.1")
    official = squad_evaluate_v1_1.evaluate(dataset_v1()["data"], predictions)
    assert ours["exact"] == pytest.approx(100 * official["exact_match"])
    assert ours["f1"] == pytest.approx(100 * official["final_f1"])
    # By hand: v1.1 F1 of two empty normalised strings is 0 (no common token).
    hand_f1 = [f1 if qid != "only_articles" else 0.0 for qid, (_, _, _, f1) in CASES.items()]
    assert ours["exact"] == pytest.approx(100 * sum(c[2] for c in CASES.values()) / len(CASES))
    assert ours["f1"] == pytest.approx(100 * sum(hand_f1) / len(CASES))


def test_a_missing_prediction_scores_zero():
    predictions = {qid: case[1] for qid, case in CASES.items() if qid != "case"}
    full = evaluate(dataset_v1(), {qid: case[1] for qid, case in CASES.items()}, "1.1")
    assert evaluate(dataset_v1(), predictions, "1.1")["exact"] == pytest.approx(
        full["exact"] - 100 / len(CASES))


def dataset_v2():
    qas = [{"id": qid, "question": "Who?", "is_impossible": False,
            "answers": [{"text": t, "answer_start": 0} for t in gold]}
           for qid, (gold, _, _, _) in CASES.items()]
    qas += [{"id": f"none{i}", "question": "Who?", "is_impossible": True, "answers": []}
            for i in range(4)]
    return {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": "x",
                                                                       "qas": qas}]}]}


def test_v2_agrees_with_the_official_script_and_by_hand():
    predictions = {qid: case[1] for qid, case in CASES.items()}
    predictions.update({"none0": "", "none1": "", "none2": "Viola", "none3": "the"})
    ours = evaluate(dataset_v2(), predictions, "2.0")
    official = squad_evaluate_v2_0.evaluate(dataset_v2()["data"], predictions)
    for key in ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1", "total"):
        assert ours[key] == pytest.approx(official[key]), key
    # By hand: v2.0 F1 of two empty normalised strings is 1; "the" normalises to "", so it
    # counts as a correct null answer.
    assert ours["NoAns_exact"] == pytest.approx(75.0)
    assert ours["HasAns_f1"] == pytest.approx(100 * sum(c[3] for c in CASES.values()) / len(CASES))
    total = len(CASES) + 4
    assert ours["exact"] == pytest.approx(100 * (sum(c[2] for c in CASES.values()) + 3) / total)


def test_tuned_null_threshold_reaches_the_official_best_f1():
    answers = {qid: case[1] for qid, case in CASES.items()}
    answers.update({f"none{i}": "Viola" for i in range(4)})
    diffs = {qid: -1.0 - i for i, qid in enumerate(CASES)}  # confident answers
    diffs["wrong"] = 0.5  # the wrong answer looks like a null answer...
    diffs.update({"none0": 2.0, "none1": 3.0, "none2": 1.0, "none3": -5.0})
    threshold, best_f1 = tune_null_threshold(dataset_v2(), answers, diffs)
    official = squad_evaluate_v2_0.evaluate(dataset_v2()["data"], answers, diffs)
    assert (threshold, best_f1) == (official["final_f1_thresh"], pytest.approx(official["final_f1"]))
    predictions = apply_null_threshold(answers, diffs, threshold)
    assert predictions["none0"] == predictions["none1"] == predictions["wrong"] == ""
    assert predictions["none3"] == "Viola"  # below the threshold: answered, and wrong
    assert evaluate(dataset_v2(), predictions, "2.0")["f1"] == pytest.approx(best_f1)


def test_unknown_version_is_a_clear_error():
    with pytest.raises(ValueError, match="SQuAD version '3.0'"):
        evaluate(dataset_v1(), {}, "3.0")


def test_tuned_threshold_when_answering_nothing_is_best():
    answers = {qid: "Olivia" for qid in CASES}  # every answer wrong
    answers.update({f"none{i}": "Viola" for i in range(4)})
    diffs = {qid: -3.0 + 0.1 * i for i, qid in enumerate(answers)}  # all confident, all < 0
    threshold, best_f1 = tune_null_threshold(dataset_v2(), answers, diffs)
    predictions = apply_null_threshold(answers, diffs, threshold)
    assert set(predictions.values()) == {""}
    assert best_f1 == pytest.approx(100 * 4 / (len(CASES) + 4))  # the 4 unanswerable ones
    # Scoring the predictions also credits "only_articles" (its gold "the" normalises to ""),
    # which the official threshold search counts as answerable.
    assert evaluate(dataset_v2(), predictions, "2.0")["f1"] == pytest.approx(
        100 * 5 / (len(CASES) + 4))
