"""`tfbig-convert`: published BERT, ALBERT and GPT-2 checkpoints into tfbig run directories,
and tfbig BERT/ALBERT/GPT runs back out to Hugging Face directories.

    tfbig-convert --source=bert-base-uncased/ --output_dir=runs/bert-base        # HF directory
    tfbig-convert --source=uncased_L-12_H-768_A-12/ --output_dir=runs/bert-base  # Google TF1
    tfbig-convert --source=keras_hub_preset/ --output_dir=runs/bert-base         # keras-hub
    tfbig-convert --source=albert_base/ --output_dir=runs/albert-base  # model.ckpt, HF, keras-hub
    tfbig-convert --source=gpt2/ --output_dir=runs/gpt2     # HF GPT-2 or a keras-hub preset
    tfbig-convert --source=runs/bert-base --to=huggingface --output_dir=hf/      # export
    tfbig-convert --source=Llama-3.2-1B/ --output_dir=runs/llama  # Llama, Mistral, Qwen 2/3,
                         # Mixtral, Qwen3-MoE:
                         # HF safetensors or a keras-hub preset, and back (tfbig.convert.llama)

The source format and family are detected from its files (--format to force a format). The run
directory holds config.json (model_format "bert", "albert" or "gpt"), the tokenizer (vocab.txt,
ALBERT's SentencePiece model as tokenizer.model, GPT-2's vocab.json + merges.txt) and a
checkpoint any tfbig model of that family restores its backbone from
(tfbig.convert.run_dir.restore_backbone; tfbig-generate --model_dir for a GPT-2). Nothing is
downloaded.
"""
import dataclasses
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfbig.config import field  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402


@dataclasses.dataclass
class ConvertOptions:
    """What to convert, from which format, to where."""

    source: str = field("", "Directory to read: a published BERT, ALBERT, GPT-2, Llama, Mistral, "
                            "Qwen, Mixtral or Qwen3-MoE (--to=tfbig) or a tfbig "
                            "BERT/ALBERT/GPT/Llama run "
                            "directory (--to=huggingface).")
    output_dir: str = field("", "Directory to write (must not hold a checkpoint yet).")
    to: str = field("tfbig", "tfbig: import --source into a tfbig run directory; huggingface: "
                             "export a tfbig BERT/ALBERT/GPT run as config.json + "
                             "model.safetensors + its tokenizer.")
    format: str = field("auto", "Format of --source for --to=tfbig: auto (from its files) | "
                                "huggingface | keras_hub | google.")
    lowercase: str = field("auto", "Does the WordPiece tokenizer lowercase (and strip accents): "
                                   "auto (from the tokenizer files, or a Google directory's "
                                   "uncased/cased name) | true | false.")


def export_huggingface(model_dir, output_dir):
    """A tfbig run as a Hugging Face directory (tfbig-convert --to=huggingface, tfbig-export
    --format=hf); returns the path of the safetensors written."""
    from tfbig.convert import export_hf, llama
    if llama.is_run(model_dir):  # Llama family: tfbig.convert.llama
        return llama.export_command(model_dir, output_dir)
    return export_hf.export(model_dir, output_dir)


def convert(options):
    """Run one conversion; returns the path of the checkpoint or safetensors file written."""
    if not options.source or not options.output_dir:
        raise UsageError("give --source and --output_dir")
    lowercase = {"auto": None, "true": True, "false": False}.get(options.lowercase.lower(), "?")
    if lowercase == "?":
        raise UsageError(f"--lowercase={options.lowercase!r}: expected auto, true or false")
    if options.to == "huggingface":
        if options.format != "auto" or lowercase is not None:
            raise UsageError("--format and --lowercase describe an import (--to=tfbig); the "
                             "export reads them from the run's config.json")
        return export_huggingface(options.source, options.output_dir)
    if options.to != "tfbig":
        raise UsageError(f"--to={options.to!r}: expected tfbig or huggingface")
    from tfbig.convert import bert_names, llama, run_dir, sources

    if llama.is_source(options.source, options.format, lowercase):  # Llama, Mistral, Qwen
        return llama.convert_command(options.source, options.output_dir)
    published = sources.read(options.source, options.format, lowercase)
    if published.family == "gpt":
        if lowercase is not None:
            raise UsageError(f"--lowercase={options.lowercase}: applies to BERT's WordPiece "
                             f"vocabulary; {options.source} is a GPT-2 (byte-level BPE)")
        from tfbig.convert import gpt2
        return gpt2.write_run(options.output_dir, published)
    if published.family == "albert" and lowercase is not None:
        raise UsageError(f"--lowercase={options.lowercase}: applies to BERT's WordPiece "
                         f"vocabulary; {options.source} is an ALBERT (its SentencePiece model "
                         "carries its own normalisation)")
    if published.family == "albert":
        from tfbig.convert import albert
        weights = albert.google_to_tfbig(published.weights, published.config.num_groups)
    else:
        weights = bert_names.google_to_tfbig(published.weights, published.config.num_layers)
    return run_dir.write(options.output_dir, published.config, weights, published.vocab_file,
                         published.lowercase, published.source, published.family)


def main(argv=None):
    """absl entry point: flags -> ConvertOptions -> convert."""
    if argv and len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    options = ConvertOptions(**{f.name: flags.FLAGS[f.name].value
                                for f in dataclasses.fields(ConvertOptions)})
    print(f"wrote {convert(options)}")


def run():
    """The console script: define the flags and run `main` under tfbig's CLI wrapper."""
    from tfbig.commands import cli

    for f in dataclasses.fields(ConvertOptions):
        if f.name not in flags.FLAGS:
            flags.DEFINE_string(f.name, f.default, f.metadata["help"])
    cli.run_app("tfbig-convert", main, __doc__, [
        ("convert", [f.name for f in dataclasses.fields(ConvertOptions)])])


if __name__ == "__main__":
    run()
