"""--precision as Keras' global dtype policy: fp32, mixed_float16 (with loss scaling in the
loop), mixed_bfloat16; and a context that restores the previous policy."""
import contextlib

import keras

PRECISIONS = {"fp32": "float32", "mixed_float16": "mixed_float16",
              "mixed_bfloat16": "mixed_bfloat16"}


def set_precision(precision):
    """Set Keras' global dtype policy for --precision (fp32 resets it)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision={precision!r}: expected one of {sorted(PRECISIONS)}")
    keras.mixed_precision.set_global_policy(PRECISIONS[precision])


@contextlib.contextmanager
def precision_policy(precision):
    """set_precision(precision) within the context, the previous policy restored after it
    (a command run in-process leaves later models in float32)."""
    previous = keras.mixed_precision.global_policy()
    set_precision(precision)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)
