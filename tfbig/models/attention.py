"""Blockwise attention in Keras ops: softmax attention that never holds a (T, S) tensor.

FlashAttention's algorithm (Dao et al., 2022; Dao, 2023) and Rabe & Staats (2021), written
with Keras ops so the models stay backend-free. Queries and keys/values are cut into blocks of
`block_size` rows. The forward visits, for each query block, the key blocks it may see and
keeps a running maximum `m`, sum `l` and weighted sum `acc` per query row (the online
softmax); it keeps only the output and the float32 log-sum-exp per row and head for the
backward. The backward (a custom gradient) recomputes each block's probabilities from the
log-sum-exp: the (B, nh, T, S) scores, softmax and dropout mask of dense attention are never
stored, only one (B, nh, block, block) tile at a time.

- Causal: a key block wholly above the diagonal is skipped (the inner loop stops at the last
  block a query block can see), not masked; only the tiles that the diagonal crosses are masked.
- Positions: `query_offset` is the position of q's first row among k's rows, so a key/value
  cache (queries at cache_index..) and, later, a context-parallel piece (queries and keys from
  different ranks) reuse the same function; `merge_attention` joins two partial results
  through their log-sum-exp.
- Dropout on the probabilities: tile (i, j)'s mask is a stateless draw from the call's seed and
  (i, j), so the backward redraws the forward's mask instead of storing it.
- Mixed precision: matmuls in the inputs' dtype, scores, statistics and accumulators in float32.
- Masked scores are -1e9 as in dense attention; keys added to fill an uneven final block are
  -2e9, below any masked key, so they never count, even in a row whose every key is masked.

Example:
    out, lse = blockwise_attention(q, k, v, causal=True, block_size=128)
    # q, k, v: (B, T, nh, hs) -> out (B, T, nh, hs), lse (B, T, nh) float32
"""
import math

import keras
from keras import ops

MASKED = -1e9  # the score of a masked key: dense attention's value
PADDED = 2 * MASKED  # the score of a key that only fills the final block


def blockwise_attention(q, k, v, causal=False, key_mask=None, query_offset=0, block_size=512,
                        dropout=0.0, seed=None):
    """softmax(q k^T / sqrt(hs) [masked]) [dropout] v, one block of queries and keys at a time.

    q: (B, T, nh, hs); k, v: (B, S, nh, hs); key_mask: (B, S), nonzero for keys that count
    (BERT's padding mask); causal: query t sees keys <= t + query_offset (an int or an int
    scalar tensor); dropout: the rate on the probabilities, with `seed` a (2,) int tensor
    (stateless: the same seed gives the same masks). Returns (out (B, T, nh, hs) in q's dtype,
    lse (B, T, nh) float32, the log of each row's softmax denominator; -inf for a row that sees
    no key). Both are differentiable (the lse's gradient is what merging partial results needs).
    """
    tiling, mask, offset, seed = _setup(q, k, causal, key_mask, query_offset, block_size,
                                        dropout, seed)

    @ops.custom_gradient
    def attend(q, k, v, mask, offset, seed):
        out, lse = _forward(tiling, q, k, v, mask, offset, seed)

        def grad(*args, upstream=None):
            # TensorFlow passes the two outputs' gradients as two arguments; JAX as one pair
            upstream = upstream if upstream is not None else args[0] if len(args) == 1 else args
            d_out, d_lse = upstream
            dq, dk, dv = _backward(tiling, q, k, v, mask, offset, seed, out, lse, d_out, d_lse)
            return dq, dk, dv, None, None, None

        return (out, lse), grad

    return attend(q, k, v, mask, offset, seed)


def blockwise_attention_backward(q, k, v, out, lse, d_out, causal=False, key_mask=None,
                                 query_offset=0, block_size=512, dropout=0.0, seed=None):
    """The gradients (dq, dk, dv) of `blockwise_attention(q, k, v, ...)` with the same
    arguments, given its (out, lse) and the output's gradient `d_out`: for a caller that does
    not keep k and v between forward and backward (context parallelism gathers them from
    other ranks in the forward and again here) and so runs the forward without a tape."""
    tiling, mask, offset, seed = _setup(q, k, causal, key_mask, query_offset, block_size,
                                        dropout, seed)
    return _backward(tiling, q, k, v, mask, offset, seed, out, lse, d_out, None)


def _setup(q, k, causal, key_mask, query_offset, block_size, dropout, seed):
    """(tiling, key mask, offset, seed) of one call, the arguments checked."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: expected a positive number of rows")
    if dropout and seed is None:
        raise ValueError("blockwise attention with dropout needs a seed")
    length, keys = _dim(q, 1), _dim(k, 1)
    tiling = _Tiling(length, keys, block_size, causal, dropout,
                     masked=key_mask is not None or not isinstance(keys, int)
                     or keys % min(block_size, keys) != 0)
    offset = ops.convert_to_tensor(query_offset, "int32")
    mask = (ops.ones(ops.shape(k)[:2], "float32") if key_mask is None
            else ops.cast(ops.cast(key_mask, "bool"), "float32"))
    seed = ops.zeros((2,), "int32") if seed is None else ops.cast(seed, "int32")
    return tiling, mask, offset, seed


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Attention over the keys of two parts from each part's (out, lse): the outputs weighted by
    their share of the joint softmax denominator. (B, T, nh, hs), (B, T, nh) twice -> the same."""
    lse = ops.logaddexp(lse_a, lse_b)  # (B, T, nh)
    finite = ops.isfinite(lse)
    safe = ops.where(finite, lse, 0.0)
    weight_a = ops.where(finite, ops.exp(lse_a - safe), 0.0)[..., None]
    weight_b = ops.where(finite, ops.exp(lse_b - safe), 0.0)[..., None]
    out = ops.cast(out_a, "float32") * weight_a + ops.cast(out_b, "float32") * weight_b
    return ops.cast(out, out_a.dtype), lse


def _after(index, tensor):
    """`index`, once `tensor` exists. TensorFlow's while loop starts up to 10 iterations at once
    whenever their inputs are ready, and a tile's inputs are only the loop index and the
    blocks: without this, every tile of a loop was formed at the same time (measured: the
    activation memory of a step grew with T^2 again). Reading the loop's carry orders them."""
    first = ops.reshape(tensor, (-1,))[0]
    return index + ops.cast(ops.isnan(ops.cast(first, "float32")), "int32") * 0


def _dim(x, axis):
    """x's size along `axis`: a Python int where it is static, else a scalar tensor."""
    static = x.shape[axis]
    return static if static is not None else ops.shape(x)[axis]


class _Tiling:
    """How the (T, S) score matrix is cut into tiles, and which tiles a query block sees."""

    def __init__(self, length, keys, block_size, causal, dropout, masked):
        self.length, self.keys = length, keys
        # a sequence shorter than a block is one block of its own length (a decode step: 1 row)
        self.rows = min(block_size, length) if isinstance(length, int) else block_size
        self.cols = min(block_size, keys) if isinstance(keys, int) else block_size
        self.num_rows = -(-length // self.rows)  # query blocks
        self.num_cols = -(-keys // self.cols)  # key blocks
        self.causal, self.dropout = causal, dropout
        self.masked = masked  # a padding mask or an uneven final key block

    def key_blocks_seen(self, i, offset):
        """Key blocks query block i sees: all, or (causal) up to the one holding its last row's
        position; a block above the diagonal is never visited."""
        if not self.causal:
            return self.num_cols
        last = offset + (i + 1) * self.rows - 1  # the last query row's position among the keys
        return ops.clip(ops.floor_divide(last, self.cols) + 1, 0, self.num_cols)

    def first_query_block(self, j, offset):
        """The first query block that sees key block j (causal; 0 otherwise)."""
        if not self.causal:
            return 0
        return ops.maximum(ops.floor_divide(j * self.cols - offset, self.rows), 0)


def _to_blocks(x, num, size):
    """(B, L, ...) -> (num, B, ..., size, last): rows zero-padded to num * size, block-major."""
    x = _pad_rows(x, num * size)
    shape = ops.shape(x)
    x = ops.reshape(x, (shape[0], num, size) + tuple(shape[2:]))
    rank = len(x.shape)
    if rank == 3:  # (B, num, size), the key mask
        return ops.transpose(x, (1, 0, 2))
    return ops.transpose(x, (1, 0, 3, 2, 4))  # (num, B, nh, size, hs)


def _pad_rows(x, total):
    pad = total - _dim(x, 1)
    return ops.pad(x, [[0, 0], [0, pad]] + [[0, 0]] * (len(x.shape) - 2))


def _from_blocks(x, length):
    """(num, B, nh, size[, hs]) -> (B, length, nh[, hs]), the padding rows dropped."""
    if len(x.shape) == 5:
        x = ops.transpose(x, (1, 0, 3, 2, 4))  # (B, num, size, nh, hs)
    else:
        x = ops.transpose(x, (1, 0, 3, 2))  # (B, num, size, nh)
    shape = ops.shape(x)
    x = ops.reshape(x, (shape[0], shape[1] * shape[2]) + tuple(shape[3:]))
    return x[:, :length]


def _key_fill(tiling, mask):
    """(num_cols, B, 1, 1, cols) keep flags and the score each dropped key gets instead."""
    keep = _to_blocks(mask, tiling.num_cols, tiling.cols)[:, :, None, None, :]
    real = _to_blocks(ops.ones_like(mask), tiling.num_cols, tiling.cols)[:, :, None, None, :]
    return keep > 0, ops.where(real > 0, MASKED, PADDED)


def _tile(tiling, q_i, k_j, i, j, offset, keep, fill):
    """float32 scores of tile (i, j), masked: (B, nh, rows, cols), and what counts in it."""
    scale = 1.0 / math.sqrt(q_i.shape[-1])
    scores = ops.cast(ops.einsum("bhqd,bhkd->bhqk", q_i, k_j), "float32") * scale
    if not (tiling.masked or tiling.causal):
        return scores, None
    counts = ops.take(keep, j, axis=0)  # (B, 1, 1, cols)
    if tiling.causal:
        query_pos = offset + i * tiling.rows + ops.arange(tiling.rows)[:, None]  # (rows, 1)
        key_pos = j * tiling.cols + ops.arange(tiling.cols)[None, :]  # (1, cols)
        counts = ops.logical_and(counts, key_pos <= query_pos)  # (B, 1, rows, cols)
    return ops.where(counts, scores, ops.take(fill, j, axis=0)), counts


def _dropout(tiling, probs, seed, i, j):
    """Dropped-out, rescaled probabilities of tile (i, j): the same mask every call with `seed`."""
    if not tiling.dropout:
        return probs
    tile_seed = ops.stack([seed[0] * 65537 + i, seed[1] * 65537 + j])
    noise = keras.random.uniform(ops.shape(probs), seed=_FixedSeed(tile_seed))
    return ops.where(noise >= tiling.dropout, probs / (1.0 - tiling.dropout), 0.0)


class _FixedSeed(keras.random.SeedGenerator):
    """A stateless seed where keras.random expects a SeedGenerator: `next()` always returns the
    same (2,) tensor (no state variable), so a tile's dropout mask can be drawn again."""

    def __init__(self, seed):  # noqa: super().__init__ would make a state variable
        self.seed = seed

    def next(self, ordered=True):
        return self.seed


def _forward(tiling, q, k, v, mask, offset, seed):
    """Online softmax over the key blocks each query block sees -> (out, lse)."""
    batch, heads, size = ops.shape(q)[0], q.shape[2], v.shape[3]
    qb = _to_blocks(q, tiling.num_rows, tiling.rows)  # (nq, B, nh, rows, hs)
    kb = _to_blocks(k, tiling.num_cols, tiling.cols)  # (nk, B, nh, cols, hs)
    vb = _to_blocks(v, tiling.num_cols, tiling.cols)
    keep, fill = _key_fill(tiling, mask)

    def query_block(i, buffers):
        out, lse = buffers
        i = _after(i, lse)  # the previous query block is done
        q_i = ops.take(qb, i, axis=0)  # (B, nh, rows, hs)

        def key_block(j, state):
            m, l, acc = state  # (B, nh, rows), (B, nh, rows), (B, nh, rows, hs) float32
            j = _after(j, m)  # the previous tile's scores are reduced
            scores, _ = _tile(tiling, q_i, ops.take(kb, j, axis=0), i, j, offset, keep, fill)
            m_new = ops.maximum(m, ops.max(scores, axis=-1))
            probs = ops.exp(scores - m_new[..., None])  # (B, nh, rows, cols)
            rescale = ops.exp(m - m_new)
            l = l * rescale + ops.sum(probs, axis=-1)
            probs = ops.cast(_dropout(tiling, probs, seed, i, j), v.dtype)
            pv = ops.einsum("bhqk,bhkd->bhqd", probs, ops.take(vb, j, axis=0))
            return m_new, l, acc * rescale[..., None] + ops.cast(pv, "float32")

        stats = (batch, heads, tiling.rows)
        m, l, acc = ops.fori_loop(0, tiling.key_blocks_seen(i, offset), key_block, (
            ops.full(stats, -float("inf")), ops.zeros(stats), ops.zeros(stats + (size,))))
        seen = l > 0  # a row that saw no key (context-parallel pieces): out 0, lse -inf
        out_i = acc / ops.where(seen, l, 1.0)[..., None]
        lse_i = ops.where(seen, m + ops.log(ops.where(seen, l, 1.0)), -float("inf"))
        return (ops.slice_update(out, (i, 0, 0, 0, 0), ops.cast(out_i, q.dtype)[None]),
                ops.slice_update(lse, (i, 0, 0, 0), lse_i[None]))

    out, lse = ops.fori_loop(0, tiling.num_rows, query_block, (
        ops.zeros(ops.shape(qb)[:-1] + (size,), q.dtype), ops.zeros(ops.shape(qb)[:-1], "float32")))
    return _from_blocks(out, tiling.length), _from_blocks(lse, tiling.length)


def _backward(tiling, q, k, v, mask, offset, seed, out, lse, d_out, d_lse):
    """Gradients of q, k, v: each tile's probabilities recomputed from the lse (FlashAttention-2's
    backward: key blocks outside, the query blocks that see them inside)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_out = ops.cast(d_out, "float32")
    # delta_t = sum_j P_tj dP_tj = dO_t . O_t; the lse's own gradient enters as -d_lse
    delta = ops.sum(d_out * ops.cast(out, "float32"), axis=-1)  # (B, T, nh)
    if d_lse is not None:
        delta = delta - ops.where(ops.isfinite(lse), ops.cast(d_lse, "float32"), 0.0)
    qb = _to_blocks(q, tiling.num_rows, tiling.rows)  # (nq, B, nh, rows, hs)
    kb = _to_blocks(k, tiling.num_cols, tiling.cols)  # (nk, B, nh, cols, hs)
    vb = _to_blocks(v, tiling.num_cols, tiling.cols)
    dob = _to_blocks(ops.cast(d_out, q.dtype), tiling.num_rows, tiling.rows)
    # (nq, B, nh, rows); padded rows get lse 0 and delta 0 (their d_out is 0)
    lseb = _to_blocks(ops.where(ops.isfinite(lse), lse, 0.0)[..., None], tiling.num_rows,
                      tiling.rows)[..., 0]
    deltab = _to_blocks(delta[..., None], tiling.num_rows, tiling.rows)[..., 0]
    keep, fill = _key_fill(tiling, mask)

    def key_block(j, buffers):
        dq, dk, dv = buffers
        j = _after(j, dv)  # the previous key block is done
        k_j, v_j = ops.take(kb, j, axis=0), ops.take(vb, j, axis=0)  # (B, nh, cols, hs)

        def query_block(i, state):
            dq, dk_j, dv_j = state
            i = _after(i, dk_j)  # the previous tile's gradients are summed
            q_i, do_i = ops.take(qb, i, axis=0), ops.take(dob, i, axis=0)  # (B, nh, rows, hs)
            scores, counts = _tile(tiling, q_i, k_j, i, j, offset, keep, fill)
            probs = ops.exp(scores - ops.take(lseb, i, axis=0)[..., None])  # (B,nh,rows,cols)
            dropped = ops.cast(_dropout(tiling, probs, seed, i, j), q.dtype)
            dv_j = dv_j + ops.cast(ops.einsum("bhqk,bhqd->bhkd", dropped, do_i), "float32")
            d_dropped = ops.cast(ops.einsum("bhqd,bhkd->bhqk", do_i, v_j), "float32")
            d_probs = _dropout(tiling, d_dropped, seed, i, j)  # the same mask and scale
            d_scores = probs * (d_probs - ops.take(deltab, i, axis=0)[..., None])
            if counts is not None:  # a masked score is a constant: no gradient
                d_scores = ops.where(counts, d_scores, 0.0)
            d_scores = ops.cast(d_scores * scale, q.dtype)
            dk_j = dk_j + ops.cast(ops.einsum("bhqk,bhqd->bhkd", d_scores, q_i), "float32")
            dq_i = ops.take(dq, i, axis=0) + ops.cast(
                ops.einsum("bhqk,bhkd->bhqd", d_scores, k_j), "float32")
            return ops.slice_update(dq, (i, 0, 0, 0, 0), dq_i[None]), dk_j, dv_j

        zeros = ops.zeros(ops.shape(k_j), "float32")
        dq, dk_j, dv_j = ops.fori_loop(tiling.first_query_block(j, offset), tiling.num_rows,
                                       query_block, (dq, zeros, zeros))
        return (dq, ops.slice_update(dk, (j, 0, 0, 0, 0), dk_j[None]),
                ops.slice_update(dv, (j, 0, 0, 0, 0), dv_j[None]))

    dq, dk, dv = ops.fori_loop(0, tiling.num_cols, key_block, (
        ops.zeros(ops.shape(qb), "float32"), ops.zeros(ops.shape(kb), "float32"),
        ops.zeros(ops.shape(kb), "float32")))
    return tuple(ops.cast(_from_blocks(g, _dim(x, 1)), x.dtype)
                 for g, x in ((dq, q), (dk, k), (dv, v)))
