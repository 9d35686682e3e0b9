"""What the chief shows the user: a console progress line and TensorBoard event files."""
import os
import sys

# Step-time shares that are usually zero (one device, no checkpoint in the interval).
_SHOWN_IF_NONZERO = ("time_fraction/communication", "time_fraction/checkpoint")


def _bar(fraction, width=20):
    filled = int(round(fraction * width))
    return "[" + "=" * max(filled - 1, 0) + (">" if filled else "") + " " * (width - filled) + "]"


class RunLogger:
    """Console progress and TensorBoard scalars; a no-op on non-chief processes."""

    def __init__(self, model_dir, enabled, max_steps, stream=None):
        self.enabled = enabled
        self.max_steps = max_steps
        self.estimated = False  # max_steps is a time budget's estimate (tfbig.training.budget)
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty()
        self.writers = {}
        self.model_dir = model_dir

    def _writer(self, name):
        import tensorflow as tf  # not at import: the fine-tuning commands' --help needs none

        if name not in self.writers:
            self.writers[name] = tf.summary.create_file_writer(os.path.join(self.model_dir, name))
        return self.writers[name]

    def scalars(self, split, step, values):
        """Write each value as a TensorBoard scalar under `split` (train, validation, system)."""
        if not self.enabled:
            return
        import tensorflow as tf

        with self._writer(split).as_default(step=step):
            for key, value in values.items():
                tf.summary.scalar(key, value)

    def text(self, split, step, tag, value):
        if self.enabled:
            import tensorflow as tf

            with self._writer(split).as_default(step=step):
                tf.summary.text(tag, value)

    def progress(self, step, values):
        """One progress line: bar, step, loss, learning rate, grad norm, tokens/s (and an MoE
        model's per-expert token counts)."""
        if not self.enabled:
            return
        if self.max_steps:
            about = "~" if self.estimated else ""  # a time budget's estimate, not fixed yet
            parts = [f"{_bar(step / self.max_steps)} step {step}/{about}{self.max_steps}"]
        else:  # a time-budgeted run before its first estimate
            parts = [f"{_bar(0)} step {step}/?"]
        for key, fmt in (("loss", "loss {:.4f}"), ("learning_rate", "lr {:.2e}"),
                         ("grad_norm", "gnorm {:.3f}"), ("tokens_per_sec", "{:,.0f} tok/s"),
                         ("mfu", "MFU {:.1%}"), ("time_fraction/input", "input wait {:.0%}"),
                         ("time_fraction/communication", "comm {:.0%}"),
                         ("time_fraction/checkpoint", "ckpt {:.0%}"),
                         ("loss_scale", "scale {:g}"), ("skipped_steps", "skipped {:.0f}"),
                         ("goodput", "goodput {:.0%}")):
            if key in values and not (key in _SHOWN_IF_NONZERO and values[key] < 0.005):
                parts.append(fmt.format(values[key]))
        if "expert_tokens_min" in values:  # an MoE model: imbalance visible (tfbig.tasks.llama)
            parts.append("expert tokens {:.0f}/{:.1f}/{:.0f} (min/mean/max)".format(
                *(values[f"expert_tokens_{k}"] for k in ("min", "mean", "max"))))
            if values.get("dropped_tokens"):
                parts.append(f"dropped {values['dropped_tokens']:.0f}")
        line = " | ".join(parts)
        if self.interactive:
            ended = self.max_steps and not self.estimated and step >= self.max_steps
            self.stream.write("\r" + line + ("\n" if ended else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def info(self, message):
        if self.enabled:
            if self.interactive:
                self.stream.write("\n")
            self.stream.write(message + "\n")
            self.stream.flush()

    def flush(self):
        for writer in self.writers.values():
            writer.flush()
