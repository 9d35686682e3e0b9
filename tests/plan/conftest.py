"""The in-process pipeline cases of test_memory.py place stages on logical CPU devices, which
must exist before TensorFlow initialises (as in tests/pipeline/conftest.py)."""
from tfbig.pipeline.devices import configure_cpu_devices

try:
    configure_cpu_devices(2)
except RuntimeError:  # TF started earlier with fewer: the pipeline tests' own error says so
    pass
