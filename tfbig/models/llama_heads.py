"""Fine-tuning heads on a Llama-class decoder: sequence classification and extractive QA.

The backbone is a whole `tfbig.models.llama.Llama` (its checkpoint keys below "backbone/"); its
output projection, which no head reads, is frozen. A decoder has no [CLS]: the classifier reads
the final-norm state of each sequence's last real token (the one that has seen every other, as
Hugging Face's LlamaForSequenceClassification does), the span head every position's. Inputs are
the fine-tuning tasks' dict (tfbig.tasks.fine_tuning.INPUTS); segment ids are not read (the
tasks separate the texts with the end-of-document token), and padding only follows the text,
where causal attention keeps it from every real position.

    model = LlamaClassifier(LlamaConfig.from_preset("tiny", vocab_size=500), num_classes=3)
    logits = model({"input_ids": ids, "segment_ids": ids * 0, "input_mask": mask})["logits"]
"""
import dataclasses

import keras
from keras import ops

from tfbig.models.layers import make_initializer
from tfbig.models.layout import ModelLayout
from tfbig.models.llama import TENSOR_LAYOUT, Llama, LlamaConfig

# the backbone's tensor plan without what only the language-model head reads (its final norm
# feeding the vocabulary projection, the projection itself) and without a sequence split (a head
# reads positions anywhere in the sequence: --sequence_parallel is refused by name)
_BACKBONE_TENSOR = tuple((f"backbone.{path}", split) for path, split in TENSOR_LAYOUT
                         if path not in ("head", "final_norm") and split.kind != "sequence_mask")


def check_backbone(config, where):
    """Refuse, naming `where`, a backbone these heads cannot fine-tune: an MoE model (its
    router losses have no place in a fine-tuning task's loss yet)."""
    if config.num_experts:
        raise ValueError(f"{where}: an MoE Llama (num_experts={config.num_experts}); its "
                         f"router losses have no place in a fine-tuning task's loss yet: "
                         f"fine-tune a dense Llama-family model")


class _LlamaFineTuning(keras.Model):
    """A Llama backbone plus the head a subclass builds in `_build_head`."""

    head_name = ""

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, LlamaConfig) else LlamaConfig(**config)
        check_backbone(self.config, type(self).__name__)
        self.backbone = Llama(self.config, name="backbone")

    def build(self, input_shape=None):
        self.backbone.build()
        if self.backbone.head is not None:
            self.backbone.head.trainable = False  # no head reads the vocabulary projection
        self._build_head(self.config.hidden_size)
        self.built = True

    def sequence(self, inputs, training):
        """The final-norm states (B, T, C) of the input ids."""
        x, _ = self.backbone.hidden_states(inputs["input_ids"], training=training)
        return self.backbone.final_norm(x)

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout): the
        backbone's attention, MLP and word table as in pretraining, the small head replicated;
        the word table is read once a step here, so it is gathered around its own call."""
        return ModelLayout(
            tensor=_BACKBONE_TENSOR,
            gather_per_call=("backbone.embedding", "backbone.blocks.*", "backbone.final_norm",
                             self.head_name),
            blocks="backbone.blocks")

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}


@keras.saving.register_keras_serializable(package="tfbig")
class LlamaClassifier(_LlamaFineTuning):
    """Backbone + Dense(num_classes) on each sequence's last real token: {"logits": (B, K)}."""

    head_name = "classifier_head"

    def __init__(self, config, num_classes=2, **kwargs):
        super().__init__(config, **kwargs)
        self.num_classes = num_classes
        self.classifier_head = keras.layers.Dense(num_classes, name="classifier_head",
                                                  kernel_initializer=make_initializer(
                                                      "normal", self.config.initializer_range))

    def _build_head(self, hidden):
        self.classifier_head.build((None, hidden))

    def call(self, inputs, training=False):
        sequence = self.sequence(inputs, training)
        last = ops.sum(ops.cast(inputs["input_mask"], "int32"), axis=1) - 1  # (B,)
        pooled = ops.take_along_axis(sequence, ops.reshape(last, (-1, 1, 1)), axis=1)[:, 0]
        return {"logits": ops.cast(self.classifier_head(pooled), "float32")}

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}


@keras.saving.register_keras_serializable(package="tfbig")
class LlamaForQuestionAnswering(_LlamaFineTuning):
    """Backbone + span head: per-token start and end logits {"start_logits", "end_logits"}
    (B, T) float32, as BertForQuestionAnswering's."""

    head_name = "span_head"

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.span_head = keras.layers.Dense(2, name="span_head", kernel_initializer=(
            make_initializer("normal", self.config.initializer_range)))

    def _build_head(self, hidden):
        self.span_head.build((None, None, hidden))

    def call(self, inputs, training=False):
        logits = ops.cast(self.span_head(self.sequence(inputs, training)), "float32")
        return {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}
