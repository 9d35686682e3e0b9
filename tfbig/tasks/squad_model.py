"""The SQuAD model and where it comes from: ALBERT, BERT or a Llama with a new span head.

The backbone comes from a run directory: a tfbig-train ALBERT run (config.json, tokenizer.model
and its latest checkpoint) or a BERT/ALBERT converted by tfbig-convert (BERT: vocab.txt and
the casing in config.json; ALBERT: the released SentencePiece model as tokenizer.model, read
with ALBERT's text preparation), a Llama-family run (tfbig-train --model=llama, or a
tfbig-convert of a Hugging Face one: the tokenizer it carries, tfbig.data.tokenizer.for_run),
or is initialised at random with the same configuration (the ablation that shows what
pretraining is worth). The span head is always new.

    config, tokenizer = pretrained_config("runs/albert")
    model = build_model(config, init_checkpoint="runs/albert")
"""
import json
import os

import keras

from tfbig.convert import run_dir
from tfbig.models.albert import AlbertConfig, AlbertForQuestionAnswering
from tfbig.models.bert import BertConfig, BertForQuestionAnswering
from tfbig.models.llama_config import LlamaConfig
from tfbig.models.llama_heads import LlamaForQuestionAnswering, check_backbone

INPUTS = ("input_ids", "segment_ids", "input_mask")
FAMILIES = {"albert": (AlbertConfig, AlbertForQuestionAnswering),
            "bert": (BertConfig, BertForQuestionAnswering),
            "llama": (LlamaConfig, LlamaForQuestionAnswering)}


def family_of(config):
    """"albert", "bert" or "llama": the model_format of a config."""
    return next(name for name, (cls, _) in FAMILIES.items() if isinstance(config, cls))


def read_model_dir(model_dir, saved, flag="--init_checkpoint"):
    """(config, tokenizer) from a run directory's config.json dict `saved`: ALBERT with
    tokenizer.model (SentencePiece: `sentencepiece_tokenizer`), BERT with the WordPiece
    vocabulary it names, a Llama with the tokenizer the run carries."""
    family = saved.get("model_format")
    if family not in FAMILIES:
        raise ValueError(f"{flag}={model_dir} holds a {family!r} model; tfbig-squad fine-tunes "
                         f"ALBERT (tfbig-train --model=albert), BERT (tfbig-convert) or a "
                         f"Llama-family model (tfbig-train --model=llama, tfbig-convert)")
    config = FAMILIES[family][0](**saved["model_config"])
    if family == "llama":
        from tfbig.data.tokenizer import for_run

        check_backbone(config, f"{flag}={model_dir}")
        return config, for_run(model_dir)
    if family == "bert":
        from tfbig.data.wordpiece import WordPieceTokenizer

        return config, WordPieceTokenizer.from_run(model_dir, saved["tokenizer"])
    tokenizer = os.path.join(model_dir, "tokenizer.model")
    if not os.path.isfile(tokenizer):
        raise ValueError(f"{flag}={model_dir}: no tokenizer.model next to the checkpoint")
    return config, sentencepiece_tokenizer(tokenizer)


def sentencepiece_tokenizer(path):
    """An ALBERT run's tokenizer.model: tfbig's own SentencePiece (tfbig-train), or a released
    ALBERT one (tfbig-convert of Google's or Hugging Face's ALBERT) with ALBERT's text
    preparation, encoding a question or a context as one segment (no [SEP] per line)."""
    from tfbig.data import load_tokenizer
    from tfbig.data.albert_spm import AlbertSentencePiece

    tokenizer = load_tokenizer(path)
    if isinstance(tokenizer, AlbertSentencePiece):
        return AlbertSentencePiece(tokenizer.processor, path, line_ends=False)
    return tokenizer


def pretrained_config(model_dir):
    """(config, tokenizer) of a tfbig-train --model=albert run or a tfbig-convert run."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--init_checkpoint={model_dir}: no config.json; expected the "
                         "--model_dir of a tfbig-train --model=albert run or the --output_dir "
                         "of tfbig-convert")
    with open(path) as file:
        return read_model_dir(model_dir, json.load(file))


def build_model(config, init_checkpoint=None, seed=0):
    """An AlbertForQuestionAnswering, BertForQuestionAnswering or LlamaForQuestionAnswering
    (by the config's type); its backbone restored from `init_checkpoint` (a run directory or
    checkpoint path) if given, else randomly initialised. A pooler is frozen: the span head
    reads tokens only, so it would get no gradient (a Llama's output projection alike)."""
    keras.utils.set_random_seed(seed)
    family = family_of(config)
    model = FAMILIES[family][1](config, name=f"{family}_qa")
    model.build()
    if family != "llama":
        model.backbone.pooler.trainable = False
    if init_checkpoint:
        run_dir.restore_backbone(model, init_checkpoint,
                                 stored="" if family == "llama" else "backbone/")
    return model
