"""GELU, in its tanh form (GPT-2, the original BERT/ALBERT code, keras-hub) or its erf form
(Hugging Face's "gelu"), with a hand-written gradient that keeps float32 where XLA would not."""
import math

from keras import ops


def gelu(x, approximate=True):
    """GELU (tanh form, or erf with approximate=False) whose backward keeps only its input.

    The forward is keras' own (the same values); the gradient is the closed-form derivative,
    evaluated from `x` in float32. Differentiating keras' composite instead keeps every
    intermediate of the formula (x^3, the tanh argument, the tanh...): measured on this CPU,
    about 11 of the 32 hidden-widths of activations a GPT block holds per token for its
    backward, which this brings down to the one 4h input a fused GELU kernel keeps.

    The derivative is evaluated only once the gradient of the output exists (its input waits
    for a value read from it): needing only `x`, it would otherwise be ready as soon as the
    forward made `x`, and TensorFlow's executor, which runs whatever is ready, evaluated it
    then or later as its thread order fell, holding the result (and some of the formula's
    4h-wide temporaries) beside the rest of the forward and backward."""
    @ops.custom_gradient
    def gelu_keeping_input(x):
        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream
            x_now = ops.cast(x, "float32") + _zero_from(upstream)  # x, once upstream exists
            return ops.cast(ops.cast(upstream, "float32") * _gelu_derivative(x_now, approximate),
                            upstream.dtype)
        return ops.gelu(x, approximate=approximate), grad

    return gelu_keeping_input(x)


def _zero_from(tensor):
    """A float32 0 computed from one element of `tensor` (0 whatever it holds, inf or nan):
    adding it to a value makes that value wait for `tensor` without changing it."""
    first = ops.reshape(tensor, (-1,))[0]
    return ops.cast(ops.isnan(first), "float32") * 0.0


def _gelu_derivative(x, approximate):
    """d gelu(x) / dx of float32 `x`."""
    if approximate:  # 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3)
        c = math.sqrt(2.0 / math.pi)
        t = ops.tanh(c * (x + 0.044715 * x * x * x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)
    # x Phi(x): Phi(x) + x phi(x)
    return 0.5 * (1.0 + ops.erf(x / math.sqrt(2.0))) + x * ops.exp(-0.5 * x * x) / math.sqrt(
        2.0 * math.pi)
