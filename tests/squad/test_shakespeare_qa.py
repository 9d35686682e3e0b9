"""The embedded QA set: deterministic, answers correct and where they say, v2 adds nulls."""
import json
import re

from data_prep import shakespeare_qa
from tfbig.data import shakespeare, sources


def questions(dataset):
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                yield paragraph["context"], qa


def quoted(qa):
    return re.fullmatch(r"Who says: '(.*)'\?", qa["question"]).group(1)


def added(plain, mixed):
    """(context, qa) of the questions `mixed` adds to `plain`; the others must be the same."""
    plain_ids = {qa["id"]: qa for _, qa in questions(plain)}
    for context, qa in questions(mixed):
        if qa["id"] in plain_ids:
            assert qa == plain_ids.pop(qa["id"])
        else:
            yield context, qa
    assert not plain_ids


def speaker_of(context, line):
    """The speaker heading the speech (blank-line separated block) that holds `line`."""
    for block in context.split("\n\n"):
        lines = block.split("\n")
        if line in lines[1:]:
            return lines[0]
    raise AssertionError(line)


def test_answers_are_the_speakers_of_the_quoted_lines(qa_sets):
    for version in ("1.1", "2.0"):
        count = 0
        for context, qa in questions(qa_sets[version, "dev"]):
            line = quoted(qa)
            if not qa["answers"]:
                assert line not in context and version == "2.0"
                continue
            (answer,) = qa["answers"]
            start = answer["answer_start"]
            assert context[start:start + len(answer["text"])] == answer["text"]
            assert context.count(line) == 1 and len(line.split()) >= 4
            assert speaker_of(context, line) == answer["text"]
            assert context[start - 2:start] in ("", "\n\n") or start == 0  # heads its speech
            count += 1
        assert count > 300


def test_contexts_have_several_speakers_and_answers_spread_over_them(qa_sets):
    first_speaker, total = 0, 0
    for context, qa in questions(qa_sets["1.1", "train"]):
        blocks = [b.split("\n") for b in context.strip("\n").split("\n\n")]
        speakers = [lines[0] for lines in blocks if len(lines) > 1 and lines[0].isupper()]
        assert len(set(speakers)) >= 2
        first_speaker += qa["answers"][0]["text"] == speakers[0]
        total += 1
    assert first_speaker / total < 0.6  # "name the first speaker" is no shortcut


def test_v2_is_v1_plus_about_a_third_unanswerable(qa_sets):
    v1 = {qa["id"]: qa for _, qa in questions(qa_sets["1.1", "train"])}
    v2 = {qa["id"]: qa for _, qa in questions(qa_sets["2.0", "train"])}
    answerable = {qid: qa for qid, qa in v2.items() if qa["answers"]}
    assert set(answerable) == set(v1)
    assert all(answerable[q]["answers"] == v1[q]["answers"] for q in v1)
    share = 1 - len(answerable) / len(v2)
    assert 0.3 < share < 0.4  # one per two answerable, rounded up
    assert all(qa["is_impossible"] == (not qa["answers"]) for qa in v2.values())


def test_deterministic_and_dev_plays_held_out(qa_play_paths):
    dev_play = qa_play_paths[1]
    first = shakespeare_qa.build(dev_play, "2.0", seed=3)
    assert first == shakespeare_qa.build(dev_play, "2.0", seed=3)
    assert first != shakespeare_qa.build(dev_play, "2.0", seed=4)
    train, dev = shakespeare_qa.split_plays()
    assert {shakespeare.play_name(p) for p in dev} == set(sources.DEFAULT_VALIDATION_PLAYS)
    assert not set(train) & set(dev) and len(train) + len(dev) == 38


def test_writes_squad_files_the_reader_accepts(tmp_path, monkeypatch, qa_play_paths):
    from tfbig.data.squad.features import read_squad

    monkeypatch.setattr(shakespeare_qa, "split_plays", lambda: qa_play_paths)
    paths = shakespeare_qa.write_all(str(tmp_path))
    for (version, split), path in paths.items():
        examples, found = read_squad(path)
        assert found == version and len(examples) > 150
        with open(path, encoding="utf-8") as file:
            assert json.load(file)["version"] == f"v{version}"


def test_continuation_questions_answer_the_rest_of_a_quoted_line(qa_play_paths):
    """--continuations_per_context adds "How does the line '<first half> ...' go on?": the
    answer is the rest of that line, right after the only occurrence of its first half; v2.0's
    unanswerable ones quote the first half of a line of the same scene outside the context. The
    "who says" questions are the same as without them."""
    dev_play = qa_play_paths[1]
    plain = shakespeare_qa.build(dev_play, "2.0")
    mixed = shakespeare_qa.build(dev_play, "2.0", continuations_per_context=1)
    answered, unanswerable = 0, 0
    for context, qa in added(plain, mixed):
        head = re.fullmatch(r"How does the line '(.*) \.\.\.' go on\?", qa["question"]).group(1)
        if not qa["answers"]:
            assert head not in context and qa["is_impossible"]
            unanswerable += 1
            continue
        (answer,) = qa["answers"]
        start = answer["answer_start"]
        assert context[start:start + len(answer["text"])] == answer["text"]
        assert context.count(head) == 1
        line = context[context.index(head):].split("\n")[0]
        assert line == f"{head} {answer['text']}" and len(answer["text"].split()) >= 3
        answered += 1
    assert answered > 150 and answered / 2 <= unanswerable <= answered


def test_find_questions_answer_the_quoted_line_where_it_stands(qa_play_paths):
    """--finds_per_context adds "Find the line: '<line>'": the answer is that line, at its only
    occurrence in the context; v2.0's unanswerable ones quote a line of the same scene outside
    the context. The other questions are the same as without them, also with continuations."""
    dev_play = qa_play_paths[1]
    plain = shakespeare_qa.build(dev_play, "2.0", continuations_per_context=1)
    mixed = shakespeare_qa.build(dev_play, "2.0", continuations_per_context=1,
                                 finds_per_context=2)
    answered, unanswerable = 0, 0
    for context, qa in added(plain, mixed):
        line = re.fullmatch(r"Find the line: '(.*)'", qa["question"]).group(1)
        assert len(line.split()) >= shakespeare_qa.MIN_WORDS
        if not qa["answers"]:
            assert line not in context and qa["is_impossible"]
            unanswerable += 1
            continue
        (answer,) = qa["answers"]
        start = answer["answer_start"]
        assert answer["text"] == line and context[start:start + len(line)] == line
        assert context.count(line) == 1 and line in context.split("\n")  # a whole line
        answered += 1
    assert answered > 300 and answered / 2 <= unanswerable <= answered


def test_finds_and_renamed_speakers_go_to_the_training_files_only(tmp_path, monkeypatch, qa_play_paths):
    monkeypatch.setattr(shakespeare_qa, "split_plays", lambda: qa_play_paths)
    plain = shakespeare_qa.write_all(str(tmp_path / "plain"))
    finds = shakespeare_qa.write_all(str(tmp_path / "finds"), finds_per_context=1,
                                     rename_speakers=True)
    for key in plain:
        with open(plain[key], encoding="utf-8") as a, open(finds[key], encoding="utf-8") as b:
            before, after = json.load(a), json.load(b)
        found = sum(qa["question"].startswith("Find the line: ") for _, qa in questions(after))
        if key[1] == "dev":
            assert after == before
        else:  # renamed: test_renamed_speakers_... checks the contexts
            assert found > 50 and after["data"][0]["paragraphs"][0]["context"] != \
                before["data"][0]["paragraphs"][0]["context"]


def test_renamed_speakers_are_other_speakers_of_the_plays_the_same_within_a_context(
        qa_play_paths):
    """--rename_speakers: each context is the plays' context with every speech's heading
    renamed (consistently within the context, distinct speakers kept distinct, never the
    speaker's own name) to a speaker name of the plays; lines unchanged; every answer still
    the speaker heading the quoted line's speech; v1.1 and v2.0 rename alike."""
    plays = qa_play_paths[0] + qa_play_paths[1]
    plain = shakespeare_qa.build(plays, "2.0")
    renamed = shakespeare_qa.build(plays, "2.0", rename_speakers=True, finds_per_context=1)
    names = {speaker for path in plays for scene in shakespeare.play_scenes(open(path).read())
             for speaker, _, _ in shakespeare_qa.speeches(scene) if speaker}
    pairs = [(a, b) for x, y in zip(plain["data"], renamed["data"])
             for a, b in zip(x["paragraphs"], y["paragraphs"])]
    assert len(pairs) == sum(len(x["paragraphs"]) for x in plain["data"]) > 100
    counts = {"who": 0, "find": 0}
    for before, after in pairs:
        old = [b.split("\n") for b in before["context"].strip("\n").split("\n\n")]
        new = [b.split("\n") for b in after["context"].strip("\n").split("\n\n")]
        assert [b[1:] for b in old] == [b[1:] for b in new]
        mapping = {}
        for o, n in zip(old, new):
            if o[0] in names and len(o) > 1:
                assert n[0] in names and n[0] != o[0] and mapping.setdefault(o[0], n[0]) == n[0]
            else:
                assert n == o  # a stage direction
        assert len(set(mapping.values())) == len(mapping) >= 2
        assert not set(mapping.values()) & set(mapping)  # no speaker keeps or swaps a name
        for qa in after["qas"]:
            for answer in qa["answers"]:
                start, text = answer["answer_start"], answer["text"]
                assert after["context"][start:start + len(text)] == text
                if qa["question"].startswith("Who says: "):
                    assert text == speaker_of(after["context"], quoted(qa))
                    counts["who"] += 1
                else:
                    counts["find"] += 1
    assert counts["who"] > 300 and counts["find"] > 150
    v1 = shakespeare_qa.build(plays, "1.1", rename_speakers=True, finds_per_context=1)
    assert [p["context"] for a in v1["data"] for p in a["paragraphs"]] == \
        [p["context"] for a in renamed["data"] for p in a["paragraphs"]]
