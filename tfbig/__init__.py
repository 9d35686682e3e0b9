"""tfbig: GPT and ALBERT training on TensorFlow/Keras 3."""
