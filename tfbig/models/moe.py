"""Sparse mixture-of-experts MLP: a top-k router, E SwiGLU experts, optional shared experts.

Three separable parts, as Megatron Core's MoE: the router (`route`: which k experts each token
goes to, with what weight, and the load-balancing statistics), the dispatcher (`SparseMoE.
dispatch`: rows grouped by expert in, each row's expert output back) and the grouped experts
(`ExpertBank`). The dispatcher is the one place expert parallelism touches: by default it runs
the rows through this layer's own experts; a backend (tfbig.distribute.expert_parallel)
replaces it on the instance with an all-to-all that sends each row to the rank holding its
expert. The model knows nothing about distribution.

Routing is dropless by default (every token reaches its k experts); with a capacity factor cf
an expert takes at most ceil(cf * N * k / E) of a batch's N tokens, first choices first (the
slot-major order of GShard and Switch), and the rest of its assignments are dropped (their
token keeps only the residual and the other experts) and counted. Expert groups have
data-dependent sizes, so the layer runs outside XLA.

Shared experts (`shared_intermediate_size`): one SwiGLU every token goes through, added to the
routed experts' sum; with `shared_gate` (Qwen2-MoE) its output is scaled per token by the
sigmoid of one more logit, sigmoid(x . w) with w (C, 1).

Router softmax (`router_softmax`): "after_topk" (Mixtral: the k chosen logits' softmax, so the
weights sum to 1) or "before_topk" (Qwen-MoE with norm_topk_prob false: the chosen experts'
probabilities of the softmax over all E). Router logits and probabilities are float32.

Example:
    moe = SparseMoE(hidden_size=32, intermediate_size=64, num_experts=4, experts_per_token=2)
    y, routing = moe(x)   # (B, T, 32); routing["aux_loss"], ["z_loss"], ["tokens_per_expert"]
    metrics = routing_metrics([routing])  # what the progress line shows of the routing
"""
import keras
import tensorflow as tf
from keras import ops

from tfbig.models.layers import make_initializer

ROUTER_SOFTMAX = ("after_topk", "before_topk")


def route(logits, experts_per_token, router_softmax="after_topk", capacity_factor=0.0,
          token_sums=None):
    """Token-choice top-k routing of float32 router `logits` (N, E). `token_sums`: a function
    of (assignments per expert (E,), router probabilities summed per expert (E,), token count
    ()) giving those sums over every token of the batch where this call sees only part of it
    (SparseMoE.token_sums); the load-balancing loss and the counts are over those.

    Returns a dict of tensors:
      experts (k, N) int32: the chosen experts, slot-major (slot 0 = each token's first choice);
      weights (k, N) float32: their combine weights, 0 for a dropped assignment;
      kept (k, N) bool: False for an assignment past its expert's capacity;
      tokens_per_expert (E,) float32: assignments the router made to each expert (before drops);
      dropped_tokens () float32: assignments dropped by the capacity;
      aux_loss () float32: the Switch load-balancing loss E * sum_e f_e * P_e, f_e the share of
        the N*k assignments made to e, P_e the mean router probability of e (1 when balanced);
      z_loss () float32: the router z-loss mean_n logsumexp(logits_n)^2 (ST-MoE).
    """
    num_tokens, num_experts = ops.shape(logits)[0], logits.shape[-1]
    k = experts_per_token
    probs = ops.softmax(logits, axis=-1)  # (N, E)
    top_logits, top_experts = ops.top_k(logits, k=k)  # (N, k)
    if router_softmax == "after_topk":  # k = 1: weight 1 (Switch's k = 1 is before_topk)
        top_weights = ops.softmax(top_logits, axis=-1) if k > 1 else ops.ones_like(top_logits)
    else:
        top_weights = ops.take_along_axis(probs, top_experts, axis=-1)
    experts = ops.cast(ops.transpose(top_experts), "int32")  # (k, N)
    weights = ops.transpose(top_weights)  # (k, N)
    chosen = ops.one_hot(ops.reshape(experts, (-1,)), num_experts)  # (k*N, E) slot-major
    tokens_per_expert = ops.sum(chosen, axis=0)  # (E,)
    kept = ops.ones_like(experts, dtype="bool")
    if capacity_factor > 0:
        capacity = ops.ceil(capacity_factor * ops.cast(num_tokens * k, "float32") / num_experts)
        position = ops.sum((ops.cumsum(chosen, axis=0) - 1.0) * chosen, axis=-1)  # (k*N,)
        kept = ops.reshape(position < capacity, (k, -1))
        weights = ops.where(kept, weights, 0.0)
    prob_sums, count = ops.sum(probs, axis=0), ops.cast(num_tokens, "float32")
    if token_sums is not None:
        tokens_per_expert, prob_sums, count = token_sums(tokens_per_expert, prob_sums, count)
    share = tokens_per_expert / (count * k)
    aux_loss = num_experts * ops.sum(share * prob_sums / count)
    z_loss = ops.mean(ops.square(ops.logsumexp(logits, axis=-1)))
    dropped = ops.sum(1.0 - ops.cast(kept, "float32"))
    return {"experts": experts, "weights": weights, "kept": kept,
            "tokens_per_expert": tokens_per_expert, "dropped_tokens": dropped,
            "aux_loss": aux_loss, "z_loss": z_loss}


def routing_metrics(routings):
    """{expert_tokens_min, _mean, _max, dropped_tokens}: float32 scalars over the MoE layers'
    routing statistics (each layer's SparseMoE stats, or a model's stacked ones: its
    tokens_per_expert (L, E) and dropped_tokens (L,)). A task's loss returns them beside the
    loss; the training log shows them (the load per expert: imbalance visible)."""
    counts = tf.concat([tf.reshape(r["tokens_per_expert"], (-1,)) for r in routings], 0)
    dropped = tf.add_n([tf.reduce_sum(r["dropped_tokens"]) for r in routings])
    return {"expert_tokens_min": tf.reduce_min(counts),
            "expert_tokens_mean": tf.reduce_mean(counts),
            "expert_tokens_max": tf.reduce_max(counts),
            "dropped_tokens": tf.cast(dropped, tf.float32)}


class ExpertBank(keras.layers.Layer):
    """`num_experts` SwiGLU experts as three stacked weights: gate, up (E, C, I), down (E, I, C)
    (keras-hub Mixtral's layout). `call(rows, counts)`: rows (M, C) grouped by expert, counts[e]
    rows for expert e in order -> (M, C), each row through its expert."""

    def __init__(self, num_experts, hidden_size, intermediate_size, initializer_range=0.02,
                 output_initializer_range=None, **kwargs):
        super().__init__(**kwargs)
        self.num_experts = num_experts  # the experts this layer holds
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range

    def build(self, input_shape=None):
        e, c, i = self.num_experts, self.hidden_size, self.intermediate_size
        std = self.initializer_range

        def weight(shape, name, std):
            return self.add_weight(shape=shape, initializer=make_initializer("normal", std),
                                   name=name)

        self.gate = weight((e, c, i), "gate", std)
        self.up = weight((e, c, i), "up", std)
        self.down = weight((e, i, c), "down", self.output_initializer_range or std)

    def call(self, rows, counts):
        groups = tf.split(rows, counts, num=self.num_experts, axis=0)  # E x (M_e, C)
        out = []
        for e, x in enumerate(groups):
            gate = ops.matmul(x, ops.cast(self.gate[e], x.dtype))  # (M_e, I)
            gate = ops.cast(ops.silu(ops.cast(gate, "float32")), x.dtype)
            up = ops.matmul(x, ops.cast(self.up[e], x.dtype))
            out.append(ops.matmul(gate * up, ops.cast(self.down[e], x.dtype)))  # (M_e, C)
        return ops.concatenate(out, axis=0)

    def get_config(self):
        return {**super().get_config(), "num_experts": self.num_experts,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range}


class SparseMoE(keras.layers.Layer):
    """The MoE MLP: x (B, T, C) -> (y (B, T, C), routing dict of `route`, without the per-
    assignment tensors). y = sum over a token's kept experts of weight * expert(x) [+ the
    shared experts' SwiGLU(x), always applied]."""

    def __init__(self, hidden_size, intermediate_size, num_experts, experts_per_token=2,
                 router_softmax="after_topk", capacity_factor=0.0, shared_intermediate_size=0,
                 initializer_range=0.02, output_initializer_range=None, shared_gate=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # of one expert
        self.num_experts = num_experts  # E of the router (all experts, wherever they live)
        self.experts_per_token = experts_per_token
        self.router_softmax = router_softmax
        self.capacity_factor = capacity_factor
        self.shared_intermediate_size = shared_intermediate_size  # 0: no shared experts
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.router = keras.layers.Dense(num_experts, use_bias=False, name="router",
                                         kernel_initializer=make_initializer(
                                             "normal", initializer_range))
        self.experts = ExpertBank(num_experts, hidden_size, intermediate_size,
                                  initializer_range, output_initializer_range, name="experts")
        # The shared experts: one SwiGLU of their summed width that every token goes through.
        self.shared = ExpertBank(1, hidden_size, shared_intermediate_size, initializer_range,
                                 output_initializer_range, name="shared") \
            if shared_intermediate_size else None
        if shared_gate and not shared_intermediate_size:
            raise ValueError("shared_gate=True needs shared experts (shared_intermediate_size "
                             "> 0): it scales their output")
        self.shared_gate = keras.layers.Dense(
            1, use_bias=False, name="shared_gate",
            kernel_initializer=make_initializer("normal", initializer_range)) \
            if shared_gate else None

    def build(self, input_shape):
        self.router.build(input_shape)
        self.experts.build()
        if self.shared is not None:
            self.shared.build()
        if self.shared_gate is not None:
            self.shared_gate.build(input_shape)

    def dispatch(self, rows, counts):
        """Rows (M, C) grouped by expert (counts (E,) int32 of them per expert, in expert
        order) -> (M, C): each row through its expert. Here: this layer's own experts; an
        expert-parallel backend replaces this method on the instance."""
        return self.experts(rows, counts)

    def token_sums(self, tokens_per_expert, prob_sums, count):
        """The router's per-expert assignments and probability sums and the token count over
        the whole batch (`route`). Here: this call's own tokens are the batch; a backend that
        splits the sequences over ranks (context parallelism) replaces this method on the
        instance."""
        return tokens_per_expert, prob_sums, count

    def call(self, x):
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        tokens = ops.reshape(x, (-1, self.hidden_size))  # (N, C)
        kernel = ops.cast(self.router.kernel, "float32")
        routing = route(ops.matmul(ops.cast(tokens, "float32"), kernel),
                        self.experts_per_token, self.router_softmax, self.capacity_factor,
                        self.token_sums)
        y = self._through_experts(tokens, routing)
        if self.shared is not None:
            shared = self.shared(tokens, tf.shape(tokens)[:1])
            if self.shared_gate is not None:  # Qwen2-MoE: sigmoid(x . w) per token, in float32
                gate = ops.sigmoid(ops.cast(self.shared_gate(tokens), "float32"))
                shared = shared * ops.cast(gate, shared.dtype)
            y = y + shared
        stats = {k: routing[k] for k in ("tokens_per_expert", "dropped_tokens", "aux_loss",
                                         "z_loss")}
        return ops.reshape(y, (batch, length, self.hidden_size)), stats

    def _through_experts(self, tokens, routing):
        """sum_k weight * expert(token) over each token's kept assignments: (N, C)."""
        num_tokens = ops.shape(tokens)[0]
        # Dropped assignments get expert id E: they sort after every real expert's rows.
        experts = ops.where(routing["kept"], routing["experts"], self.num_experts)
        experts = ops.reshape(experts, (-1,))  # (k*N,) slot-major
        order = tf.argsort(experts, stable=True)  # grouped by expert, token order inside
        counts = tf.math.bincount(experts, minlength=self.num_experts + 1,
                                  maxlength=self.num_experts + 1, dtype=tf.int32)
        kept = ops.sum(counts[:-1])
        token_of = ops.mod(order[:kept], num_tokens)  # (M,) assignment -> token
        rows = self.dispatch(ops.take(tokens, token_of, axis=0), counts[:-1])  # (M, C)
        rows = ops.concatenate([rows, ops.zeros((ops.shape(order)[0] - kept, self.hidden_size),
                                                rows.dtype)], axis=0)
        back = ops.take(rows, tf.math.invert_permutation(order), axis=0)  # (k*N, C)
        back = ops.reshape(back, (self.experts_per_token, num_tokens, self.hidden_size))
        weights = ops.cast(routing["weights"], back.dtype)[..., None]  # (k, N, 1)
        return ops.sum(back * weights, axis=0)  # (N, C)

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_experts": self.num_experts,
                "experts_per_token": self.experts_per_token,
                "router_softmax": self.router_softmax, "capacity_factor": self.capacity_factor,
                "shared_intermediate_size": self.shared_intermediate_size,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range,
                "shared_gate": self.shared_gate is not None}
