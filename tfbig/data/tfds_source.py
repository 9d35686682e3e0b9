"""A TensorFlow Datasets split as a source: its builder (prepared, never downloaded here),
pieces of about TFDS_PIECE_BYTES of text each, and the documents of one piece."""
import functools
from collections import Counter
from collections.abc import Iterator

from tfbig.data.source_spec import TFDS_PIECE_BYTES, Piece, SourceSpec, decode_text


@functools.lru_cache(maxsize=4)
def _tfds_builder(spec: SourceSpec):
    """The dataset's builder, opened once per process (opening it reads its metadata)."""
    import tensorflow_datasets as tfds  # heavy (imports TensorFlow): only for TFDS inputs

    try:
        builder = tfds.builder(spec.tfds_name, data_dir=spec.tfds_data_dir)
    except Exception as error:  # tfds raises several types for "not found"
        raise ValueError(f"--tfds_name={spec.tfds_name!r}: cannot open it in --tfds_data_dir="
                         f"{spec.tfds_data_dir!r}: {error}") from error
    if not builder.is_prepared():
        raise ValueError(f"--tfds_name={spec.tfds_name!r} is not prepared in {builder.data_dir}; this tool "
                         "never downloads: build it first (tfds build) or set --tfds_data_dir")
    for flag in ("tfds_split", "tfds_validation_split"):
        name = getattr(spec, flag)
        if name and name not in builder.info.splits:
            raise ValueError(f"--{flag}={name!r}: {spec.tfds_name} has splits {sorted(builder.info.splits)}")
    return builder


def tfds_pieces(spec: SourceSpec, piece_bytes: int, split_name: str) -> list[Piece]:
    """Ranges of examples of one split (Piece.path holds the split name)."""
    builder = _tfds_builder(spec)
    split = builder.info.splits[split_name]
    count, total = split.num_examples, int(split.num_bytes)
    step = max(1, int(max(piece_bytes, TFDS_PIECE_BYTES) * count / max(total, 1)))
    stamp = f"{builder.info.full_name}:{count}:{total}"
    return [Piece("tfds", split_name, start, min(start + step, count),
                  total * (min(start + step, count) - start) // max(count, 1), stamp)
            for start in range(0, count, step)]


def tfds_documents(piece: Piece, spec: SourceSpec, replaced: Counter) -> Iterator[str]:
    import tensorflow_datasets as tfds

    builder = _tfds_builder(spec)
    dataset = builder.as_dataset(split=f"{piece.path}[{piece.start}:{piece.stop}]", shuffle_files=False)
    for example in tfds.as_numpy(dataset):
        if spec.tfds_text_key not in example:
            raise ValueError(f"--tfds_text_key={spec.tfds_text_key!r}: {spec.tfds_name} examples have "
                             f"features {sorted(example)}")
        value = example[spec.tfds_text_key]
        text = decode_text(value, spec.tfds_name, replaced) if isinstance(value, bytes) else str(value)
        if text.strip():
            yield text
