"""Exact match and F1 by the official SQuAD evaluation logic, as tf-models-official ships it.

`official.nlp.tools.squad_evaluate_v1_1` and `squad_evaluate_v2_0` are the SQuAD authors'
evaluate-v1.1.py / evaluate-v2.0.py functions (answer normalisation: lower case, drop
punctuation, articles and extra whitespace). This module only calls them and puts both
versions' results on one scale (percent):

    exact, f1            both versions: the scores of the predictions as given
    HasAns_*, NoAns_*    v2.0: the same on answerable / unanswerable questions

`tune_null_threshold` runs the official best-threshold search (v2.0 `best_f1`).

Example:
    dataset = json.load(open("dev-v2.0.json"))
    threshold, best_f1 = tune_null_threshold(dataset, best_answers, score_diffs)
    scores = evaluate(dataset, apply_null_threshold(best_answers, score_diffs, threshold), "2.0")
"""
from official.nlp.tools import squad_evaluate_v1_1, squad_evaluate_v2_0


def evaluate(dataset, predictions, version):
    """Scores (percent) of `predictions` {qid: text} on a parsed SQuAD dict ("1.1" or "2.0")."""
    if version == "1.1":
        scores = squad_evaluate_v1_1.evaluate(dataset["data"], predictions)
        return {"exact": 100.0 * scores["exact_match"], "f1": 100.0 * scores["final_f1"],
                "total": sum(len(p["qas"]) for a in dataset["data"] for p in a["paragraphs"])}
    if version != "2.0":
        raise ValueError(f"SQuAD version {version!r}: expected '1.1' or '2.0'")
    scores = dict(squad_evaluate_v2_0.evaluate(dataset["data"], predictions))
    for key in ("final_exact", "final_f1", "final_exact_thresh", "final_f1_thresh"):
        scores.pop(key)  # without null scores these only repeat exact / f1
    return scores


def tune_null_threshold(dataset, answers, score_diffs):
    """(threshold, best F1) of the official v2.0 search over "" when score_diff > threshold.

    answers: the best non-null answer per question; score_diffs: null score minus its score.
    When answering nothing scores best, the official search reports threshold 0.0 (its
    starting value, which would answer every question with score_diff <= 0); the threshold
    returned here is then one below every score_diff, so it gives the best F1 it reports.
    """
    scores = squad_evaluate_v2_0.evaluate(dataset["data"], answers, score_diffs)
    threshold, best = float(scores["final_f1_thresh"]), float(scores["final_f1"])
    thresholded = {qid: ("" if score_diffs[qid] > threshold else text)
                   for qid, text in answers.items()}
    if evaluate(dataset, thresholded, "2.0")["f1"] < best - 1e-9:
        threshold = min(score_diffs.values()) - 1.0  # every question gets ""
    return threshold, best
