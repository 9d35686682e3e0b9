"""Pipeline tests place stages on logical CPU devices, which must exist before TF initialises.

Collection imports this file before any test runs a TensorFlow op. If something initialised
TensorFlow earlier with fewer devices, the strategy's own error says so in the failing tests.
"""
from tfbig.pipeline.devices import configure_cpu_devices

NUM_DEVICES = 4

try:
    configure_cpu_devices(NUM_DEVICES)
except RuntimeError:
    pass
