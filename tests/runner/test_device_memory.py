"""Running out of device memory while prefilling a huge prompt fails that request with a typed error
(``DeviceMemoryError``: 507 ``insufficient_memory``, across the wire too) and the node serves the others.

MLX raises its allocation failure as a ``RuntimeError`` from the evaluation that could not get a buffer
(``engine/memory.py`` quotes where). MLX's CPU backend never raises it (its ``malloc`` is unchecked), so these
tests make MLX's evaluation raise MLX CUDA's own message at the edge, ``mx.eval``, whenever it is handed a
prompt's attention cache of ``HUGE`` positions or more: the prefill of a long prompt, never a short request's.
"""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from exo.api.errors import api_error_from
from exo.engine import DeviceMemoryError, GenerationRequest, SamplingParams
from exo.engine.memory import allocation_failed
from exo.engine.prompt import GenerateParams, Prompt
from exo.runner.device import Device, Failed, GenerationJob
from exo.wire.convert import error_from_pb, error_to_pb
from tests.fixtures.engines import fresh_engine
from tests.fixtures.memory import kept_buffer

HUGE = 96  # attention positions from which the forced allocation fails
CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


@pytest.fixture
def failing_eval(monkeypatch):
    real = mx.eval

    def evaluate(*args):
        if any(a.ndim == 4 and a.shape[2] >= HUGE for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)):
            raise RuntimeError(CUDA_OOM)
        return real(*args)

    monkeypatch.setattr(mx, "eval", evaluate)
    return real


def _greedy(prompt: list[int], max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(prompt, max_tokens=max_tokens, native_mtp="off", sampling=SamplingParams(temperature=0.0))


def test_mlx_allocation_failures_are_recognised():
    for text in (CUDA_OOM, "cudaMalloc(&data, size) failed: out of memory", "[malloc] Unable to allocate 1024 bytes.",
                 "[metal::malloc] Resource limit (499000) exceeded."):
        assert allocation_failed(RuntimeError(text)), text
    assert not allocation_failed(RuntimeError("[matmul] Last dimension of first input with shape (1,2) must match"))
    assert not allocation_failed(ValueError("out of memory"))


def test_a_prompt_that_runs_out_of_memory_fails_typed_and_the_engine_serves_on(checkpoint, failing_eval):
    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False, prefill_chunk=32)
    huge = list(range(3, 3 + 2 * HUGE))
    with pytest.raises(DeviceMemoryError, match=f"prefilling a prompt of {len(huge)} tokens") as info:
        engine.complete(_greedy(huge))
    assert isinstance(info.value.__cause__, RuntimeError) and CUDA_OOM in str(info.value)
    error = api_error_from(info.value)
    assert (error.status, error.code, error.type) == (507, "insufficient_memory", "server_error")
    crossed = error_from_pb(error_to_pb(info.value).error)  # a runner's error reaches the API node as itself
    assert isinstance(crossed, DeviceMemoryError) and str(crossed) == str(info.value)
    short = list(range(10, 40))
    got = engine.complete(_greedy(short)).token_ids
    assert got == fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False).complete(_greedy(short)).token_ids


def test_running_out_of_memory_while_the_forward_evaluates_its_layers_is_typed_too(checkpoint, monkeypatch):
    """On a GPU a prompt chunk's forward evaluates every few layers as it builds them (``forward.prompt_eval_every``):
    the allocation can fail there, inside the forward, before the chunk's own evaluation (an H200, 2026-11-29: an
    HTTP 500 with MLX's message). It fails the request as the same typed error."""
    from exo.engine import forward as forward_module

    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False, prefill_chunk=32)
    monkeypatch.setattr(forward_module, "prompt_eval_every", lambda rows: 1 if rows >= 32 else 0)
    real = mx.async_eval

    def evaluate(*args):
        import sys

        if sys._getframe(1).f_code.co_name == "stage_hidden":  # noqa: SLF001 - the forward's own evaluations
            raise RuntimeError(CUDA_OOM)
        return real(*args)

    monkeypatch.setattr(mx, "async_eval", evaluate)
    huge = list(range(3, 3 + 2 * HUGE))
    with pytest.raises(DeviceMemoryError, match=f"prefilling a prompt of {len(huge)} tokens"):
        engine.complete(_greedy(huge))
    short = list(range(10, 40))  # one chunk of 30 rows: evaluated once, as a whole
    got = engine.complete(_greedy(short)).token_ids
    assert got == fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False).complete(_greedy(short)).token_ids


def test_mlx_s_buffer_cache_is_bounded_where_asked(monkeypatch):
    """``EXO_MLX_CACHE_BYTES`` bounds MLX's cache of freed buffers (engine/memory.py); unset, the CPU keeps MLX's
    default (the bound is MLX CUDA's: an eighth of the device's memory)."""
    from exo.engine import memory

    calls = []
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: calls.append(n) or 0)
    assert memory.limit_buffer_cache(3 << 30) == 3 << 30 and calls == [3 << 30]
    calls.clear()
    assert memory.limit_buffer_cache(None) is None and calls == []  # MLX's CPU backend: unchanged
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "device_info", lambda *a: {"total_memory": 144 << 30, "free_memory": 1})  # CUDA's keys
    assert memory.limit_buffer_cache(None) == 18 << 30 and calls == [18 << 30]
    monkeypatch.setattr(mx, "device_info", lambda *a: {"memory_size": 64 << 30})  # Metal's
    assert memory.device_memory_bytes() == 64 << 30


def _generate(device: Device, engine, prompts: list[list[int]]) -> tuple[list[list], dict[int, str]]:
    """Greedy 12-token jobs of ``prompts`` on ``device`` (served by a thread), waited for: each job's items and
    finish reason."""
    items: list[list] = [[] for _ in prompts]
    finishes: dict[int, str] = {}
    done = threading.Event()

    def on_done(i: int):
        def record(finish, stats, queue_s, device_s) -> None:
            finishes[i] = finish
            if len(finishes) == len(prompts):
                done.set()
        return record

    for i, prompt in enumerate(prompts):
        params = GenerateParams(max_tokens=12, default_max_tokens=12, native_mtp="off")
        device.submit(GenerationJob(device, lambda: engine, Prompt(token_ids=prompt), params, items[i].append,
                                    timeout_s=600, on_done=on_done(i)))
    assert done.wait(300), finishes
    return items, finishes


def _tokens(items: list) -> list[int]:
    return [t for item in items if hasattr(item, "token_ids") for t in item.token_ids]


def test_the_node_serves_the_others_while_one_prompt_runs_out_of_memory(checkpoint, failing_eval):
    """On the device queue: the huge prompt's job ends with ``Failed(DeviceMemoryError)``; the jobs around
    it (one before it, running, and one after) finish with their solo output."""
    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False, prefill_chunk=32, batch_prefill_chunk=32)
    device = Device(8, max_batch=4)
    thread = threading.Thread(target=device.serve, daemon=True)
    thread.start()
    prompts = [list(range(10, 30)), list(range(3, 3 + 2 * HUGE)), list(range(40, 55))]
    items, finishes = _generate(device, engine, prompts)
    device.close()
    thread.join(60)
    assert finishes[1] == "error"
    failed = [item for item in items[1] if isinstance(item, Failed)]
    assert len(failed) == 1 and isinstance(failed[0].error, DeviceMemoryError)
    for i in (0, 2):
        solo = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False).complete(_greedy(prompts[i])).token_ids
        assert finishes[i] == "length" and _tokens(items[i]) == solo, i


def test_a_batch_step_that_runs_out_of_memory_fails_its_members_typed_and_the_node_serves_on(checkpoint, monkeypatch):
    """A batched decode step whose allocation fails: its members end with ``Failed(DeviceMemoryError)`` (507, not
    MLX's raw error), and the next request decodes its solo output."""
    from exo.engine.batch import BatchLanes

    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False)
    real = BatchLanes.step
    steps = [0]

    def step(self):
        steps[0] += 1
        if steps[0] == 3:
            raise RuntimeError(CUDA_OOM)
        return real(self)

    monkeypatch.setattr(BatchLanes, "step", step)
    device = Device(8, max_batch=4)
    thread = threading.Thread(target=device.serve, daemon=True)
    thread.start()
    prompts = [list(range(10, 30)), list(range(40, 55))]
    items, _ = _generate(device, engine, prompts)
    failed = [item for per_job in items for item in per_job if isinstance(item, Failed)]
    assert failed and all(isinstance(f.error, DeviceMemoryError) for f in failed)
    assert "decoding a batch" in str(failed[0].error)
    after, finishes = _generate(device, engine, prompts[:1])
    device.close()
    thread.join(60)
    solo = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False).complete(_greedy(prompts[0])).token_ids
    assert finishes[0] == "length" and _tokens(after[0]) == solo



def test_the_buffers_kept_go_back_once_past_half_the_bound(bounded_cache):
    """``keep_cache_room``: below half the bound nothing moves; past it every kept buffer goes back; with no bound
    of exo's (MLX's own default) it never acts."""
    memory = bounded_cache
    kept_buffer(2 << 20)
    assert mx.get_cache_memory() >= 2 << 20
    assert memory.keep_cache_room() == 0 and mx.get_cache_memory() >= 2 << 20
    kept_buffer(5 << 20)  # (the 2 MiB one stays cached: 7 MiB kept, over half of 8)
    kept = mx.get_cache_memory()
    assert kept > 4 << 20
    assert memory.keep_cache_room() == kept and mx.get_cache_memory() == 0
    memory._bound = None
    kept_buffer(6 << 20)
    assert memory.keep_cache_room() == 0 and mx.get_cache_memory() >= 6 << 20


def test_a_batch_s_steps_keep_room_in_the_bounded_cache(checkpoint, bounded_cache, monkeypatch, tmp_path):
    """A large buffer left in the bounded cache (as a prompt chunk's or the load's warm-up's are) is gone once the
    device's batch has stepped: the cache holds what the steps use, under half the bound. The device trace times
    it as its steps' ``room`` phase and says which step handed what back."""
    monkeypatch.setenv("EXO_DEVICE_TRACE", str(tmp_path))
    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False)
    device = Device(8, max_batch=4)
    thread = threading.Thread(target=device.serve, daemon=True)
    thread.start()
    kept_buffer(6 << 20)
    assert mx.get_cache_memory() >= 6 << 20
    _, finishes = _generate(device, engine, [list(range(10, 30))])
    device.close()
    thread.join(60)
    assert finishes == {0: "length"}
    assert mx.get_cache_memory() < 4 << 20
    device.trace._file.flush()
    lines = [json.loads(raw) for path in tmp_path.glob("device-*.jsonl") for raw in path.read_text().splitlines()]
    assert lines and all("room" in line for line in lines)
    assert lines[0].get("handed_back", 0) >= 6 << 20 and not any(line.get("handed_back") for line in lines[1:])


def test_a_served_engine_leaves_no_warm_up_buffers_in_the_bounded_cache(checkpoint, bounded_cache, tmp_path):
    """``ready_engine``: what its warm-ups freed (here a large buffer left before it, standing in for a warm-up's)
    goes back before the engine serves."""
    from exo.engine import EngineConfig, load_checkpoint
    from exo.runner.loading import ready_engine
    from exo.settings import Settings

    kept_buffer(6 << 20)
    ready_engine(load_checkpoint(checkpoint("qwen3_5")), EngineConfig(), Settings(max_batch=3, home=tmp_path))
    assert mx.get_cache_memory() < 4 << 20
