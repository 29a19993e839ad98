"""The chunked gated delta rule's chunk-to-chunk state steps as one CUDA kernel (``mx.fast.cuda_kernel``).

``gated_delta_chunked`` runs these steps as MLX ops, three products per chunk (a 2,048-row call: 96 launches
per layer). Each row of a value head's state [Dv, Dk] evolves on its own through them:

    u[t] = U~[t, row] - W[t, :] . S[row, :]            for the chunk's C rows t
    S[row, :] = exp(G_C) S[row, :] + sum_t u[t] K'[t, :]

so this kernel gives each state row one warp (each lane Dk / 32 of its entries) and walks the chunks in one
launch, writing each chunk's starting state as the ops form does. The sums run in another order than the ops
form's products (same float32 tolerance).

The layers take it for a prompt's chunked rows under ``gdn_prefill="auto"`` on MLX CUDA (``usable``): one
layer of the 9B shape ran 1.48x the ops form there (docs/performance.md, "The code's reasons": the chunked
GatedDeltaNet prefill). ``gdn_prefill="chunked"`` keeps the ops form (``chunk_states_ops``) on every device,
which is how ``bench/prefill.py --phases model`` times the two in one run. Before its first use on a head
shape the kernel is checked against the ops form on random inputs (``self_check``); a kernel that fails to
build or to agree is refused with a warning, and the ops form runs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import mlx.core as mx

from .gated_delta_chunked import CHUNK, chunk_products, chunk_states_ops

log = logging.getLogger(__name__)

ROWS = 4  # state rows (warps) per block

SOURCE = """
    constexpr int E = Dk / 32;  // state entries per lane
    const int N = u_free_shape[1];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int blocks_per_head = Dv / ROWS;
    const int g = blockIdx.x / blocks_per_head;
    const int row = (blockIdx.x % blocks_per_head) * ROWS + warp;
    float s[E];
    const float* s_in = s0 + ((size_t)g * Dv + row) * Dk + lane * E;
    for (int e = 0; e < E; ++e) {
        s[e] = s_in[e];
    }
    float u[C];
    for (int c = 0; c < N; ++c) {
        const size_t chunk = (size_t)g * N + c;
        float* start = before + (chunk * Dv + row) * Dk + lane * E;
        for (int e = 0; e < E; ++e) {
            start[e] = s[e];
        }
        const float* wc = w + chunk * C * Dk + lane * E;
        const float* kc = k_out + chunk * C * Dk + lane * E;
        const float* uc = u_free + chunk * C * Dv + row;
        for (int t = 0; t < C; ++t) {
            float d = 0.0f;
            for (int e = 0; e < E; ++e) {
                d += wc[t * Dk + e] * s[e];
            }
            for (int offset = 16; offset > 0; offset >>= 1) {
                d += __shfl_xor_sync(0xffffffff, d, offset);
            }
            u[t] = uc[t * Dv] - d;
        }
        const float decay = g_last[chunk];
        for (int e = 0; e < E; ++e) {
            float acc = decay * s[e];
            for (int t = 0; t < C; ++t) {
                acc += u[t] * kc[t * Dk + e];
            }
            s[e] = acc;
        }
    }
    float* s_end = s_out + ((size_t)g * Dv + row) * Dk + lane * E;
    for (int e = 0; e < E; ++e) {
        s_end[e] = s[e];
    }
"""


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        name="exo_gdn_chunk_states", input_names=["u_free", "w", "k_out", "g_last", "s0"],
        output_names=["before", "s_out"], source=SOURCE,
    )


def applies(dk: int, dv: int) -> bool:
    """Whether the kernel takes a layer of these head dims (here: MLX CUDA, Dk a multiple of 32)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available() and dk % 32 == 0 and dv % ROWS == 0


def chunk_states(u_free: mx.array, w: mx.array, k_out: mx.array, g_last: mx.array,
                 s0: mx.array) -> tuple[mx.array, mx.array]:
    """u_free [G, N, C, Dv], w and k_out [G, N, C, Dk], g_last [G, N], s0 [G, Dv, Dk], all float32 ->
    (each chunk's starting state [G, N, Dv, Dk], the state after the last chunk [G, Dv, Dk])."""
    G, N, C, Dv = u_free.shape
    Dk = w.shape[-1]
    before, s_out = _kernel()(  # type: ignore[operator]
        inputs=[u_free, w, k_out, g_last, s0],
        template=[("C", C), ("Dk", Dk), ("Dv", Dv), ("ROWS", ROWS)],
        grid=(G * Dv * 32, 1, 1), threadgroup=(32 * ROWS, 1, 1),
        output_shapes=[(G, N, Dv, Dk), (G, Dv, Dk)], output_dtypes=[mx.float32, mx.float32],
    )
    return before, s_out


# The self-check's agreement: the kernel's outputs and final state against the ops form's, relative to their
# scale. Both sum the same float32 products in another order (tests/engine/test_gated_delta_chunked.py's TOL is
# the chunked form against the token loop); CHECK_TOL leaves 10x that room for the device's fused multiply-adds.
CHECK_TOL = 1e-4
CHECK_SHAPE = (1, 2, 2, 3 * CHUNK + 5)  # batch, key heads, value heads per key head, rows: 4 chunks, the last partial


def self_check(steps: Callable[..., tuple[mx.array, mx.array]], dk: int, dv: int) -> str:
    """"ok" when ``steps`` (``chunk_states``' signature) gives ``chunk_states_ops``' starting states and final
    state within CHECK_TOL on the chunk products of random inputs of these head dims, else why not."""
    B, Hk, r, T = CHECK_SHAPE
    keys = mx.random.split(mx.random.key(0), 6)
    q = mx.random.normal((B, T, Hk, dk), key=keys[0])
    k = mx.random.normal((B, T, Hk, dk), key=keys[1])
    q, k = (x / mx.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))  # unit keys, as the layers feed it
    v = mx.random.normal((B, T, Hk * r, dv), key=keys[2])
    log_g = -mx.random.uniform(0.0, 0.5, (B, T, Hk * r), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hk * r), key=keys[4])
    s0 = mx.random.normal((B * Hk * r, dv, dk), key=keys[5]) * 0.1
    u_free, w, k_out, g_last, _, _ = chunk_products(q, k, v, log_g, beta, None, CHUNK)
    G, n = B * Hk * r, u_free.shape[3]
    args = (u_free.reshape(G, n, CHUNK, dv), w.reshape(G, n, CHUNK, dk), k_out.reshape(G, n, CHUNK, dk),
            g_last.reshape(G, n), s0)
    try:
        want = chunk_states_ops(*args)
        got = steps(*args)
        mx.eval(want, got)
    except Exception as error:  # noqa: BLE001 — a kernel that fails to build or run is refused, never fatal
        return f"failed: {type(error).__name__}: {error}"
    for name, a, b in (("starting states", got[0], want[0]), ("final state", got[1], want[1])):
        if a.shape != b.shape:
            return f"{name}: shape {a.shape}, not {b.shape}"
        err = mx.max(mx.abs(a - b)).item()
        scale = max(1.0, mx.max(mx.abs(b)).item())
        if not err <= CHECK_TOL * scale:  # (a NaN fails too)
            return f"{name} differ from the ops form by {err:.3g} at scale {scale:.3g}"
    return "ok"


@functools.cache
def usable(dk: int, dv: int) -> bool:
    """Whether a layer of these head dims takes the kernel: on MLX CUDA, where it applies and its self-check
    passed (once per shape and process; a refusal is logged)."""
    if not applies(dk, dv):
        return False
    verdict = self_check(chunk_states, dk, dv)
    if verdict != "ok":
        log.warning("the GatedDeltaNet chunk-states kernel is refused for head dims %d/%d (%s); the ops form runs",
                    dk, dv, verdict)
    return verdict == "ok"
