"""An agent session replayed through the HTTP API, prefix cache off vs on in one run.

A coding agent resends its whole conversation every call: a system prompt with its tools' schemas
(several thousand tokens), then per turn its last reply and a tool result (a few hundred to a few thousand
tokens). This starts `exo serve` (as users run it: the model in a runner subprocess) twice, each on a fresh
EXO_HOME: one with EXO_PREFIX_CACHE_ENABLED=0, one with the cache on; both run at once and get every request
in turn (the order rotated by one a request, so a shared machine's load swings hit both alike):

  1. the session: TURNS chat requests, each the previous one's messages + the model's reply + a tool result;
  2. a new conversation with the same system prompt and another task;
  3. both servers are stopped (SIGTERM: a graceful exit) and started again on the same EXO_HOME, then the
     session's next turn is sent.

Per request it prints the time to first token seen by the client (request sent -> first streamed token),
the device's own (usage.native_mtp.ttft_ms), prompt and cached tokens, the ratio on/off, and the share of
the prompt that was not cached ("new": the ratio a hit would reach were every token's prefill to cost the
same; a new token attends to the whole context, so it costs more than a cold prompt's average); then the
session's wall time on each and the cache's bytes per tier (/metrics). Replies are greedy (temperature 0),
so both servers see the same conversation: the script checks that every reply is identical on and off.

The model: a copy of MODEL's directory (weights linked) whose config allows --context tokens (the bundled
demo models are trained for 4096; speed, not text quality, is measured here). The tools' schemas go into
the system prompt as text (the demo's chat template renders no tools), tool results as user messages.

    python bench/agent_session.py [MODEL] [--turns 10] [--system-tokens 5000] [--max-tokens 24] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
from common import BENCH_PTX_CACHE, report_to, stop_on_signals  # bench/ is this script's folder

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from exo.engine import resolve_model  # noqa: E402
from exo.runner.group import free_port  # noqa: E402

# Tool results' sizes in tokens, turn by turn (a few hundred to a few thousand).
RESULT_TOKENS = (400, 1500, 300, 2500, 600, 250, 1200, 350, 800, 500, 2000, 450)
WORDS = ("def class return import self value index result error path file line test assert module parser token "
         "buffer config cache layer state shape array batch model node stage round depth draft accept").split()


def long_context_copy(model: str, context: int, target: Path) -> Path:
    source = resolve_model(model).path
    target.mkdir(parents=True)
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            (target / f.name).symlink_to(f.resolve())
        elif f.name == "config.json":
            config = json.loads(f.read_text())
            for section in (config, config.get("text_config") or {}):
                if "max_position_embeddings" in section:
                    section["max_position_embeddings"] = context
            (target / f.name).write_text(json.dumps(config))
        else:
            shutil.copy(f, target / f.name)
    return target


def text_of(tokens: int, rng: random.Random, tokenizer: Any) -> str:
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) for _ in range(64)]
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= tokens:
            return text


def system_prompt(tokens: int, tokenizer: Any) -> str:
    """An agent's instructions and its tools' JSON schemas, grown to about ``tokens`` tokens."""
    rng = random.Random(0)
    head = "You are a coding agent working in a repository. Call one tool per step. Tools:\n"
    tools = []
    while len(tokenizer.encode(head + "\n".join(tools))) < tokens:
        name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{len(tools)}"
        params = {w: {"type": rng.choice(["string", "integer", "boolean"]), "description": text_of(12, rng, tokenizer)}
                  for w in rng.sample(WORDS, 4)}
        tools.append(json.dumps({"type": "function", "function": {
            "name": name, "description": text_of(40, rng, tokenizer),
            "parameters": {"type": "object", "properties": params, "required": list(params)[:2]}}}))
    return head + "\n".join(tools)


class Server:
    def __init__(self, model_dir: Path, home: Path, cache: bool) -> None:
        self.model_dir, self.home, self.cache = model_dir, home, cache
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.model_id = ""
        self.warm_texts: list[str] = []  # one per start: a long prompt shared with nothing (see ``start``)
        self.ready = False  # answered its first request

    def start(self) -> None:
        self.port = free_port("127.0.0.1")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               "EXO_HOME": str(self.home), "EXO_PREFIX_CACHE_ENABLED": "1" if self.cache else "0"}
        env.pop("EXO_API_KEY", None)
        env.setdefault("MLX_PTX_CACHE_DIR", BENCH_PTX_CACHE)  # both servers and their restarts share one compile
        argv = [sys.executable, "-m", "exo.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--grpc-port", str(free_port("127.0.0.1")), "--no-discovery", "--model", str(self.model_dir)]
        # Its log goes to a file, never to a pipe nobody reads: a server whose stderr pipe filled (64 KiB of log
        # lines over a long session) would block in its next log write, and the session with it.
        self.log = self.home / f"serve-{'on' if self.cache else 'off'}.log"
        self.home.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        deadline = time.monotonic() + 600
        said = started
        self.ready = False
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exo serve exited: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - said >= 30:  # a slow start says where it is (the log's last line)
                said = time.monotonic()
                print(f"  server (cache {'on' if self.cache else 'off'}): not up after {said - started:.0f} s; its log: "
                      f"{self.log_tail(1)[:200]}", flush=True)
            time.sleep(0.3)
        self.model_id = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # The first request loads the model (and warms it) if --model did not already. A long prompt that
        # shares no prefix with the session (a new one per start, so the cache holds none of it): a backend
        # that compiles kernels on first use (MLX CUDA) does so here, not in the session's first turn.
        ready = time.monotonic()
        self.chat([{"role": "user", "content": self.warm_texts.pop(0) if self.warm_texts else "hi"}], 4)
        self.ready = True
        print(f"  server (cache {'on' if self.cache else 'off'}): up in {ready - started:.1f} s, its first request "
              f"(load, warm-up) {time.monotonic() - ready:.1f} s", flush=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
            size = self.log.stat().st_size if self.log.exists() else 0
            print(f"  server (cache {'on' if self.cache else 'off'}) stopped; its log so far {size / 1024:.1f} KiB",
                  flush=True)
            if not self.ready:  # stopped before it served: what it was doing
                print("    " + self.log_tail(15).replace("\n", "\n    "), flush=True)

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first = None
        text: list[str] = []
        usage: dict[str, Any] = {}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as response:
            if response.status_code >= 400:  # what the server said, and what its log says, not only the status
                response.read()
                raise RuntimeError(f"exo serve (cache {'on' if self.cache else 'off'}) answered "
                                   f"{response.status_code}: {response.text[:2000]}\nits log's end:\n{self.log_tail(60)}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if first is None and (piece or choice.get("finish_reason")):
                        first = time.perf_counter()
                    text.append(delta.get("content") or "")
                if event.get("usage"):
                    usage = event["usage"]
        done = time.perf_counter()
        return {"ttft_s": (first or done) - sent, "wall_s": done - sent, "text": "".join(text),
                "device_ttft_s": usage.get("native_mtp", {}).get("ttft_ms", 0.0) / 1000.0,
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def metric(self, name: str, **labels: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def run(servers: list[Server], system: str, results: list[str], turns: int, max_tokens: int) -> list[dict[str, Any]]:
    """The session on every server at once, request by request (each turn goes to each server in an order
    rotated by one a turn), so a shared machine's load swings hit cache on and off alike."""
    outs: list[dict[str, Any]] = [{"turns": [], "replies": [], "session_s": 0.0} for _ in servers]
    first = [{"role": "system", "content": system},
             {"role": "user", "content": "The tests in tests/test_parser.py fail. Find out why and fix it."}]
    messages = [list(first) for _ in servers]
    try:
        return _session(servers, system, messages, outs, results, turns, max_tokens)
    finally:  # killed or failed (a timeout's SIGTERM: stop_on_signals), no server is left running
        for server in servers:
            server.stop()


def gpu_memory() -> str:
    """The GPU's memory in use and each process's (``nvidia-smi``), MiB; empty where there is none: which process
    grows turn by turn when a long session runs out of device memory."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        total = subprocess.run([smi, "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10).stdout.split()
        apps = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return ""
    used = " ".join(total).replace(",", " of")
    return f"GPU memory {used} MiB; by process " + ", ".join(a.replace(", ", ": ") for a in apps)


def _session(servers: list[Server], system: str, messages: list[list[dict[str, str]]],
             outs: list[dict[str, Any]], results: list[str], turns: int, max_tokens: int) -> list[dict[str, Any]]:
    for server in servers:
        server.start()

    def each(step: int, send) -> None:
        order = list(range(len(servers)))
        shift = step % len(order)
        for i in order[shift:] + order[:shift]:
            send(i)

    for turn in range(turns):
        def send(i: int, turn: int = turn) -> None:
            reply = servers[i].chat(messages[i], max_tokens)
            outs[i]["turns"].append(reply)
            outs[i]["replies"].append(reply["text"])
            outs[i]["session_s"] += reply["wall_s"]
            messages[i] = messages[i] + [{"role": "assistant", "content": reply["text"]},
                                         {"role": "user", "content": f"Tool result (step {turn + 1}):\n{results[turn]}"}]
        each(turn, send)
        print(f"  turn {turn + 1}: TTFT " + ", ".join(
            f"cache {'on' if server.cache else 'off'} {outs[i]['turns'][-1]['ttft_s']:.3f} s"
            for i, server in enumerate(servers)), flush=True)  # as it goes: a run cut short keeps its turns
        mlx = "; ".join(f"cache {'on' if server.cache else 'off'} " + ", ".join(
            f"{kind} {server.metric('exo_device_memory_bytes', kind=kind) / 2**30:.1f}" for kind in ("active", "cache", "peak"))
            for server in servers)
        memory = gpu_memory()
        print(f"    MLX's memory in each runner (GiB): {mlx}" + (f"\n    {memory}" if memory else ""), flush=True)
    other = [{"role": "system", "content": system},
             {"role": "user", "content": "Add a --verbose flag to the command line and document it."}]
    each(turns, lambda i: outs[i].__setitem__("new_conversation", servers[i].chat(other, max_tokens)))
    for i, server in enumerate(servers):
        if server.cache:
            outs[i]["ram_bytes"] = server.metric("exo_prefix_cache_bytes", tier="ram")
        server.stop()
    for server in servers:
        server.start()  # a restart on the same EXO_HOME
    each(turns + 1, lambda i: outs[i].__setitem__("after_restart", servers[i].chat(messages[i], max_tokens)))
    for i, server in enumerate(servers):
        if server.cache:
            outs[i]["disk_bytes"] = server.metric("exo_prefix_cache_bytes", tier="disk")
        outs[i]["last_prompt_tokens"] = outs[i]["after_restart"]["prompt_tokens"]
        server.stop()
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None,
                        help="card id, Hugging Face repo id or checkpoint directory (default: exo-demo)")
    parser.add_argument("--model", dest="model_option", default=None, help=argparse.SUPPRESS)  # the first spelling
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object on stdout (the table goes to stderr)")
    args = parser.parse_args()
    args.model = args.model_option or args.model or "exo-demo"
    stop_on_signals()  # killed (a phase's timeout), it stops its servers (run's finally)
    with report_to(args.json) as report:
        report.update(session(args))


def session(args: argparse.Namespace) -> dict[str, Any]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    with tempfile.TemporaryDirectory(prefix="exo-agent-session-") as tmp:
        root = Path(tmp)
        model_dir = long_context_copy(args.model, args.context, root / "model")
        tokenizer = load_tokenizer(model_dir)
        system = system_prompt(args.system_tokens, tokenizer)
        rng = random.Random(1)
        results = [text_of(RESULT_TOKENS[i % len(RESULT_TOKENS)], rng, tokenizer) for i in range(args.turns)]
        print(f"model {args.model} (context {args.context}), system + tools {len(tokenizer.encode(system))} tokens, "
              f"{args.turns} turns, tool results {[len(tokenizer.encode(r)) for r in results]} tokens, "
              f"max_tokens {args.max_tokens}", flush=True)
        servers = [Server(model_dir, root / "home-off", cache=False), Server(model_dir, root / "home-on", cache=True)]
        warm = random.Random(2)
        for server in servers:  # two starts each (the restart); longer than a prefill chunk and a partial one
            server.warm_texts = [text_of(2600, warm, tokenizer) for _ in range(2)]
        off, on = run(servers, system, results, args.turns, args.max_tokens)

    print(f"\n{'request':<24}{'prompt':>8}{'cached':>8}{'TTFT off s':>12}{'TTFT on s':>11}{'on/off':>8}"
          f"{'device off':>12}{'device on':>11}{'on/off':>8}{'new':>7}")

    def row(name: str, a: dict[str, Any], b: dict[str, Any]) -> float:
        ratio = b["ttft_s"] / a["ttft_s"]
        device = b["device_ttft_s"] / a["device_ttft_s"] if a["device_ttft_s"] else float("nan")
        share = 1 - b["cached_tokens"] / b["prompt_tokens"] if b["prompt_tokens"] else float("nan")
        print(f"{name:<24}{b['prompt_tokens']:>8}{b['cached_tokens']:>8}{a['ttft_s']:>12.3f}{b['ttft_s']:>11.3f}"
              f"{ratio:>8.3f}{a['device_ttft_s']:>12.3f}{b['device_ttft_s']:>11.3f}{device:>8.3f}{share:>7.3f}")
        return ratio

    later, shares = [], []
    for i, (a, b) in enumerate(zip(off["turns"], on["turns"], strict=True)):
        ratio = row(f"turn {i + 1}", a, b)
        if i > 0:
            later.append(ratio)
            shares.append(1 - b["cached_tokens"] / b["prompt_tokens"])
    new = row("new conversation", off["new_conversation"], on["new_conversation"])
    restart = row("next turn after restart", off["after_restart"], on["after_restart"])
    same = off["replies"] == on["replies"] and off["after_restart"]["text"] == on["after_restart"]["text"] \
        and off["new_conversation"]["text"] == on["new_conversation"]["text"]
    print(f"\nturn 2 onwards TTFT on/off: max {max(later):.3f}, mean {sum(later) / len(later):.3f} (target <= 0.05); "
          f"the new tokens' share of their prompts ('new': a hit's TTFT / cold, were every token to cost the same): "
          f"mean {sum(shares) / len(shares):.3f}")
    print(f"new conversation {new:.3f} (target <= 0.05); after a restart {restart:.3f} (target <= 0.1)")
    print(f"session wall time (its requests' time): off {off['session_s']:.1f} s, on {on['session_s']:.1f} s: "
          f"{off['session_s'] / on['session_s']:.2f}x faster (target >= 5x)")
    tokens = on["last_prompt_tokens"]
    print(f"prefix cache after the session: RAM {on.get('ram_bytes', 0) / 2**20:.1f} MiB, disk "
          f"{on.get('disk_bytes', 0) / 2**20:.1f} MiB for ~{tokens} distinct prompt tokens "
          f"(+ the new conversation's)")
    print(f"replies identical with the cache on and off: {same}")
    return {"model": args.model, "turns": args.turns, "later_turns_ttft_on_off": later, "new_conversation_ttft_on_off": new,
            "after_restart_ttft_on_off": restart, "session_speedup": off["session_s"] / on["session_s"],
            "ram_bytes": on.get("ram_bytes", 0), "disk_bytes": on.get("disk_bytes", 0), "replies_identical": same,
            "off": off, "on": on}


if __name__ == "__main__":
    main()
