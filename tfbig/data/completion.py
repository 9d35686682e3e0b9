"""The "completion" record format: prompt-completion pairs for causal-LM fine-tuning (GPT and
Llama), the loss on the completion tokens only.

tfbig-prep --format=completion reads .jsonl records with a prompt field (--prompt_field) and a
completion field (--jsonl_field), each tokenized on its own with the checkpoint's tokenizer
(--tokenizer: required). One record is one row, not packed with others: prompt ids, completion
ids, end-of-document id, cut to `seq_length + 1` tokens and padded with the end-of-document id.
`loss_mask[t]` is 1 where the target `input_ids[t + 1]` is a completion token or the
end-of-document id that ends the completion, 0 on the prompt and the padding. A record with
no completion token inside the row (a prompt of seq_length tokens or more) is left out.

    feature      dtype   shape
    input_ids    int64   [seq_length + 1]
    loss_mask    int64   [seq_length]

Example:
    tfbig-prep --format=completion --input=pairs.jsonl --jsonl_field=completion \
        --tokenizer=runs/llama --seq_length=256 --output_dir=data/pairs
"""
from collections.abc import Iterable, Iterator

import numpy as np

ROWS_PER_BATCH = 512  # examples built, serialized and written together


def completion_features(seq_length: int) -> dict[str, tuple[str, int]]:
    """A row of `seq_length + 1` ids and the mask of the `seq_length` targets the loss counts."""
    return {"input_ids": ("int64", seq_length + 1), "loss_mask": ("int64", seq_length)}


def completion_row(prompt: list[int], completion: list[int], seq_length: int, eos: int):
    """(input_ids (seq_length + 1,), loss_mask (seq_length,)) of one pair, or None when no
    completion token fits in the row."""
    ids = (list(prompt) + list(completion) + [eos])[:seq_length + 1]
    if len(ids) <= max(len(prompt), 1):
        return None
    row = np.full(seq_length + 1, eos, dtype=np.int64)
    row[:len(ids)] = ids
    mask = np.zeros(seq_length, dtype=np.int64)
    mask[max(len(prompt), 1) - 1:len(ids) - 1] = 1  # targets len(prompt) .. len(ids) - 1
    return row, mask


def completion_examples(pairs: Iterable[tuple[list[int], list[int]]], seq_length: int,
                        tokenizer, seed: int = 0,
                        rows_per_batch: int = ROWS_PER_BATCH) -> Iterator[dict[str, np.ndarray]]:
    """Batches of {"input_ids": (N, seq_length + 1), "loss_mask": (N, seq_length)}, one row per
    (prompt ids, completion ids) pair, in input order."""
    del seed  # one row per pair: deterministic
    rows, masks = [], []
    for pair in pairs:
        if not isinstance(pair, tuple):
            raise ValueError("--format=completion reads .jsonl records with a prompt and a "
                             "completion field; this input gave plain text")
        made = completion_row(*pair, seq_length, tokenizer.eos_id)
        if made is not None:
            rows.append(made[0])
            masks.append(made[1])
        if len(rows) == rows_per_batch:
            yield {"input_ids": np.stack(rows), "loss_mask": np.stack(masks)}
            rows, masks = [], []
    if rows:
        yield {"input_ids": np.stack(rows), "loss_mask": np.stack(masks)}
