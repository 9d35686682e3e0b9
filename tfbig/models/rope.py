"""Rotary position embeddings (RoPE) of the Llama family (tfbig.models.llama): the inverse
frequencies (with Llama 3.1's long-context scaling) and the rotation of query and key heads.
"""
import math

from keras import ops

ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
               "rope_high_freq_factor", "rope_original_seq_length")


def rope_frequencies(head_size, rope):
    """float32 (head_size / 2,) inverse frequencies theta^(-2i/hs), with Llama 3.1's scaling
    when rope["rope_scaling"] == "llama3" (Hugging Face's _compute_llama3_parameters):
    wavelengths above original/low_freq_factor are divided by `rope_factor`, those below
    original/high_freq_factor kept, the band between interpolated."""
    exponent = ops.arange(0, head_size, 2, dtype="float32") / float(head_size)
    inverse = 1.0 / (float(rope["rope_theta"]) ** exponent)  # (hs/2,)
    if rope["rope_scaling"] != "llama3":
        return inverse
    original, factor = rope["rope_original_seq_length"], rope["rope_factor"]
    low, high = rope["rope_low_freq_factor"], rope["rope_high_freq_factor"]
    wavelength = 2 * math.pi / inverse
    scaled = ops.where(wavelength > original / low, inverse / factor, inverse)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ops.logical_and(wavelength >= original / high, wavelength <= original / low)
    return ops.where(medium, smoothed, scaled)


def apply_rope(x, inverse_frequencies, positions):
    """Rotate (B, T, n, hs) query or key heads to float32 `positions` (T,) (the half-split
    pairing (i, i + hs/2) of Hugging Face's rotate_half and keras-hub); float32 inside."""
    angles = positions[:, None] * inverse_frequencies[None, :]  # (T, hs/2)
    angles = ops.concatenate([angles, angles], axis=-1)[None, :, None, :]  # (1, T, 1, hs)
    x32 = ops.cast(x, "float32")
    first, second = ops.split(x32, 2, axis=-1)  # (B, T, n, hs/2) each
    rotated = ops.concatenate([-second, first], axis=-1)  # (B, T, n, hs)
    return ops.cast(x32 * ops.cos(angles) + rotated * ops.sin(angles), x.dtype)
