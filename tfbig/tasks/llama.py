"""Llama language modelling as a task: GPTTask's data, loss and metrics with the Llama model.

The data is the GPT format (packed `input_ids` of seq_length + 1 tokens, tfbig-prep's default),
so everything but the model is GPTTask's; runs record model_format "llama" in config.json, which
tfbig-generate and tfbig-convert --to=huggingface read.

With MoE layers (--num_experts, a preset such as tiny-moe) the loss adds the router's
load-balancing and z-losses times their coefficients; both are computed over each micro-batch
of each data-parallel replica (Megatron's local aux loss), so a data- or expert-parallel run
equals one process that accumulates the replicas' batches as micro-batches. The metrics add
lm_loss (the cross-entropy alone), router_aux_loss, router_z_loss, the per-expert token counts
of the micro-batch over all MoE layers (expert_tokens_min / _mean / _max) and dropped_tokens.
"""
import dataclasses

from tfbig import data
from tfbig.config import MoEConfig
from tfbig.models.llama import Llama, LlamaConfig
from tfbig.models.moe import routing_metrics
from tfbig.tasks.gpt import DEFAULT_VOCAB_SIZE, GPTTask


class LlamaTask(GPTTask):
    """Next-token prediction with a Llama-class decoder (--model=llama)."""

    model_format = "llama"  # config.json's; `format` ("gpt") is the data's
    config_section = "moe"  # its ExperimentConfig section: the MoE flags

    def __init__(self, train, moe=None):
        self.moe = moe or MoEConfig()
        super().__init__(train)

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
            attention=t.attention, attention_block_size=t.attention_block_size,
            **self._moe_overrides(preset))

    def _moe_overrides(self, preset):
        """The MoE flags set away from their defaults, as LlamaConfig fields; refused by name
        when the model would have no MoE layers to read them."""
        given = {f.name: getattr(self.moe, f.name) for f in dataclasses.fields(MoEConfig)
                 if getattr(self.moe, f.name) != f.default}
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if name in given and given[name] < 0:
                given.pop(name)  # negative: the preset's (the flag's documented meaning)
        if not (given.get("num_experts") or preset.num_experts):
            if given:
                name, value = next(iter(given.items()))
                raise ValueError(f"--{name}={value} has no effect: --preset={self.train.preset} "
                                 f"has no MoE layers (num_experts=0); add --num_experts=E or "
                                 f"choose an MoE preset (tiny-moe, mixtral-8x7b)")
            return {}
        if self.train.hidden_size and "moe_intermediate_size" not in given:
            given["moe_intermediate_size"] = 0  # 0: the dense width of the new hidden size
        return given

    def build_model(self):
        """The model, built (variables created) so it can be checkpointed and counted; an MoE
        model under --xla is refused (also one an --init_checkpoint brought)."""
        if self.model_config.num_experts and self.train.xla:
            raise ValueError("--xla: the MoE layers' expert groups have data-dependent sizes "
                             "(dropless routing), which XLA cannot compile; pass --noxla")
        model = Llama(self.model_config, name="llama")
        model.build((None, self.seq_length))
        return model

    def loss(self, model, batch, training=False):
        if not self.model_config.num_experts:
            return super().loss(model, batch, training)
        return self.loss_from_outputs(
            model(self.model_inputs(batch), training=training, return_routing=True), batch)

    def validation_outputs(self, outputs, batch):
        """GPTTask's, of the logits (an MoE model's routing left out: the lm loss only)."""
        return super().validation_outputs(
            outputs[0] if isinstance(outputs, (tuple, list)) else outputs, batch)

    def loss_from_outputs(self, outputs, batch):
        """GPTTask's of logits; of an MoE model's (logits, routing) (its call with
        return_routing, or the pipeline's last stage) the router losses added."""
        if not isinstance(outputs, (tuple, list)):
            return super().loss_from_outputs(outputs, batch)
        logits, routing = outputs
        lm_loss, _ = super().loss_from_outputs(logits, batch)
        cfg = self.model_config
        loss = (lm_loss + cfg.router_aux_loss_coef * routing["aux_loss"]
                + cfg.router_z_loss_coef * routing["z_loss"])
        return loss, {"loss": loss, "lm_loss": lm_loss, "router_aux_loss": routing["aux_loss"],
                      "router_z_loss": routing["z_loss"], **routing_metrics([routing])}
