"""`tfbig-generate`: text from a trained GPT run directory (tfbig.models.generation samples,
tfbig.convert.run_dir.load_model reads the run, whatever layout saved it).

Example:
    tfbig-generate --model_dir=runs/gpt-small --prompt="ROMEO" --max_new_tokens=100
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # console script: no C++ INFO lines

from absl import flags  # noqa: E402

from tfbig.errors import UsageError  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("model_dir", None, "Run directory written by tfbig-train.")
    flags.DEFINE_string("prompt", "", "Text to continue (empty: start from end-of-document).")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling probability mass (1: all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.mark_flag_as_required("model_dir")


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; the prompt goes in --prompt")
    from tfbig.convert.run_dir import load_model  # TensorFlow: not for --help
    from tfbig.data.tokenizer import for_run
    from tfbig.models.generation import sample_text

    model, _ = load_model(FLAGS.model_dir)
    text = sample_text(model, for_run(FLAGS.model_dir), FLAGS.prompt,
                       FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.top_p,
                       FLAGS.seed)
    print(text)


def run():
    from tfbig.commands import cli

    define_flags()
    cli.run_app("tfbig-generate", main, __doc__, [("generate", cli.own_flags())])


if __name__ == "__main__":
    run()
