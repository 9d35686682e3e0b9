"""Classification examples from a TFDS dataset already prepared on disk (GLUE's `glue/*`).

Nothing is downloaded: the dataset must have been built into --tfds_data_dir beforehand
(`tfds build glue/mnli --data_dir=...` where the internet is, then copy the directory). GLUE's
tasks name their texts (mnli: premise, hypothesis; qnli: question, sentence; sst2: sentence)
and label (a ClassLabel, e.g. entailment, neutral, contradiction): those are the defaults;
--text_a/--text_b/--label name other features.

    train, evals, names = read_tfds(options)  # [(a, b | None, label name, idx)], {split: [...]}
"""
from tfbig.errors import UsageError

DEFAULT_TEXTS = ("sentence1", "sentence2")  # ClassifyOptions' defaults (GLUE's TSV columns)


def open_builder(name, data_dir):
    """The TFDS builder of `name` (e.g. "glue/mnli"), which must be prepared in `data_dir`."""
    import tensorflow_datasets as tfds  # heavy: only for TFDS inputs

    try:
        builder = tfds.builder(name, data_dir=data_dir or None)
    except Exception as error:  # tfds raises several types for "not found"
        raise UsageError(f"--tfds_name={name!r}: cannot open it (--tfds_data_dir="
                         f"{data_dir!r}): {error}") from error
    if not builder.is_prepared():
        raise UsageError(f"--tfds_name={name!r} is not prepared in {builder.data_dir}; "
                         "tfbig-classify never downloads: build it where the internet is "
                         f"(tfds build {name} --data_dir=DIR), then pass --tfds_data_dir=DIR")
    return builder


def text_keys(builder, options):
    """(feature of text a, feature of text b or None). GLUE's own texts, in its order, unless
    --text_a/--text_b were changed from their defaults."""
    glue = list(getattr(builder.builder_config, "text_features", None) or [])
    if glue and (options.text_a, options.text_b) == DEFAULT_TEXTS:
        return glue[0], (glue[1] if len(glue) > 1 else None)
    features = builder.info.features
    for flag, key in (("text_a", options.text_a), ("text_b", options.text_b)):
        if key and key not in features:
            raise UsageError(f"--{flag}={key!r}: {builder.info.full_name} has features "
                             f"{sorted(features)}")
    return options.text_a, options.text_b or None


def label_names(builder, key):
    """The class names of the ClassLabel feature `key`, in label-id order."""
    import tensorflow_datasets as tfds

    feature = builder.info.features[key] if key in builder.info.features else None
    if not isinstance(feature, tfds.features.ClassLabel):
        kind = type(feature).__name__ if feature is not None else "no such feature"
        raise UsageError(f"--label={key!r}: {builder.info.full_name}'s label must be a "
                         f"ClassLabel (got {kind}: a regression task such as glue/stsb is not "
                         f"classification); features: {sorted(builder.info.features)}")
    return list(feature.names)


def eval_splits(builder, requested):
    """The splits to score: --tfds_eval_splits (comma-separated), else "validation", else
    every validation_* split (glue/mnli: validation_matched, validation_mismatched)."""
    splits = sorted(builder.info.splits)
    if requested:
        chosen = [s.strip() for s in requested.split(",") if s.strip()]
    else:
        chosen = ["validation"] if "validation" in splits else [
            s for s in splits if s.startswith("validation")]
    unknown = [s for s in chosen if s not in splits]
    if unknown:
        raise UsageError(f"--tfds_eval_splits={requested!r}: {builder.info.full_name} has "
                         f"splits {splits}, not {unknown}")
    return chosen


def read_split(builder, split, keys, label_key, names):
    """[(text a, text b or None, label name, idx)] of one split (idx: GLUE's example index,
    its "idx" feature, else the position); a split without labels (GLUE's test splits hold
    -1) is an error naming it."""
    import tensorflow_datasets as tfds

    if split not in builder.info.splits:
        raise UsageError(f"--tfds_split={split!r}: {builder.info.full_name} has splits "
                         f"{sorted(builder.info.splits)}")
    a_key, b_key = keys
    examples = []
    for position, row in enumerate(tfds.as_numpy(builder.as_dataset(split=split,
                                                                    shuffle_files=False))):
        label = int(row[label_key])
        if not 0 <= label < len(names):
            raise UsageError(f"{builder.info.full_name}[{split}] has label {label} (GLUE's "
                             "test splits are unlabelled); train and score on labelled splits")
        examples.append((row[a_key].decode("utf-8"),
                         row[b_key].decode("utf-8") if b_key else None, names[label],
                         int(row.get("idx", position))))
    return examples


def read_tfds(options):
    """(train examples, {eval split: examples}, class names) of --tfds_name."""
    builder = open_builder(options.tfds_name, options.tfds_data_dir)
    keys = text_keys(builder, options)
    names = label_names(builder, options.label)
    evals = {split: read_split(builder, split, keys, options.label, names)
             for split in eval_splits(builder, options.tfds_eval_splits)}
    train = read_split(builder, options.tfds_split, keys, options.label, names)
    return train, evals, names
