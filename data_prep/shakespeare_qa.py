"""Embedded QA set: SQuAD-format v1.1 / v2.0 train and dev files built from the Shakespeare plays.

Each context is a stretch of a scene, whole speeches by at least two people, as tfbig-prep's
embedded corpus spells it (speaker name on its own line, then the speech). A question quotes
one line of a speech (speakers are drawn first, so answers spread over a context's speakers):

    Who says: 'Nay, answer me: stand, and unfold yourself.'?   ->  FRANCISCO

and the answer is the speaker's name as it appears in the context, at the head of that speech.
The v2.0 files add unanswerable questions (one per two answerable ones, rounded up), quoting
a line of the same scene that is not in the context. Quoted lines are at least 4 words and
occur once in their context. --continuations_per_context adds questions whose answer is the
rest of a line, after the only occurrence of its quoted first half:

    How does the line 'Nay, answer me: ...' go on?   ->  stand, and unfold yourself.

and --finds_per_context adds training questions whose answer is the quoted line itself, where
it stands in the context (the token match between question and context that "who says" needs
first, as a one-step task; the dev files are unchanged):

    Find the line: 'Nay, answer me: stand, and unfold yourself.'   ->  Nay, answer me: stand, ...

--rename_speakers gives each training context's speakers other speakers' names of the plays
(the same within the context), so a line's speaker can only be read off the context.

Dev uses the plays tfbig-prep holds out for validation (tfbig.data.DEFAULT_VALIDATION_PLAYS),
so neither pretraining nor fine-tuning has read a dev context. Deterministic for a given seed.

Example:
    python -m data_prep.shakespeare_qa --output_dir=/tmp/qa
    # /tmp/qa/shakespeare-qa-v1.1-{train,dev}.json, /tmp/qa/shakespeare-qa-v2.0-{train,dev}.json
    # training files with "find" questions and renamed speakers:
    python -m data_prep.shakespeare_qa --output_dir=/tmp/mix --finds_per_context=2 --rename_speakers
"""
import json
import os
import random
import re

from absl import app, flags

from tfbig.data import shakespeare, sources

MIN_WORDS = 4  # a shorter quote ("Ay, my lord.") is rarely unique enough to ask about
CONTINUATIONS = 0  # "how does the line go on" questions per context
FINDS = 0  # "find the line" questions per context
MIN_SPEAKERS = 2  # a context with one speaker would make "who" a trivial question
_SPEAKER = re.compile(r"^[A-Z][A-Z'. -]*[A-Z.]$")  # BERNARDO, FIRST CITIZEN, LADY MACBETH


def speeches(scene):
    """Blocks of a scene text (blank-line separated): [(speaker or None, [lines], offset)].

    `offset` is the character offset of the block in `scene`; a block whose first line is
    an upper-case name is a speech by that speaker, any other block (heading, stage
    direction) has speaker None.
    """
    blocks, offset = [], 0
    for chunk in re.split(r"(\n\n+)", scene):
        if chunk.strip() and not chunk.startswith("\n\n"):
            lines = chunk.rstrip("\n").split("\n")
            speaker = lines[0] if len(lines) > 1 and _SPEAKER.match(lines[0]) else None
            blocks.append((speaker, lines, offset))
        offset += len(chunk)
    return blocks


def contexts(scene, max_chars, min_speakers=MIN_SPEAKERS):
    """Non-overlapping runs of whole consecutive blocks, at most max_chars each, with speeches
    by at least `min_speakers` people: [(context text, [blocks])].

    Runs are grown greedily from the first unused block; a run with too few speakers is
    dropped one block at a time from its start. Block offsets are relative to the context.
    """
    blocks, result, start = speeches(scene), [], 0
    while start < len(blocks):
        end, chars = start, 0
        while end < len(blocks) and chars + len("\n".join(blocks[end][1])) <= max_chars:
            chars += len("\n".join(blocks[end][1])) + 2
            end += 1
        run = blocks[start:end]
        if len({speaker for speaker, _, _ in run if speaker}) < min_speakers:
            start += 1
            continue
        origin = run[0][2]
        text = "\n\n".join("\n".join(lines) for _, lines, _ in run) + "\n"
        result.append((text, [(speaker, lines, off - origin) for speaker, lines, off in run]))
        start = end
    return result


def renamed(blocks, names, rng):
    """(context text, blocks) with every speaker renamed: each speaker of the context gets a
    name of `names` that none of them has, the same for all their speeches, distinct for
    distinct speakers. Lines and the blocks' order are kept; offsets are of the new text."""
    speakers = sorted({speaker for speaker, _, _ in blocks if speaker})
    new = dict(zip(speakers, rng.sample(sorted(set(names) - set(speakers)), len(speakers))))
    result, offset = [], 0
    for speaker, lines, _ in blocks:
        lines = [new[speaker]] + lines[1:] if speaker else lines
        result.append((new.get(speaker), lines, offset))
        offset += len("\n".join(lines)) + 2
    return "\n\n".join("\n".join(lines) for _, lines, _ in result) + "\n", result


def _quotable(line, context):
    return len(line.split()) >= MIN_WORDS and context.count(line) == 1


def answerable_questions(context, blocks):
    """Every (line, speaker, speaker offset) whose line can be asked about in `context`."""
    found = []
    for speaker, lines, offset in blocks:
        if speaker is None:
            continue
        for line in lines[1:]:
            if _quotable(line.strip(), context):
                found.append((line.strip(), speaker, offset))
    return found


def question(line):
    return f"Who says: '{line}'?"


def continuation(head):
    return f"How does the line '{head} ...' go on?"


def find(line):
    return f"Find the line: '{line}'"


def split_line(line):
    """(head, rest) of a quotable line: the first half of its words and the rest, or None
    for a line too short to split into two parts of at least MIN_WORDS // 2 + 1 words."""
    words = line.split()
    half = len(words) // 2
    if min(half, len(words) - half) < MIN_WORDS // 2 + 1:
        return None
    head = " ".join(words[:half])
    return head, line[line.index(words[half], len(head)):]


def continuation_questions(context, blocks):
    """Every (head, rest, rest offset) whose line can be asked to be continued in `context`."""
    found = []
    for line, _, _ in answerable_questions(context, blocks):
        parts = split_line(line)
        if parts and context.count(parts[0]) == 1:
            start = context.index(line) + line.index(parts[1], len(parts[0]))
            found.append((parts[0], parts[1], start))
    return found


def _spread(candidates, count, rng):
    """`count` candidates by different speakers where possible: speaker first, then a line."""
    by_speaker = {}
    for candidate in candidates:
        by_speaker.setdefault(candidate[1], []).append(candidate)
    speakers = sorted(by_speaker)
    rng.shuffle(speakers)
    return [rng.choice(by_speaker[speakers[i % len(speakers)]]) for i in range(count)] \
        if speakers else []


def _continuations(context, blocks, scene_lines, rng, prefix, count, with_impossible):
    """Up to `count` "how does the line go on" questions (v2.0: one unanswerable per two)."""
    candidates = continuation_questions(context, blocks)
    qas = []
    for i, (head, rest, start) in enumerate(rng.sample(candidates, min(count, len(candidates)))):
        assert context[start:start + len(rest)] == rest
        qa = {"id": f"{prefix}-k{i}", "question": continuation(head),
              "answers": [{"text": rest, "answer_start": start}]}
        qas.append({**qa, "is_impossible": False} if with_impossible else qa)
    if with_impossible and qas:
        heads = sorted({parts[0] for parts in map(split_line, scene_lines)
                        if parts and parts[0] not in context})
        for i, head in enumerate(rng.sample(heads, min(-(-len(qas) // 2), len(heads)))):
            qas.append({"id": f"{prefix}-m{i}", "question": continuation(head), "answers": [],
                        "is_impossible": True})
    return qas


def _outside(context, scene_lines, rng, count):
    """Up to `count` lines of the scene that are not in `context` (unanswerable questions)."""
    outside = sorted({line for line in scene_lines if line not in context})
    return rng.sample(outside, min(count, len(outside)))


def _finds(context, blocks, scene_lines, rng, prefix, count, with_impossible):
    """Up to `count` "find the line" questions, lines of different speakers where possible
    (v2.0: one unanswerable per two, a line of the scene outside the context).

    The answer is the quoted line where it stands in the context: the start and end logits of
    a token can learn from its own match with the question's tokens, one step, where "who
    says" needs that match and then the speaker a line away. The rng draws after the other
    question types', so their questions stay the same with or without these.
    """
    chosen = list(dict.fromkeys(_spread(answerable_questions(context, blocks), count, rng)))
    qas = []
    for i, (line, _, _) in enumerate(chosen):
        qa = {"id": f"{prefix}-f{i}", "question": find(line),
              "answers": [{"text": line, "answer_start": context.index(line)}]}
        qas.append({**qa, "is_impossible": False} if with_impossible else qa)
    if with_impossible and qas:
        for i, line in enumerate(_outside(context, scene_lines, rng, -(-len(qas) // 2))):
            qas.append({"id": f"{prefix}-g{i}", "question": find(line), "answers": [],
                        "is_impossible": True})
    return qas


def _paragraph(context, blocks, scene_lines, rng, prefix, num_questions, with_impossible,
               num_continuations=0, num_finds=0):
    candidates = answerable_questions(context, blocks)
    chosen = list(dict.fromkeys(_spread(candidates, num_questions, rng)))  # no repeats
    qas = []
    for i, (line, speaker, offset) in enumerate(chosen):
        assert context[offset:offset + len(speaker)] == speaker
        qa = {"id": f"{prefix}-q{i}", "question": question(line),
              "answers": [{"text": speaker, "answer_start": offset}]}
        qas.append({**qa, "is_impossible": False} if with_impossible else qa)
    if with_impossible and qas:  # one unanswerable per two answerable, rounded up
        for i, line in enumerate(_outside(context, scene_lines, rng, -(-len(qas) // 2))):
            qas.append({"id": f"{prefix}-n{i}", "question": question(line), "answers": [],
                        "is_impossible": True})
    if num_continuations:
        qas += _continuations(context, blocks, scene_lines, rng, prefix, num_continuations,
                              with_impossible)
    if num_finds:
        qas += _finds(context, blocks, scene_lines, rng, prefix, num_finds, with_impossible)
    return {"context": context, "qas": qas} if qas else None


def build(plays, version, seed=0, max_chars=300, questions_per_context=2,
          continuations_per_context=CONTINUATIONS, finds_per_context=FINDS,
          rename_speakers=False):
    """A SQuAD-format dict for `plays` (paths of Markdown plays) and version "1.1" or "2.0".

    v2.0 has the same answerable questions as v1.1 (same seed) plus one unanswerable
    question per two answerable ones in each context (rounded up). With `rename_speakers`
    each context's speakers are renamed (`renamed`) with names of speakers of `plays`, drawn
    per context: a line's speaker cannot be remembered from one context to the next, only
    found in the context.
    """
    if version not in ("1.1", "2.0"):
        raise ValueError(f"--version={version!r}: expected 1.1 or 2.0")
    texts = {}
    for path in plays:
        with open(path, encoding="utf-8") as file:
            texts[path] = shakespeare.play_scenes(file.read())
    names = sorted({speaker for scenes in texts.values() for scene in scenes
                    for speaker, _, _ in speeches(scene) if speaker}) if rename_speakers else []
    data = []
    for path in plays:
        name, scenes = shakespeare.play_name(path), texts[path]
        paragraphs = []
        for s, scene in enumerate(scenes):
            scene_lines = [line.strip() for speaker, lines, _ in speeches(scene) if speaker
                           for line in lines[1:] if len(line.split()) >= MIN_WORDS]
            for c, (context, blocks) in enumerate(contexts(scene, max_chars)):
                if rename_speakers:
                    context, blocks = renamed(blocks, names,
                                              random.Random(f"{seed}-{name}-{s}-{c}-names"))
                rng = random.Random(f"{seed}-{name}-{s}-{c}")  # independent of other contexts
                paragraph = _paragraph(context, blocks, scene_lines, rng, f"{name}-s{s}-c{c}",
                                       questions_per_context, version == "2.0",
                                       continuations_per_context, finds_per_context)
                if paragraph:
                    paragraphs.append(paragraph)
        data.append({"title": name, "paragraphs": paragraphs})
    return {"version": f"v{version}", "data": data}


def split_plays(validation=sources.DEFAULT_VALIDATION_PLAYS):
    """(train play paths, dev play paths): dev = the plays tfbig-prep holds out."""
    plays = shakespeare.shakespeare_plays()
    dev = [p for p in plays if shakespeare.play_name(p) in validation]
    return [p for p in plays if p not in dev], dev


def write_all(output_dir, seed=0, max_chars=300, questions_per_context=2,
              continuations_per_context=CONTINUATIONS, finds_per_context=FINDS,
              rename_speakers=False):
    """Write the four files; returns {(version, split): path}. "Find the line" questions and
    renamed speakers are for the training files only: the dev files hold the plays' own text
    and the questions the scores are about."""
    os.makedirs(output_dir, exist_ok=True)
    train, dev = split_plays()
    paths = {}
    for version in ("1.1", "2.0"):
        for split, plays in (("train", train), ("dev", dev)):
            path = os.path.join(output_dir, f"shakespeare-qa-v{version}-{split}.json")
            content = build(plays, version, seed, max_chars, questions_per_context,
                            continuations_per_context,
                            finds_per_context if split == "train" else 0,
                            rename_speakers and split == "train")
            with open(path + ".tmp", "w", encoding="utf-8") as file:
                json.dump(content, file, ensure_ascii=False)
            os.replace(path + ".tmp", path)
            paths[version, split] = path
    return paths


def count_questions(dataset):
    """(answerable, unanswerable) questions in a SQuAD dict."""
    qas = [qa for article in dataset["data"] for p in article["paragraphs"] for qa in p["qas"]]
    impossible = sum(1 for qa in qas if not qa["answers"])
    return len(qas) - impossible, impossible


FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "shakespeare-qa", "Where the four JSON files are written.")
flags.DEFINE_integer("seed", 0, "Seed for the choice of quoted lines.")
flags.DEFINE_integer("max_chars", 300, "Context length in characters (whole speeches; a "
                                       "longer single speech is kept whole).")
flags.DEFINE_integer("questions_per_context", 2, "Answerable questions per context (v2.0 adds "
                                                  "one unanswerable per two, rounded up).")


flags.DEFINE_integer("continuations_per_context", CONTINUATIONS,
                     "'How does the line ... go on?' questions per context (answer: the rest "
                     "of a quoted half line; v2.0 adds one unanswerable per two).")
flags.DEFINE_integer("finds_per_context", FINDS,
                     "'Find the line: ...' questions per context of the training files "
                     "(answer: the quoted line itself; v2.0 adds one unanswerable per two); "
                     "the dev files are unchanged.")
flags.DEFINE_bool("rename_speakers", False,
                  "Training files: rename each context's speakers with other speakers' names "
                  "(drawn per context, the same within it), so that who says a line cannot be "
                  "memorised, only read off the context; the dev files are unchanged.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if FLAGS.continuations_per_context < 0:
        raise app.UsageError(f"--continuations_per_context={FLAGS.continuations_per_context}: "
                             "expected 0 or more questions per context")
    if FLAGS.finds_per_context < 0:
        raise app.UsageError(f"--finds_per_context={FLAGS.finds_per_context}: expected 0 or "
                             "more questions per context")
    paths = write_all(FLAGS.output_dir, FLAGS.seed, FLAGS.max_chars, FLAGS.questions_per_context,
                      FLAGS.continuations_per_context, FLAGS.finds_per_context,
                      FLAGS.rename_speakers)
    for (version, split), path in sorted(paths.items()):
        with open(path, encoding="utf-8") as file:
            answerable, impossible = count_questions(json.load(file))
        print(f"{path}: {answerable} answerable, {impossible} unanswerable questions")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
