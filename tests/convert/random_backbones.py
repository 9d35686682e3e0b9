"""Random keras-hub backbones for the converter tests: weights drawn so that a swapped or missing
matrix or norm shows in the logits, and the logits keras-hub computes."""
import numpy as np


def randomize(backbone, seed=0, std=0.1):
    """Weights of std `std`, RMSNorm scales 1 +- 0.3 (in place); returns `backbone`."""
    rng = np.random.default_rng(seed)
    for w in backbone.weights:
        scale = w.path.endswith("scale")
        w.assign((scale + rng.normal(0, 0.3 if scale else std, w.shape)).astype("float32"))
    return backbone


def logits(backbone, tokens):
    """keras-hub's logits of `tokens` (no padding), through its tied or untied output layer."""
    hidden = backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
    return np.asarray(backbone.token_embedding(hidden, reverse=True))
