"""The architecture configs and presets of tfbig's model families, without Keras.

Plain dataclasses: everything that fixes an architecture (and so its checkpoint layout), its
closed-form parameter and FLOP counts, and the named presets. `tfbig.models.gpt`,
`tfbig.models.albert` and `tfbig.models.bert` build Keras models from them; the planner
(tfbig.plan) imports them without starting TensorFlow.

Example:
    GPTConfig.from_preset("175b").num_params()     # 174.6e9
"""
import dataclasses

from tfbig.models.common import ArchitectureConfig


@dataclasses.dataclass
class GPTConfig(ArchitectureConfig):
    """Everything that fixes the GPT architecture (and so its checkpoint layout)."""

    family = "GPT"  # in messages

    vocab_size: int = 50257  # rows of the token embedding; must equal the data manifest's
    seq_length: int = 1024  # rows of the position table: the longest sequence the model reads
    num_layers: int = 12  # transformer blocks
    hidden_size: int = 768  # model width C
    num_heads: int = 12  # attention heads; hidden_size must be divisible by it
    intermediate_size: int = 0  # MLP width; 0 means 4 * hidden_size
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    layer_norm_epsilon: float = 1e-5  # LayerNorm epsilon
    pre_layer_norm: bool = True  # GPT-2 pre-LN (True) or post-LN (False)
    tie_embeddings: bool = True  # output projection reuses the token embedding
    initializer_range: float = 0.02  # std of the normal initialiser
    attention: str = "auto"  # auto | dense | blockwise: how attention scores are computed
    attention_block_size: int = 512  # rows of the query and key tiles of blockwise attention

    def __post_init__(self):
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size
        self._check_fields(("vocab_size", "seq_length", "num_layers", "hidden_size", "num_heads"))

    @classmethod
    def presets(cls):
        return GPT_PRESETS

    def num_params(self):
        """Closed-form parameter count (matches the built model exactly)."""
        c, v, L = self.hidden_size, self.vocab_size, self.num_layers
        block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) \
            + (c * self.intermediate_size + self.intermediate_size) + (self.intermediate_size * c + c)
        final_norm = 2 * c if self.pre_layer_norm else 0
        head = 0 if self.tie_embeddings else c * v
        return v * c + self.seq_length * c + L * block + final_norm + head

    def flops_per_token(self, seq_length=None):
        """Training FLOPs per token: 6 * non-embedding matmul params + attention (PaLM appendix B)."""
        t = seq_length or self.seq_length
        # Position table and (untied) token lookup are not matmuls; a tied table is the head.
        lookups = self.seq_length + (0 if self.tie_embeddings else self.vocab_size)
        matmul_params = self.num_params() - lookups * self.hidden_size
        return 6 * matmul_params + 12 * self.num_layers * self.hidden_size * t


# Presets are plain data. GPT-3 sizes follow Brown et al. (2020), table 2.1, with
# num_heads chosen so the head size is the paper's 128 where the table is inconsistent.
GPT_PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=128, vocab_size=8000),
    "small": dict(num_layers=4, hidden_size=256, num_heads=4, seq_length=256, vocab_size=8000),
    "125m": dict(num_layers=12, hidden_size=768, num_heads=12, seq_length=2048),
    "350m": dict(num_layers=24, hidden_size=1024, num_heads=16, seq_length=2048),
    "760m": dict(num_layers=24, hidden_size=1536, num_heads=16, seq_length=2048),
    "1.3b": dict(num_layers=24, hidden_size=2048, num_heads=16, seq_length=2048),
    "2.7b": dict(num_layers=32, hidden_size=2560, num_heads=32, seq_length=2048),
    "6.7b": dict(num_layers=32, hidden_size=4096, num_heads=32, seq_length=2048),
    "13b": dict(num_layers=40, hidden_size=5120, num_heads=40, seq_length=2048),
    "175b": dict(num_layers=96, hidden_size=12288, num_heads=96, seq_length=2048),
}


@dataclasses.dataclass
class AlbertConfig(ArchitectureConfig):
    """Everything that fixes the ALBERT architecture (and so its checkpoint layout)."""

    family = "ALBERT"  # in messages

    vocab_size: int = 30000  # rows of the word table; must equal the data manifest's
    embedding_size: int = 128  # E: width of the factorised word/position/segment embeddings
    hidden_size: int = 768  # H: transformer width
    num_layers: int = 12  # transformer layers run (they share num_groups parameter sets)
    num_groups: int = 1  # distinct parameter sets; layer i uses i * num_groups // num_layers
    num_heads: int = 12  # attention heads; hidden_size must be divisible by it
    intermediate_size: int = 0  # feed-forward width; 0 means 4 * hidden_size
    seq_length: int = 512  # rows of the position table: the longest sequence the model reads
    type_vocab_size: int = 2  # segment ids (sentence A / B)
    dropout: float = 0.0  # dropout on embeddings, attention and residual branches (0 in v2)
    layer_norm_epsilon: float = 1e-12  # LayerNorm epsilon
    initializer_range: float = 0.02  # std of the truncated-normal initialiser
    attention: str = "auto"  # auto | dense | blockwise: how attention scores are computed
    attention_block_size: int = 512  # rows of the query and key tiles of blockwise attention

    def __post_init__(self):
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size
        self._check_fields(("vocab_size", "embedding_size", "hidden_size", "num_layers",
                            "num_groups", "num_heads", "seq_length", "type_vocab_size"))
        if self.num_groups > self.num_layers:
            raise ValueError(f"num_groups={self.num_groups} is above num_layers="
                             f"{self.num_layers}; a group is a set of shared layer weights")

    @classmethod
    def presets(cls):
        return ALBERT_PRESETS

    def group_of_layer(self, layer):
        """Index of the parameter group transformer layer `layer` runs."""
        return layer * self.num_groups // self.num_layers

    def num_params(self, head="pretraining"):
        """Closed-form parameter count (equals the built model's exactly).

        head: "pretraining" (backbone + MLM + SOP), "question_answering" (backbone + span
        head) or None (backbone only).
        """
        v, e, h, i = self.vocab_size, self.embedding_size, self.hidden_size, self.intermediate_size
        embedding = (v + self.seq_length + self.type_vocab_size) * e + 2 * e
        block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
        backbone = embedding + (e * h + h) + self.num_groups * block + (h * h + h)
        heads = {None: 0, "pretraining": (h * e + e) + 2 * e + v + (2 * h + 2),
                 "question_answering": 2 * h + 2}
        if head not in heads:
            raise ValueError(f"head={head!r}: expected one of {list(heads)}")
        return backbone + heads[head]

    def flops_per_token(self, seq_length=None):
        """Training FLOPs per token: 6 x matmul params applied per token (layers re-run the
        shared block) + attention scores. The MLM head runs on masked positions only, ignored."""
        t = seq_length or self.seq_length
        h, i, e = self.hidden_size, self.intermediate_size, self.embedding_size
        per_layer = 4 * h * h + 2 * h * i
        return 6 * (e * h + self.num_layers * per_layer) + 12 * self.num_layers * h * t


# Presets are plain data. base..xxlarge follow Lan et al. (2019), table 1, and the released
# albert_config.json files (vocab 30000, E = 128, one group). tiny/small are CPU-sized.
ALBERT_PRESETS = {
    "tiny": dict(embedding_size=16, hidden_size=32, num_layers=2, num_heads=2, seq_length=128,
                 vocab_size=8000),
    "small": dict(embedding_size=64, hidden_size=128, num_layers=4, num_heads=4,
                  seq_length=128, vocab_size=8000),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12),
    "large": dict(hidden_size=1024, num_layers=24, num_heads=16),
    "xlarge": dict(hidden_size=2048, num_layers=24, num_heads=16),
    "xxlarge": dict(hidden_size=4096, num_layers=12, num_heads=64),
}


@dataclasses.dataclass
class BertConfig(ArchitectureConfig):
    """Everything that fixes the BERT architecture (and so its checkpoint layout)."""

    family = "BERT"  # in messages

    vocab_size: int = 30522  # rows of the word table (uncased English WordPiece: 30522)
    hidden_size: int = 768  # H: word, position and segment tables and transformer width
    num_layers: int = 12  # transformer blocks, each with its own weights
    num_heads: int = 12  # attention heads; hidden_size must be divisible by it
    intermediate_size: int = 0  # feed-forward width; 0 means 4 * hidden_size
    seq_length: int = 512  # rows of the position table: the longest sequence the model reads
    type_vocab_size: int = 2  # segment ids (sentence A / B)
    dropout: float = 0.1  # dropout on embeddings, attention probabilities and residual branches
    layer_norm_epsilon: float = 1e-12  # LayerNorm epsilon
    initializer_range: float = 0.02  # std of the truncated-normal initialiser
    approximate_gelu: bool = True  # GELU's tanh form (original BERT, keras-hub); False: erf
    attention: str = "auto"  # auto | dense | blockwise: how attention scores are computed
    attention_block_size: int = 512  # rows of the query and key tiles of blockwise attention

    def __post_init__(self):
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size
        self._check_fields(("vocab_size", "hidden_size", "num_layers", "num_heads",
                            "seq_length", "type_vocab_size"))

    @classmethod
    def presets(cls):
        return BERT_PRESETS

    def num_params(self, head="pretraining", num_classes=2):
        """Closed-form parameter count (equals the built model's exactly).

        head: "pretraining" (backbone + MLM + NSP), "question_answering" (+ span head),
        "classifier" (+ a `num_classes` head on the pooled [CLS]) or None (backbone only).
        """
        v, h, i = self.vocab_size, self.hidden_size, self.intermediate_size
        embedding = (v + self.seq_length + self.type_vocab_size) * h + 2 * h
        block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
        backbone = embedding + self.num_layers * block + (h * h + h)
        heads = {None: 0, "pretraining": (h * h + h) + 2 * h + v + (2 * h + 2),
                 "question_answering": 2 * h + 2,
                 "classifier": h * num_classes + num_classes}
        if head not in heads:
            raise ValueError(f"head={head!r}: expected one of {list(heads)}")
        return backbone + heads[head]

    def flops_per_token(self, seq_length=None):
        """Training FLOPs per token: 6 x the blocks' matmul params + attention scores (the MLM
        head runs on masked positions only, ignored)."""
        t = seq_length or self.seq_length
        h, i = self.hidden_size, self.intermediate_size
        return 6 * self.num_layers * (4 * h * h + 2 * h * i) + 12 * self.num_layers * h * t


# Presets are plain data. base/large follow Devlin et al. (2018) and the released
# bert_config.json files (uncased vocabulary 30522; cased ones are 28996, a tokenizer matter:
# tfbig-convert takes vocab_size from the files). tiny is CPU-sized.
BERT_PRESETS = {
    "tiny": dict(hidden_size=32, num_layers=2, num_heads=2, seq_length=128, vocab_size=8000),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12),
    "large": dict(hidden_size=1024, num_layers=24, num_heads=16),
}
