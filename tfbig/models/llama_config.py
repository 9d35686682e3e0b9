"""The Llama-class decoder's architecture config and presets, without Keras.

One dataclass covers Llama 2/3, Mistral (without a sliding window), Qwen 2 (q/k/v biases) and
Qwen 3 (QK-norm): what differs between them is a field. `tfbig.models.llama` builds the Keras
model from it; the planner imports it without starting TensorFlow.

Example:
    LlamaConfig.from_preset("llama-8b").num_params()     # 8.03e9
"""
import dataclasses

from tfbig.models.common import ArchitectureConfig, check_attention

ROPE_SCALING = ("none", "llama3")  # Hugging Face rope_scaling types this model computes


@dataclasses.dataclass
class LlamaConfig(ArchitectureConfig):
    """Everything that fixes a Llama-class decoder (and so its checkpoint layout)."""

    family = "Llama"  # in messages

    vocab_size: int = 32000  # rows of the token embedding; must equal the data manifest's
    seq_length: int = 2048  # the longest sequence the model reads (RoPE has no table)
    num_layers: int = 16  # transformer blocks
    hidden_size: int = 2048  # model width C
    num_heads: int = 32  # query heads
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 means num_heads
    head_size: int = 0  # width of one head; 0 means hidden_size // num_heads
    intermediate_size: int = 0  # SwiGLU width; 0 means 8/3 * hidden_size rounded up to 256
    rope_theta: float = 10000.0  # RoPE base: wavelengths run from 2 pi to 2 pi * theta
    rope_scaling: str = "none"  # none | llama3: Llama 3.1's long-context frequency scaling
    rope_factor: float = 8.0  # llama3 scaling: low frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original/this scale
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original/this keep
    rope_original_seq_length: int = 8192  # llama3 scaling: the pretraining context length
    rms_norm_epsilon: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # output projection reuses the token embedding (small models)
    attention_bias: bool = False  # biases on the q/k/v projections (Qwen 2)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen 3)
    dropout: float = 0.0  # dropout on attention probabilities and residual branches
    initializer_range: float = 0.02  # std of the normal initialiser
    attention: str = "auto"  # auto | dense | blockwise: how attention scores are computed
    attention_block_size: int = 512  # rows of the query and key tiles of blockwise attention

    def __post_init__(self):
        if self.num_kv_heads == 0:
            self.num_kv_heads = self.num_heads
        if self.head_size == 0 and self.num_heads > 0:
            self.head_size = self.hidden_size // self.num_heads
        if self.intermediate_size == 0:
            self.intermediate_size = -(-8 * self.hidden_size // 3 // 256) * 256
        for name in ("vocab_size", "seq_length", "num_layers", "hidden_size", "num_heads",
                     "num_kv_heads", "head_size", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads="
                             f"{self.num_kv_heads}; each key/value head serves a whole group "
                             "of query heads")
        if self.head_size % 2:
            raise ValueError(f"head_size={self.head_size} is odd; RoPE rotates pairs of "
                             "features")
        if self.rope_scaling not in ROPE_SCALING:
            raise ValueError(f"rope_scaling={self.rope_scaling!r}: expected one of "
                             f"{' | '.join(ROPE_SCALING)}")
        check_attention(self.attention, self.attention_block_size)

    @classmethod
    def presets(cls):
        return LLAMA_PRESETS

    @property
    def groups(self):
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def block_params(self):
        """Parameters of one transformer block."""
        c, hs, i = self.hidden_size, self.head_size, self.intermediate_size
        q, kv = self.num_heads * hs, self.num_kv_heads * hs
        attention = c * q + 2 * c * kv + q * c + ((q + 2 * kv) if self.attention_bias else 0)
        return 2 * c + attention + (2 * hs if self.qk_norm else 0) + 3 * c * i

    def block_matmul_params(self):
        """Weights of one block's matrices (q, k, v, proj; gate, up, down): what a token
        multiplies by, without the norm scales and biases."""
        c, hs = self.hidden_size, self.head_size
        q, kv = self.num_heads * hs, self.num_kv_heads * hs
        return 2 * c * q + 2 * c * kv + 3 * c * self.intermediate_size

    def num_params(self):
        """Closed-form parameter count (matches the built model exactly)."""
        c, v = self.hidden_size, self.vocab_size
        head = 0 if self.tie_embeddings else c * v
        return v * c + self.num_layers * self.block_params() + c + head

    def flops_per_token(self, seq_length=None):
        """Training FLOPs per token: 6 x matmul params applied per token (the head included,
        the token lookup not) + attention scores and weighted sums (PaLM appendix B)."""
        t = seq_length or self.seq_length
        matmul_params = self.num_layers * self.block_matmul_params() + \
            self.hidden_size * self.vocab_size
        return 6 * matmul_params + 12 * self.num_layers * self.num_heads * self.head_size * t


# Presets are plain data. tiny/small are CPU-sized (small: the main job's GPT `small` widths,
# tied like SmolLM); the rest are the published Llama 3.x shapes (config.json of
# meta-llama/Llama-3.2-1B, Llama-3.1-8B, -70B, -405B), for the planner and conversion. Their
# seq_length is the 8192-token pretraining context (what tfbig-plan plans at); RoPE scaling
# reads up to 131072 (--seq_length raises it: RoPE has no table to grow).
_LLAMA3_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_seq_length=8192, vocab_size=128256, seq_length=8192,
                    num_kv_heads=8)
LLAMA_PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                 intermediate_size=176, seq_length=128, vocab_size=8000),
    "small": dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=688, seq_length=256, vocab_size=8000, tie_embeddings=True),
    "llama-1b": dict(_LLAMA3_ROPE, num_layers=16, hidden_size=2048, num_heads=32,
                     intermediate_size=8192, rope_factor=32.0, tie_embeddings=True),
    "llama-8b": dict(_LLAMA3_ROPE, num_layers=32, hidden_size=4096, num_heads=32,
                     intermediate_size=14336),
    "llama-70b": dict(_LLAMA3_ROPE, num_layers=80, hidden_size=8192, num_heads=64,
                      intermediate_size=28672),
    "llama-405b": dict(_LLAMA3_ROPE, num_layers=126, hidden_size=16384, num_heads=128,
                       intermediate_size=53248),
}
