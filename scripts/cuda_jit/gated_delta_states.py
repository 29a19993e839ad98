"""The chunked gated delta rule's state-step kernel (engine/models/gated_delta_states_cuda.py) at the 9B's head
dims and chunk sizes 32/64/128 (run by scripts/cuda_jit_check.py)."""

import mlx.core as mx

from exo.engine.models import gated_delta_states_cuda as states

for chunk in (32, 64, 128):
    g, n, dk, dv = 2, 3, 128, 128
    states.chunk_states(mx.zeros((g, n, chunk, dv)), mx.zeros((g, n, chunk, dk)), mx.zeros((g, n, chunk, dk)),
                        mx.zeros((g, n)), mx.zeros((g, dv, dk)))
