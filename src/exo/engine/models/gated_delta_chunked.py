"""The gated delta rule over a prompt in chunks (the WY form), in MLX ops.

The token loop (mlx-lm's ``gated_delta_ops``, one compiled step per row) runs, for every row t,

    S = g_t * S;  u_t = beta_t * (v_t - S k_t);  S = S + u_t k_t^T;  y_t = S q_t

with S [Dv, Dk] per value head: T sequential steps of tiny ops, which on a GPU cost their launches (a
4,096-token prompt is 4,096 steps per layer). Within a chunk of C rows every u_t is a linear function of
the state the chunk starts with, so a chunk is a few C x C and C x D products, done for all chunks of the
prompt at once, and only the chunk-to-chunk state update stays sequential (one per C rows):

    G_t = sum_{i<=t} log g_i (in the chunk);  decay(t, i) = exp(G_t - G_i)
    A[t, i] = beta_t decay(t, i) (k_t . k_i) for i < t          (strictly lower triangular)
    T = (I + A)^-1                                               (block forward substitution, below)
    U~ = T (beta v);  W = T (beta exp(G) k)                      (the "pseudo-values" of the WY form)
    u = U~ - W S^T                                               (S: the state before the chunk)
    y = exp(G) q S^T + (decay . (q k^T), i <= t) u
    S' = exp(G_C) S + u^T (exp(G_C - G) k)

Everything is computed in float32 whatever the inputs' dtype (as mlx-lm's loop keeps its state), and the
result equals the loop's up to float32 rounding: the products sum in another order
(tests/engine/test_gated_delta_chunked.py states and tests the tolerance).

A masked row (a batch's left padding, mlx-lm's ``mask``) leaves the state as it was, exactly as mlx-lm's
masked step does: it enters with beta = 0 and log g = 0 (no update, no decay), and its output is 0 (as
mlx-lm's Metal kernel writes it; the loop's output there is padding nobody reads).

``(I + A)^-1`` is taken by block forward substitution, doubling the block size each level:
``[[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]]``. Every product there involves the inverse
of a diagonal block, which the delta rule keeps bounded (each step's ``I - beta k k^T`` is a contraction for
unit keys): a Neumann series ``sum (-A)^n`` would be shorter but its powers of A grow like binomial
coefficients and cancel catastrophically in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

# (u_free, w, k_out, g_last, state) -> (each chunk's starting state, the last state): ``chunk_states_ops``' signature
StateSteps = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], tuple[mx.array, mx.array]]

# Rows per chunk: the C x C products stay small, the sequential part is T / C steps (bench/prefill.py --gdn-chunk
# measures others).
CHUNK = 64


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g as mlx-lm's ``compute_g`` takes it before its exp (the same ops in the same dtypes)."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)


def _inverse_unit_lower(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower triangular ``a`` [..., C, C] (C a power of two), by block forward
    substitution from 1 x 1 blocks up."""
    *lead, c, _ = a.shape
    inv = mx.ones((*lead, c, 1, 1), dtype=a.dtype)  # the diagonal blocks of the inverse, size s = 1
    s = 1
    while s < c:
        m = c // (2 * s)
        blocks = mx.diagonal(a.reshape(*lead, m, 2 * s, m, 2 * s), axis1=-4, axis2=-2)  # [..., 2s, 2s, m]
        below = mx.moveaxis(blocks, -1, -3)[..., s:, :s]  # L21 of every 2s block: [..., m, s, s]
        upper, lower = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        corner = -(lower @ (below @ upper))
        zeros = mx.zeros_like(upper)
        inv = mx.concatenate(
            [mx.concatenate([upper, zeros], axis=-1), mx.concatenate([corner, lower], axis=-1)], axis=-2
        )
        s *= 2
    return inv.reshape(*lead, c, c)


def chunk_products(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, mask: mx.array | None, chunk: int
) -> tuple[mx.array, ...]:
    """The parallel part of ``gated_delta_chunked`` (every chunk at once): U~, W, the decayed keys that update
    the state, each chunk's decay, the queries that read the chunk's starting state and the outputs' intra-chunk
    part, laid out [B, Hk, Hv / Hk, N, C, D] (``bench/prefill.py`` times it apart from the state updates)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    r = Hv // Hk
    f32 = mx.float32
    beta = beta.astype(f32)
    log_g = log_g.astype(f32)
    if mask is not None:  # a masked row: no decay, no update
        beta = mx.where(mask[..., None], beta, 0)
        log_g = mx.where(mask[..., None], log_g, 0)
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:  # trailing rows of beta = 0, log g = 0: the state passes them unchanged
        def padded(x: mx.array) -> mx.array:
            return mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

        q, k, v, log_g, beta = padded(q), padded(k), padded(v), padded(log_g), padded(beta)

    C = chunk
    # Head-major, chunk-split layouts: key heads [B, Hk, 1, N, C, Dk], value heads [B, Hk, r, N, C, D]; the
    # cast after the transpose writes them contiguous, so the products below take them without copies.
    qc = q.reshape(B, n, C, Hk, 1, Dk).transpose(0, 3, 4, 1, 2, 5).astype(f32)
    kc = k.reshape(B, n, C, Hk, 1, Dk).transpose(0, 3, 4, 1, 2, 5).astype(f32)
    vc = v.reshape(B, n, C, Hk, r, Dv).transpose(0, 3, 4, 1, 2, 5).astype(f32)
    bc = beta.reshape(B, n, C, Hk, r).transpose(0, 3, 4, 1, 2)  # [B, Hk, r, N, C]
    gc = mx.cumsum(log_g.reshape(B, n, C, Hk, r).transpose(0, 3, 4, 1, 2), axis=-1)  # G_t in its chunk

    kt = kc.swapaxes(-1, -2)
    kk = kc @ kt  # [B, Hk, 1, N, C, C]: shared by the value heads of a key head
    qk = qc @ kt
    rows = mx.arange(C)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    diff = gc[..., :, None] - gc[..., None, :]  # G_t - G_i
    decay = mx.exp(mx.where(causal, diff, -mx.inf))  # 0 above the diagonal (no overflow of exp there)
    a = mx.where(strict, bc[..., :, None] * decay * kk, 0)
    t_inv = _inverse_unit_lower(a)  # [B, Hk, r, N, C, C]
    eg = mx.exp(gc)
    u_free = t_inv @ (bc[..., None] * vc)  # U~ [.., C, Dv]
    w = t_inv @ ((bc * eg)[..., None] * kc)  # W [.., C, Dk]
    p = decay * qk  # lower triangular incl. the diagonal
    q_state = eg[..., None] * qc - p @ w  # y = q_state S^T + p U~
    y_free = p @ u_free
    last = gc[..., -1:]  # G_C per chunk
    k_out = mx.exp(last - gc)[..., None] * kc  # [.., C, Dk]
    g_last = mx.exp(last)[..., None]  # [B, Hk, r, N, 1, 1]
    return u_free, w, k_out, g_last, q_state, y_free


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    chunk: int = CHUNK,
    steps: StateSteps | None = None,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over T rows in chunks of ``chunk`` (a power of two).

    q, k: [B, T, Hk, Dk] (normalized and scaled as mlx-lm's ``normalize_qk`` leaves them); v: [B, T, Hv, Dv]
    with Hv a multiple of Hk (value head h reads key head h // (Hv / Hk)); log_g: [B, T, Hv] (log of the
    per-row scalar decay, ``log_decay``); beta: [B, T, Hv]; state: [B, Hv, Dv, Dk] (None: zeros); mask:
    [B, T] bool (False: the row leaves the state unchanged and outputs 0). Returns y [B, T, Hv, Dv] in q's
    dtype and the state after the last row, float32. ``steps``: what computes the chunk-to-chunk state steps
    (None: MLX ops, ``chunk_states_ops``; on MLX CUDA the layers may pass the kernel,
    ``gated_delta_states_cuda.chunk_states``).
    """
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, not {chunk}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    r = Hv // Hk
    out_dtype = q.dtype
    f32 = mx.float32
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=f32)
    u_free, w, k_out, g_last, q_state, y_free = chunk_products(q, k, v, log_g, beta, mask, chunk)
    n, C = u_free.shape[3], chunk

    G = B * Hv
    before, s = (steps or chunk_states_ops)(u_free.reshape(G, n, C, Dv), w.reshape(G, n, C, Dk), k_out.reshape(G, n, C, Dk),
                      g_last.reshape(G, n), state.astype(f32).reshape(G, Dv, Dk))
    before = before.reshape(B, Hk, r, n, Dv, Dk)  # each chunk's starting state
    y = mx.addmm(y_free, q_state, before.swapaxes(-1, -2))  # [B, Hk, r, N, C, Dv]
    y = y.transpose(0, 3, 4, 1, 2, 5).reshape(B, n * C, Hv, Dv)[:, :T]
    if mask is not None:
        y = mx.where(mask[..., None, None], y, 0)
    return y.astype(out_dtype), s.reshape(B, Hv, Dv, Dk)


def chunk_states_ops(u_free: mx.array, w: mx.array, k_out: mx.array, g_last: mx.array,
                     s: mx.array) -> tuple[mx.array, mx.array]:
    """The chunk-to-chunk state steps as MLX ops, three products a chunk (the only sequential part): u_free
    [G, N, C, Dv], w and k_out [G, N, C, Dk], g_last [G, N], s [G, Dv, Dk] (G = batch x value heads), float32 ->
    (each chunk's starting state [G, N, Dv, Dk], the state after the last chunk [G, Dv, Dk])."""
    starts = []
    for c in range(u_free.shape[1]):
        starts.append(s)
        u = mx.addmm(u_free[:, c], w[:, c], s.swapaxes(-1, -2), alpha=-1.0)  # [G, C, Dv]
        s = mx.addmm(g_last[:, c, None, None] * s, u.swapaxes(-1, -2), k_out[:, c])
    return mx.stack(starts, axis=1), s


def gated_delta_chunked_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    chunk: int | None = None,
    steps: StateSteps | None = None,
) -> tuple[mx.array, mx.array]:
    """``gated_delta_chunked`` on the inputs mlx-lm's ``gated_delta_update`` takes (beta = sigmoid(b), the
    decay from A_log, a and dt_bias as its ``compute_g`` computes it)."""
    return gated_delta_chunked(q, k, v, log_decay(A_log, a, dt_bias), mx.sigmoid(b), state, mask, chunk or CHUNK,
                               steps)
