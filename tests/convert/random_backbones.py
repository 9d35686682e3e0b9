"""Random keras-hub backbones for the converter tests: weights drawn so that a swapped or missing
matrix or norm shows in the logits, the logits keras-hub computes, and the tfbig run a local
preset of one converts into."""
import numpy as np

from tfbig.commands.convert import ConvertOptions, convert
from tfbig.convert.run_dir import load_model


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


def preset_to_tfbig(backbone, root):
    """Save `backbone` as a keras-hub preset in root/preset, tfbig-convert it into root/run:
    the run's model (its `config` the converted LlamaConfig)."""
    backbone.save_to_preset(str(root / "preset"))
    convert(ConvertOptions(source=str(root / "preset"), output_dir=str(root / "run")))
    return load_model(str(root / "run"))[0]
