"""Shared test set-up: quiet TensorFlow logs, fp32 policy restored after each test."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_dtype_policy():
    """Tests that train in mixed precision must not leak the global policy into others."""
    yield
    keras.mixed_precision.set_global_policy("float32")
