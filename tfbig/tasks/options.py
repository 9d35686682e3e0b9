"""The fine-tuning tasks' own options: tfbig-squad's and tfbig-classify's flags (the commands
add the Trainer's, tfbig.training.finetune.FineTuneOptions). Importable without TensorFlow, so
that the commands' --help is instant."""
import dataclasses

from tfbig.config import field


@dataclasses.dataclass
class SquadData:
    """What to fine-tune and on which SQuAD files (tfbig-squad's own flags)."""

    train_file: str = field("", "SQuAD JSON (v1.1 or v2.0) to fine-tune on; empty: predict only, "
                                "with the model fine-tuned earlier in --output_dir.")
    predict_file: str = field("", "SQuAD JSON to predict (and score, if it has answers).")
    init_checkpoint: str = field("", "The model directory of a tfbig-train ALBERT or Llama "
                                     "run, or a tfbig-convert output directory (BERT, ALBERT "
                                     "or a Llama-family model): its config, tokenizer and "
                                     "latest checkpoint initialise the backbone.")
    random_init: bool = field(False, "Take --init_checkpoint's config and tokenizer but start "
                                     "from random weights (the no-pretraining baseline).")
    tokenizer: str = field("", "Without --init_checkpoint: the SentencePiece .model to use.")
    version: str = field("auto", "SQuAD version: auto (from the files) | 1.1 | 2.0.")
    max_seq_length: int = field(384, "Tokens per feature: [CLS] question [SEP] context [SEP] "
                                     "(a Llama: </s> question </s> context </s>).")
    doc_stride: int = field(128, "Tokens between the starts of a long context's windows.")
    max_query_length: int = field(64, "Question tokens kept.")
    max_answer_length: int = field(30, "Longest answer, in tokens.")
    n_best_size: int = field(20, "Start and end candidates per window; answers kept per "
                                 "question in nbest_predictions.json.")
    null_score_diff_threshold: float = field(float("nan"), "v2.0: answer '' when the null score "
                                             "minus the best span score is above this; unset: "
                                             "tuned for F1 on --predict_file.")


@dataclasses.dataclass
class ClassifyData:
    """What to fine-tune and on which examples (tfbig-classify's flags)."""

    init_checkpoint: str = field("", "A tfbig-convert output directory holding a BERT or a "
                                     "Llama-family model, or the model directory of a "
                                     "tfbig-train Llama run.")
    train_file: str = field("", "Training examples: .tsv (header row) or .jsonl.")
    eval_file: str = field("", "Examples to score (same columns).")
    text_a: str = field("sentence1", "Column (JSON key, TFDS feature) of the first text; "
                                     "with --tfds_name=glue/* the default is the task's own.")
    text_b: str = field("sentence2", "Column of the second text; empty for single sentences.")
    label: str = field("label", "Column of the label (TFDS: a ClassLabel feature).")
    max_seq_length: int = field(128, "Tokens per example: [CLS] a [SEP] b [SEP] (a Llama: "
                                     "a </s> b </s>).")
    tfds_name: str = field("", "A TFDS dataset prepared in --tfds_data_dir, e.g. glue/mnli "
                               "(instead of --train_file/--eval_file; never downloaded).")
    tfds_data_dir: str = field("", "TFDS data directory holding --tfds_name (empty: TFDS's "
                                   "default, ~/tensorflow_datasets).")
    tfds_split: str = field("train", "The TFDS split to train on.")
    tfds_eval_splits: str = field("", "Comma-separated TFDS splits to score (empty: validation, "
                                      "or every validation_* split: glue/mnli's matched and "
                                      "mismatched).")
