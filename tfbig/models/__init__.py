"""tfbig.models: the model families, plain Keras 3 (no distribution code).

The public surface (`__all__`), imported on first use so `import tfbig.models.configs` stays
free of Keras:

    GPT, GPTConfig, GPT_PRESETS                                   models.gpt, models.configs
    BertForPretraining, BertClassifier, BertForQuestionAnswering, BertConfig, BERT_PRESETS
    AlbertForPretraining, AlbertForQuestionAnswering, AlbertConfig, ALBERT_PRESETS
    Llama, LlamaConfig, LLAMA_PRESETS                             models.llama, models.llama_config
"""
_LAZY = {"GPT": "gpt", "GPTConfig": "configs", "GPT_PRESETS": "configs",
         "BertForPretraining": "bert", "BertClassifier": "bert",
         "BertForQuestionAnswering": "bert", "BertConfig": "configs", "BERT_PRESETS": "configs",
         "AlbertForPretraining": "albert", "AlbertForQuestionAnswering": "albert",
         "AlbertConfig": "configs", "ALBERT_PRESETS": "configs",
         "Llama": "llama", "LlamaConfig": "llama_config", "LLAMA_PRESETS": "llama_config"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"tfbig.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tfbig.models' has no attribute {name!r}")
