"""The chunked gated delta rule's chunk-to-chunk state steps as one CUDA kernel (``mx.fast.cuda_kernel``).

``gated_delta_chunked`` runs these steps as MLX ops, three products per chunk (a 2,048-row call: 96 launches
per layer). Each row of a value head's state [Dv, Dk] evolves on its own through them:

    u[t] = U~[t, row] - W[t, :] . S[row, :]            for the chunk's C rows t
    S[row, :] = exp(G_C) S[row, :] + sum_t u[t] K'[t, :]

so this kernel gives each state row one warp (each lane Dk / 32 of its entries) and walks the chunks in one
launch, writing each chunk's starting state as the ops form does. The sums run in another order than the ops
form's products (same float32 tolerance). Not used by the layers: ``bench/prefill.py`` times it beside the
ops form on MLX CUDA (``--phases layer``), and only a measurement there may make it the default.
"""

from __future__ import annotations

import functools

import mlx.core as mx

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
