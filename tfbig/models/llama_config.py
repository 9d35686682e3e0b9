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
ROUTER_SOFTMAX = ("after_topk", "before_topk")  # tfbig.models.moe.ROUTER_SOFTMAX


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
    num_experts: int = 0  # E experts in each block's MoE MLP (tfbig.models.moe); 0: dense MLP
    experts_per_token: int = 2  # MoE: k experts each token is routed to (1 or 2)
    moe_intermediate_size: int = 0  # MoE: SwiGLU width of one expert; 0 means intermediate_size
    shared_intermediate_size: int = 0  # MoE: width of the shared experts every token uses; 0: none
    shared_expert_gate: bool = False  # MoE: shared experts' output x sigmoid(x . w) (Qwen2-MoE)
    router_softmax: str = "after_topk"  # MoE: after_topk (Mixtral) | before_topk (Qwen-MoE)
    capacity_factor: float = 0.0  # MoE: 0 dropless; > 0 an expert takes ceil(cf*N*k/E) tokens
    router_aux_loss_coef: float = 0.01  # MoE: weight of the load-balancing loss in the loss
    router_z_loss_coef: float = 0.0  # MoE: weight of the router z-loss in the loss

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
        if self.num_experts:
            self._check_experts()

    def _check_experts(self):
        """Refuse an MoE setting that cannot route, naming the flag."""
        if self.moe_intermediate_size == 0:
            self.moe_intermediate_size = self.intermediate_size
        if self.num_experts < 0:
            raise ValueError(f"--num_experts={self.num_experts}: expected 0 (a dense MLP) or "
                             f"a positive number of experts")
        if not 1 <= self.experts_per_token <= min(2, self.num_experts):
            raise ValueError(f"--experts_per_token={self.experts_per_token}: expected 1 or 2, "
                             f"at most --num_experts={self.num_experts}")
        if self.router_softmax not in ROUTER_SOFTMAX:
            raise ValueError(f"--router_softmax={self.router_softmax!r}: expected one of "
                             f"{' | '.join(ROUTER_SOFTMAX)}")
        if self.capacity_factor < 0:
            raise ValueError(f"--capacity_factor={self.capacity_factor:g}: expected 0 "
                             f"(dropless routing) or a positive factor such as 1.25")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "shared_intermediate_size",
                     "moe_intermediate_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name}={getattr(self, name)}: expected a value >= 0")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError("--shared_expert_gate scales the shared experts' output: set "
                             "--shared_intermediate_size above 0 too")

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
        return 2 * c + attention + (2 * hs if self.qk_norm else 0) + self.mlp_params()

    def mlp_params(self, active=False):
        """Parameters of one block's MLP: 3 C I dense; with experts the router, the E
        experts (k of them with `active`: what one token multiplies by) and the shared ones."""
        c = self.hidden_size
        if not self.num_experts:
            return 3 * c * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        return c * (self.num_experts + int(self.shared_expert_gate)) + 3 * c * (
            experts * self.moe_intermediate_size + self.shared_intermediate_size)

    def expert_params(self):
        """Parameters of one block's routed experts (what --expert_parallel splits)."""
        return 3 * self.hidden_size * self.num_experts * self.moe_intermediate_size

    def block_matmul_params(self):
        """Weights of one block's matrices (q, k, v, proj; gate, up, down; with experts the
        router and the k experts a token uses): what a token multiplies by, without the norm
        scales and biases."""
        c, hs = self.hidden_size, self.head_size
        q, kv = self.num_heads * hs, self.num_kv_heads * hs
        return 2 * c * q + 2 * c * kv + self.mlp_params(active=True)

    def num_params(self):
        """Closed-form parameter count (matches the built model exactly)."""
        c, v = self.hidden_size, self.vocab_size
        head = 0 if self.tie_embeddings else c * v
        return v * c + self.num_layers * self.block_params() + c + head

    def active_params(self):
        """Parameters one token uses (= num_params() for a dense model): k of E experts."""
        return self.num_params() - self.num_layers * (self.mlp_params() -
                                                      self.mlp_params(active=True))

    def flops_per_token(self, seq_length=None):
        """Training FLOPs per token: 6 x matmul params applied per token (active experts only,
        the head included,
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
    # Mixture of experts (tfbig.models.moe): a CPU-test size and Mixtral 8x7B's shapes
    # (config.json of mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active).
    "tiny-moe": dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                     intermediate_size=64, seq_length=128, vocab_size=8000, num_experts=4,
                     experts_per_token=2),
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                         intermediate_size=14336, seq_length=32768, vocab_size=32000,
                         rope_theta=1e6, num_experts=8, experts_per_token=2,
                         router_aux_loss_coef=0.02),
}
