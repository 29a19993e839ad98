"""Whether a block of rows times a weight rounds like the rows one at a time, and what one-row products cost.

    python bench/row_products.py

For a few bf16 weight shapes: a 4-row block (``x @ W.T``), the rows one call each, and the rows as one-row
products in one call (``exo.engine.models.layers.vector_matmul``, what a verify call uses where the device
needs it): bit equality with the one-row calls and microseconds per call. On MLX CUDA a block takes cuBLAS
GEMMs that round unlike the one-row gemv; the one-row products take the batched gemv
(bench/results/h100-mlx-cuda-identity-vectors.txt). On the CPU everything is equal.
"""

import time

import mlx.core as mx

from exo.engine.models.layers import vector_matmul


def microseconds(fn) -> float:
    for _ in range(3):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(50):
        mx.eval(fn())
    return (time.perf_counter() - start) / 50 * 1e6


def row(n_out: int, k: int) -> str:
    w = (mx.random.normal((n_out, k)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((1, 4, k)).astype(mx.bfloat16)
    block = x @ w.T
    single = mx.concatenate([x[:, t : t + 1] @ w.T for t in range(4)], axis=1)
    vectors = vector_matmul(x, w)
    mx.eval(block, single, vectors)
    timings = {
        "block": microseconds(lambda: x @ w.T),
        "vectors": microseconds(lambda: vector_matmul(x, w)),
        "loop": microseconds(lambda: mx.concatenate([x[:, i : i + 1] @ w.T for i in range(4)], axis=1)),
        "one row": microseconds(lambda: x[:, :1] @ w.T),
    }
    return (f"{n_out}x{k}: block==single {mx.array_equal(block, single).item()} "
            f"vectors==single {mx.array_equal(vectors, single).item()}  us: "
            + "  ".join(f"{name} {us:.0f}" for name, us in timings.items()))


def main() -> None:
    for n_out, k in [(256, 768), (768, 256), (4096, 256), (1024, 256), (12288, 4096)]:
        print(row(n_out, k), flush=True)


if __name__ == "__main__":
    main()
