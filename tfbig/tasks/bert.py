"""BERT pretraining as a task: masked-LM + next-sentence prediction on "bert" shards.

The shared masked-LM task (data, dynamic masking, loss, metrics) is tfbig.tasks.masked_lm;
BERT adds its model. Metrics: mlm_loss, nsp_loss, mlm_accuracy, nsp_accuracy. Shards come
from tfbig-prep --format=bert (WordPiece vocab.txt, next-sentence pairs, whole-word masks).
--dynamic_masking re-masks single tokens, as for ALBERT.
"""
from tfbig.data.bert import BERT_MASKING
from tfbig.models.bert import BertConfig, BertForPretraining
from tfbig.tasks.masked_lm import MaskedLMTask


class BertTask(MaskedLMTask):
    """BERT pretraining (MLM + NSP) on fixed-length "bert" records of seq_length tokens."""

    format = "bert"
    pair = "nsp"
    model_name = "bert"
    _model_class = BertForPretraining
    masking_defaults = BERT_MASKING

    def _model_config(self):
        preset = BertConfig.from_preset(self.train.preset)
        return BertConfig.from_preset(
            self.train.preset, vocab_size=self.manifest.vocab_size,
            seq_length=max(self.seq_length, preset.seq_length), **self._overrides())
