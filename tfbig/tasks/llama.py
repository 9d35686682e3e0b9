"""Llama language modelling as a task: GPTTask's data, loss and metrics with the Llama model.

The data is the GPT format (packed `input_ids` of seq_length + 1 tokens, tfbig-prep's default),
so everything but the model is GPTTask's; runs record model_format "llama" in config.json, which
tfbig-generate and tfbig-convert --to=huggingface read.
"""
from tfbig import data
from tfbig.models.llama import Llama, LlamaConfig
from tfbig.tasks.gpt import DEFAULT_VOCAB_SIZE, GPTTask


class LlamaTask(GPTTask):
    """Next-token prediction with a Llama-class decoder (--model=llama)."""

    model_format = "llama"  # config.json's; `format` ("gpt") is the data's

    def _prepare_default(self):
        """The embedded corpus at the Llama preset's seq_length (cached, as GPTTask's)."""
        seq_length = self.train.seq_length or LlamaConfig.from_preset(self.train.preset).seq_length
        out = data.default_data_dir(seq_length, DEFAULT_VOCAB_SIZE)
        return data.prepare_locked(out, seq_length=seq_length, vocab_size=DEFAULT_VOCAB_SIZE,
                                   overwrite=True)

    def _model_config(self):
        t = self.train
        preset = LlamaConfig.from_preset(t.preset)
        return LlamaConfig.from_preset(
            t.preset, vocab_size=self.manifest.vocab_size,
            seq_length=max(self.seq_length, preset.seq_length),
            num_layers=t.num_layers or None, hidden_size=t.hidden_size or None,
            num_heads=t.num_heads or None, dropout=t.dropout if t.dropout >= 0 else None,
            intermediate_size=0 if t.hidden_size else None,  # 0: 8/3 of the new width
            attention=t.attention, attention_block_size=t.attention_block_size)

    def build_model(self):
        """The model, built (variables created) so it can be checkpointed and counted."""
        model = Llama(self.model_config, name="llama")
        model.build((None, self.seq_length))
        return model
