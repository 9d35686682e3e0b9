"""ALBERT pretraining as a task: masked-LM + sentence-order prediction on "albert" shards.

The shared masked-LM task (data, dynamic masking, loss, metrics) is tfbig.tasks.masked_lm;
ALBERT adds its model and its section (--embedding_size, --num_groups). Metrics: mlm_loss,
sop_loss, mlm_accuracy, sop_accuracy.

Shards are the standard BERT/ALBERT pretraining format (tfbig-prep --format=albert, or shards
of tf-models-official's create_pretraining_data.py indexed with tfbig-prep --index_shards).
"""
from tfbig.models.albert import AlbertConfig, AlbertForPretraining
from tfbig.tasks.masked_lm import MaskedLMTask

METRICS = ("mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy")


class AlbertTask(MaskedLMTask):
    """ALBERT pretraining (MLM + SOP) on fixed-length "albert" records of seq_length tokens."""

    format = "albert"
    pair = "sop"
    model_name = "albert"
    _model_class = AlbertForPretraining

    def _model_config(self):
        t, a = self.train, self.albert
        preset = AlbertConfig.from_preset(t.preset)
        return AlbertConfig.from_preset(
            t.preset, vocab_size=self.manifest.vocab_size,
            seq_length=max(self.seq_length, preset.seq_length), **self._overrides(),
            embedding_size=a.embedding_size or None, num_groups=a.num_groups or None)
