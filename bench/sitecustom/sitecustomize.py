"""Process-wide switches for A/B runs of the serve path (``bench/gpu_session.sh servinggil``), on ``PYTHONPATH`` for
the bench and every process it starts (the daemon, its runners): is one client's decode through ``exo serve``
slower than the engine alone because of the interpreter (its GIL handing off to the runner's other threads, its
cyclic garbage collector over a server's many objects)? Never part of exo itself.

- ``EXO_BENCH_SWITCH_INTERVAL=S``: ``sys.setswitchinterval(S)`` (Python's default 0.005 s: how long a thread that
  wants the GIL waits before the holder is asked to drop it);
- ``EXO_BENCH_GC=off``: ``gc.disable()`` (no cyclic collections at all; reference counting still frees).
"""

import gc
import os
import sys

if os.environ.get("EXO_BENCH_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["EXO_BENCH_SWITCH_INTERVAL"]))
if os.environ.get("EXO_BENCH_GC") == "off":
    gc.disable()
