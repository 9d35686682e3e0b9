"""What every tfbig console script does around its `main`: help, flag errors, user errors.

    run_app("tfbig-train", main, sections=[("train", [...]), ("horovod", [...])])

- `--help` (`-h`, `--helpshort`) prints the command's own flags grouped by section, with help
  text and defaults (`--helpfull` stays absl's list of everything).
- A user mistake ends the command with one line `tfbig-<name>: error: ...` and exit code 2, no
  traceback. Which exceptions are user mistakes (`user_message`):
    * tfbig.errors.UsageError (and DamagedCheckpointError) anywhere, and
      tfbig.errors.TrainingStoppedError (a non-finite loss: the last good checkpoint is kept);
    * ValueError and file errors (FileNotFoundError, FileExistsError, NotADirectoryError,
      IsADirectoryError, PermissionError) raised by tfbig's own code (the innermost frame of
      the traceback is a file of this package, data_prep or launch): tfbig's checks of flags,
      files, manifests and shards;
    * a TensorFlow error carrying tfbig's corrupt-shard report (raised inside tf.data);
    * a flag absl could not parse.
  Anything else (a ValueError from inside Keras or TensorFlow, a TypeError, a KeyError...) is a
  bug and keeps its traceback.
- TensorFlow's "failed call to cuInit" line on a machine without an NVIDIA driver is not shown.
"""
import argparse
import os
import re
import sys
import tempfile
import textwrap
import traceback

from tfbig.errors import USER_ERROR_EXIT_CODE, TrainingStoppedError, UsageError

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
_OWN_CODE = tuple(os.path.join(_ROOT, d) + os.sep for d in ("tfbig", "data_prep", "launch"))
_FILE_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                PermissionError)
_HELP = ("--help", "-h", "--helpshort", "-help", "-?")
_CORRUPT_SHARD = "tfbig.data: shard"
# The last line of each console script's --help: its guide in the docs (docs/, mkdocs.yml).
GUIDES = {
    "tfbig-prep": "guides/prepare-data.md",
    "tfbig-train": "guides/train-gpt.md",
    "tfbig-generate": "guides/export-serve.md",
    "tfbig-squad": "guides/fine-tune.md",
    "tfbig-export": "guides/export-serve.md",
    "tfbig-profile": "guides/observe.md",
    "tfbig-launch": "guides/scale-out.md",
    "tfbig-plan": "guides/plan.md",
    "tfbig-convert": "guides/fine-tune.md",
    "tfbig-classify": "guides/fine-tune.md",
    "tfbig-doctor": "guides/check-a-cluster.md",
}


def guide_line(prog):
    """`Guide: docs/guides/NAME.md` for --help's last line ('' for a script without a guide)."""
    return f"Guide: docs/{GUIDES[prog]}" if prog in GUIDES else ""


def _raised_by_own_code(error):
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_OWN_CODE)


def _corrupt_shard_report(error):
    """tfbig.data's corrupt-shard message out of TensorFlow's `[a] [b'...'] [c]` assert text."""
    text = str(getattr(error, "message", error))
    line = next((l for l in text.splitlines() if _CORRUPT_SHARD in l), None)
    if line is None:
        return None
    words = [re.sub(r"^b?'(.*)'$", r"\1", w.strip())
             for w in re.findall(r"\[([^\[\]]*)\]", line[line.index(_CORRUPT_SHARD) - 1:])]
    message = " ".join(w for w in words if w).replace("tfbig.data: ", "", 1).replace(" ;", ";")
    return re.sub(r"(?<!-)\bskip_corrupt\b", "--skip_corrupt", message)


def user_message(error):
    """The one-line message for a user mistake, or None when `error` is a bug (see above)."""
    if isinstance(error, (UsageError, TrainingStoppedError)):
        return str(error)
    if isinstance(error, (ValueError,) + _FILE_ERRORS) and _raised_by_own_code(error):
        return str(error)
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(error, tf.errors.OpError):
        return _corrupt_shard_report(error)
    return None


def fail(prog, message):
    """Print `prog: error: message` (one line) to stderr and exit with code 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT_CODE)


def guarded(prog, main, probe=False):
    """`main` with user mistakes turned into one line and exit code 2 (bugs re-raised);
    probe=True first imports TensorFlow through `quiet_cuda_probe`."""
    def wrapper(argv):
        if probe:
            quiet_cuda_probe()
        try:
            return main(argv)
        except Exception as error:  # noqa: BLE001 - classified, bugs re-raised as they were
            message = user_message(error)
            if message is None:
                raise
            fail(prog, message)
    return wrapper


# ---- help ------------------------------------------------------------------------------------
def _default_text(flag):
    if flag.default is None or flag.default == "" or flag.default == []:
        return ""
    value = repr(flag.default) if isinstance(flag.default, str) else flag.default
    return f" (default: {value})"


def format_help(prog, summary, sections, flag_values=None, width=100):
    """The command's flags grouped by section: `--name  help (default: value)`."""
    from absl import flags

    flag_values = flag_values or flags.FLAGS
    lines = [f"usage: {prog} [--flag=value ...]", ""] + summary.strip().splitlines() + [""]
    for title, names in sections:
        lines.append(f"{title}:")
        for name in names:
            flag = flag_values[name]
            kind = "" if flag.boolean else f"={flag.flag_type()}"
            head = f"  --{name}{kind}" + ("  (or --no" + name + ")" if flag.boolean else "")
            text = (flag.help or "") + _default_text(flag)
            lines.append(head)
            lines += textwrap.wrap(text, width - 6, initial_indent="      ",
                                   subsequent_indent="      ")
        lines.append("")
    lines.append("--flagfile=FILE reads flags from a file; --helpfull lists absl's own flags too.")
    lines.append(guide_line(prog))
    return "\n".join(lines)


def own_flags(flag_values=None, exclude=()):
    """Names of the defined flags that are not absl's own (app, logging, flagfile...)."""
    from absl import flags

    flag_values = flag_values or flags.FLAGS
    names = [f.name for module, found in flag_values.flags_by_module_dict().items()
             if not module.startswith("absl.") for f in found]
    return [n for n in dict.fromkeys(names) if n not in exclude]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with tfbig's one-line errors: `prog: error: ... (see prog --help)`, exit 2."""

    def error(self, message):
        fail(self.prog, f"{message}; see {self.prog} --help")

    def format_help(self):
        return super().format_help().rstrip("\n") + "\n\n" + guide_line(self.prog) + "\n"


# ---- running a command -------------------------------------------------------------------------
def _parse_flags(prog):
    from absl import flags

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as error:
            fail(prog, f"{error}; see {prog} --help")
    return parse


def run_app(prog, main, summary, sections):
    """absl's app.run(main) with grouped --help, one-line user errors and quiet CUDA probing.

    sections: [(title, [flag names])] for --help.
    """
    from absl import app

    if any(arg in _HELP for arg in sys.argv[1:]):
        print(format_help(prog, summary, sections))
        sys.exit(0)
    if "tensorflow" in sys.modules:
        quiet_cuda_probe()  # absl's app.run makes an imported TensorFlow probe CUDA
        app.run(guarded(prog, main), flags_parser=_parse_flags(prog))
    else:  # flags first: a flag error needs no TensorFlow (seconds saved)
        app.run(guarded(prog, main, probe=True), flags_parser=_parse_flags(prog))


def quiet_cuda_probe():
    """Initialise TensorFlow's GPU platform with its error line about cuInit filtered out.

    On a machine without an NVIDIA driver TensorFlow prints `E ... failed call to cuInit` the
    first time devices are listed; it is noise there. This imports TensorFlow and lists them
    once with the C++ stderr captured, then prints every captured line except that one. With a driver, or once
    TensorFlow has initialised, it does nothing.
    """
    if os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl"):
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf  # under absl's app.run the import itself probes CUDA

            tf.config.list_physical_devices("GPU")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines(keepends=True)
    sys.stderr.write("".join(line for line in lines if "failed call to cuInit" not in line))
    sys.stderr.flush()
