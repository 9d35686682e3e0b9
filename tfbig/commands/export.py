"""`tfbig-export`: a trained GPT as a TensorFlow SavedModel for serving (TF Serving, TFLite, C++).

The SavedModel has two signatures:
  serving_default(token_ids int32 (B, T)) -> {"logits": float32 (B, T, V)}
  next_token_logits(token_ids int32 (B, T)) -> {"logits": float32 (B, V)}   (last position)
and carries the tokenizer as an asset (`assets/tokenizer.model`; a GPT-2 converted by
tfbig-convert carries `assets/vocab.json` + `assets/merges.txt`).

With --format=hf the run (GPT, BERT, ALBERT, Llama, Mistral, Qwen, MoE) is written instead as
a Hugging Face directory (config.json, model.safetensors, the tokenizer), as tfbig-convert
--to=huggingface writes it.

Example:
    tfbig-export --model_dir=runs/gpt-small --export_dir=/tmp/gpt_savedmodel
    loaded = tf.saved_model.load("/tmp/gpt_savedmodel")
    loaded.signatures["serving_default"](token_ids=tf.constant([[1, 2, 3]]))["logits"]
    tfbig-export --model_dir=runs/llama-small --export_dir=/tmp/llama_hf --format=hf
"""
import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # console script: no C++ INFO lines

from absl import flags  # noqa: E402

from tfbig.commands import cli  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402


def _exported(model):
    """A tf.Module serving `model` through the two signatures of the module docstring."""
    import tensorflow as tf  # not imported for --help

    class Exported(tf.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        @tf.function(input_signature=[tf.TensorSpec((None, None), tf.int32, name="token_ids")],
                     autograph=False)
        def serve(self, token_ids):
            return {"logits": self.model(token_ids, training=False)}

        @tf.function(input_signature=[tf.TensorSpec((None, None), tf.int32, name="token_ids")],
                     autograph=False)
        def next_token_logits(self, token_ids):
            return {"logits": self.model(token_ids, training=False)[:, -1]}

    return Exported(model)


def _refuse_existing(export_dir):
    if os.path.exists(export_dir):
        raise FileExistsError(f"--export_dir={export_dir} exists; choose a new directory "
                              f"(nothing is overwritten)")


def export(model_dir, export_dir):
    """Write the GPT in `model_dir` to `export_dir`, which must not exist yet."""
    _refuse_existing(export_dir)
    import tensorflow as tf

    from tfbig.convert.run_dir import load_model
    from tfbig.data.tokenizer import for_run

    model, _ = load_model(model_dir)
    module = _exported(model)
    tmp = export_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(module, tmp, signatures={
        "serving_default": module.serve, "next_token_logits": module.next_token_logits})
    os.makedirs(os.path.join(tmp, "assets"), exist_ok=True)
    for name, path in for_run(model_dir).files().items():  # SentencePiece or GPT-2's BPE
        shutil.copyfile(path, os.path.join(tmp, "assets", name))
    os.replace(tmp, export_dir)
    return export_dir


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    f = flags.FLAGS
    if f.format == "hf":
        _refuse_existing(f.export_dir)
        from tfbig.commands.convert import export_huggingface

        print(export_huggingface(f.model_dir, f.export_dir))
        return
    print(export(f.model_dir, f.export_dir))


def run():
    flags.DEFINE_string("model_dir", None, "Run directory written by tfbig-train.")
    flags.DEFINE_string("export_dir", None, "New directory for the SavedModel (--format=hf: "
                                            "for the Hugging Face directory).")
    flags.DEFINE_enum("format", "savedmodel", ["savedmodel", "hf"], "savedmodel: a TensorFlow "
                      "SavedModel for serving; hf: a Hugging Face directory.")
    flags.mark_flags_as_required(["model_dir", "export_dir"])
    cli.run_app("tfbig-export", main, __doc__, [("export", cli.own_flags())])


if __name__ == "__main__":
    run()
