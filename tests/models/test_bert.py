"""BERT model: exact parameter formula for every head, published sizes, checkpoint keys shared
with ALBERT, padding mask, config round trip."""
import keras
import numpy as np
import pytest

from tfbig.checkpoints.checkpoint import model_variables
from tfbig.models.albert import AlbertConfig, AlbertForPretraining
from tfbig.models.bert import (BertClassifier, BertConfig, BertForPretraining,
                               BertForQuestionAnswering)

ODD = dict(vocab_size=101, hidden_size=36, num_heads=3, intermediate_size=52, num_layers=2,
           seq_length=40, dropout=0.0)


def build(cls, **kwargs):
    keras.utils.set_random_seed(0)
    model = cls(BertConfig(**ODD), **kwargs)
    model.build()
    return model


def inputs(batch=2, length=9):
    rng = np.random.default_rng(1)
    return {"input_ids": rng.integers(0, 101, (batch, length)).astype("int32"),
            "segment_ids": (np.arange(length) >= 4).astype("int32")[None].repeat(batch, 0),
            "input_mask": np.ones((batch, length), "int32"),
            "masked_lm_positions": np.array([[1, 3], [2, 8]], "int32")}


@pytest.mark.parametrize("cls, head, kwargs", [
    (BertForPretraining, "pretraining", {}), (BertForQuestionAnswering, "question_answering", {}),
    (BertClassifier, "classifier", {"num_classes": 3})])
def test_closed_form_parameter_count_equals_built_model(cls, head, kwargs):
    model = build(cls, **kwargs)
    built = sum(int(np.prod(v.shape)) for v in model_variables(model).values())
    assert built == BertConfig(**ODD).num_params(head, **{"num_classes": 3} if kwargs else {})


def test_presets_match_the_published_models():
    # Hugging Face's BertModel for bert-base-uncased / bert-large-uncased holds exactly these
    # (the papers round them to 110M and 340M; large is 335M, 1.4% under its rounded figure).
    base, large = BertConfig.from_preset("base"), BertConfig.from_preset("large")
    assert base.num_params(None) == 109_482_240
    assert abs(base.num_params(None) / 110e6 - 1) < 0.01
    assert large.num_params(None) == 335_141_888
    assert abs(large.num_params(None) / 340e6 - 1) < 0.015


def test_keys_are_albert_keys_where_the_parts_are_the_same():
    bert = set(model_variables(build(BertForPretraining)))
    albert_model = AlbertForPretraining(AlbertConfig.from_preset("tiny", vocab_size=50))
    albert_model.build()
    albert = set(model_variables(albert_model))
    shared = {k for k in albert if not k.startswith(("backbone/group_", "backbone/projection",
                                                     "sop_head"))}
    assert shared <= bert
    assert {k.replace("nsp_head", "sop_head") for k in bert if k.startswith("nsp_head")} == \
        {k for k in albert if k.startswith("sop_head")}
    assert "backbone/block_1/attn/qkv/kernel" in bert


def test_padding_never_changes_real_positions_and_heads_have_their_shapes():
    model = build(BertForPretraining)
    x = inputs()
    fill = {"input_ids": 7, "segment_ids": 1, "input_mask": 0}  # 3 padded positions
    padded = {**x, **{k: np.concatenate([x[k], np.full((2, 3), value, "int32")], 1)
                      for k, value in fill.items()}}
    a, b = model(x), model(padded)
    np.testing.assert_allclose(a["mlm_logits"], b["mlm_logits"], atol=1e-5)
    np.testing.assert_allclose(a["nsp_logits"], b["nsp_logits"], atol=1e-5)
    assert a["mlm_logits"].shape == (2, 2, 101) and a["nsp_logits"].shape == (2, 2)
    qa = build(BertForQuestionAnswering)(x)
    assert qa["start_logits"].shape == (2, 9) and qa["end_logits"].shape == (2, 9)
    assert build(BertClassifier, num_classes=3)(x)["logits"].shape == (2, 3)


def test_config_round_trip():
    model = build(BertClassifier, num_classes=3)
    clone = BertClassifier.from_config(model.get_config())
    assert clone.config == model.config and clone.num_classes == 3
