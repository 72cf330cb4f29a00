"""Serve a local MoE model with ``vllm serve`` on the GPU machine, with moereplay capturing, and summarise the files.

Run after the prelude (``source tools/gpu/device_setup.sh``; the kernel pack and the serving pack carried)::

    python3 tools/gpu/serve_gpu.py --model /tmp/models/gpt-oss-2l --mode eager --out $OUT/eager
    python3 tools/gpu/serve_gpu.py --model DIR --mode graph --capture flight --env MOEREPLAY_ABSMAX=1e4 …

Steps: start ``python3 -m vllm.entrypoints.cli.main serve MODEL`` (vLLM has no console script here) with
``MOEREPLAY_CAPTURE=1`` and the capture directory under ``--out``, moereplay's entry point declared by a dist-info
on ``PYTHONPATH`` (moereplay itself is the repository); wait for ``/health``; send a mixed workload — long
decodes started first, then a wave of prompts of different lengths while they run, so batches mix prefill and
decode; stop the server with SIGTERM (``--shutdown-timeout`` grace so every process closes its file with a
footer); then read every capture file and summarise it: process, calls per op and status, MoE layer names,
forward steps, ranks, parents, CUDA-graph mode, and the plugin's log lines.

Users with vLLM installed need none of this: ``MOEREPLAY_CAPTURE=1 vllm serve …`` is the whole story there.
Exit status 0 when every request was answered and at least one capture file holds a completed MoE kernel call
(or, with ``--capture flight``, when the run ended; the summary says what was written).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "tools" / "serve"))

import harness  # noqa: E402  (tools/ is not a package)

PLUGIN_LINE = re.compile(r"moereplay[^\n]*")
BACKEND_LINE = re.compile(
    r"[^\n]*(?:Using [^\n]*backend|MoE backend|MoE config|for MoE layer|PrepareAndFinalize|Mxfp4|Marlin|marlin)"
    r"[^\n]*",
    re.IGNORECASE,
)
QUANTIZATION = re.compile(r"quantization=[\w-]+")
"""The ``quantization=…`` item of vLLM's ``Initializing a V1 LLM engine … with config:`` line (too long to print)."""


@dataclass
class FileSummary:
    """One capture file: which process wrote it and what it holds."""

    name: str
    pid: int | None
    title: str
    calls: int
    footer: bool
    recovery: str
    ops: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    layer_names: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tags: dict[str, int] = field(default_factory=dict)
    cudagraph_modes: dict[str, int] = field(default_factory=dict)
    ranks: list[dict[str, int]] = field(default_factory=list)
    kernel_calls_with_parent: int = 0
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class ServeRun:
    mode: str
    capture: str
    command: list[str]
    ready_s: float
    requests: int
    completion_tokens: int
    prompt_tokens: int
    workload_s: float
    stop_s: float
    sample: str
    files: list[FileSummary]
    fault_samples: list[str]
    plugin_lines: list[str]
    backend_lines: list[str]
    log: str

    @property
    def kernel_calls(self) -> int:
        kernels = kernel_ops()
        return sum(count for item in self.files for op, count in item.ops.items() if op in kernels)


def kernel_ops() -> frozenset[str]:
    """Every kernel op a family declares (``moe_wna16_marlin_gemm``, ``matmul_ogs``, ``fused_moe_kernel`` …), read
    from the capture surfaces (torch-free)."""
    from moereplay.ops.surface import families

    return frozenset(op for family in families() for op in family.kernel_ops)


SERVE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
"""vLLM 0.25.1's sampler imports FlashInfer on CUDA unless told not to (no FlashInfer in the packs: seen on the
H200, ``ModuleNotFoundError: No module named 'flashinfer'`` in EngineCore); its own switch selects the torch path."""


def vocabulary_words(model: Path, limit: int = 400) -> list[str]:
    """Plain words of the model's tokenizer (``tokenizer.json``'s vocabulary), to build prompts from."""
    data = json.loads((model / "tokenizer.json").read_text())
    vocab = data.get("model", {}).get("vocab", {})
    words = [word for word in (vocab if isinstance(vocab, dict) else {}) if word.isalpha() and len(word) > 1]
    return sorted(words)[:limit] or ["hello", "world"]


def token_id(model: Path, word: str) -> int:
    """The id of ``word`` in the model's ``tokenizer.json`` (a word-level vocabulary from tools/models/)."""
    vocab = json.loads((model / "tokenizer.json").read_text()).get("model", {}).get("vocab", {})
    if not isinstance(vocab, dict) or word not in vocab:
        raise SystemExit(f"serve_gpu: {word!r} is not a token of {model / 'tokenizer.json'}")
    return int(vocab[word])


def prompts(words: list[str], lengths: list[int], offset: int = 0) -> list[str]:
    return [
        " ".join(words[(offset + index * 7 + position) % len(words)] for position in range(length))
        for index, length in enumerate(lengths)
    ]


CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
"""The CUDA-graph batch sizes a graph-mode server captures (fewer than vLLM's default ~67, to start faster)."""

FAULT_PROMPT_WORDS = 160
"""Words of a prefill fault prompt: more tokens than the largest graph size, so the prefill runs eager."""


def fault_prompts(words: list[str], word: str, count: int, length: int, offset: int = 0) -> list[str]:
    """``count`` prompts of ``length`` words with ``word`` once, in the middle, and nowhere else: a model poisoned
    on it (make_gpt_oss.py --poison) turns non-finite while the prompt is prefilled."""
    filler = [item for item in words if item != word] or ["hello"]
    middle = length // 2
    split = [text.split(" ") for text in prompts(filler, [length - 1] * count, offset)]
    return [" ".join([*parts[:middle], word, *parts[middle:]]) for parts in split]


def serve_command(model: Path, port: int, mode: str, serve_args: list[str], max_model_len: int) -> list[str]:
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--tokenizer", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.30",
        "--max-num-seqs", "64", "--shutdown-timeout", "10",
    ]  # fmt: skip
    if mode == "eager":
        command.append("--enforce-eager")
    else:
        # vLLM's default CUDA-graph mode, with fewer capture sizes than its default ~67 to start faster
        command += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": CAPTURE_SIZES})]
    return command + serve_args


def summarise_file(path: Path, titles: dict[int, str]) -> FileSummary:
    from moereplay.format import CaptureReader

    with CaptureReader(path) as reader:
        header = reader.header
        pid = header.get("pid")
        summary = FileSummary(
            name=path.name,
            pid=pid,
            title=titles.get(pid, " ".join(header.get("argv", []))[:120]) if pid else "",
            calls=len(reader),
            footer=reader.footer is not None,
            recovery=reader.recovery.message,
        )
        ops: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        tags: Counter[str] = Counter()
        modes: Counter[str] = Counter()
        names: dict[str, None] = {}
        steps: set[int] = set()
        ranks: list[dict[str, int]] = []
        kernels = kernel_ops()
        for call in reader.calls():
            ops[call.op] += 1
            statuses[str(getattr(call.status, "value", call.status))] += 1
            context = call.context
            if context.get("layer_name"):
                names.setdefault(str(context["layer_name"]), None)
            if isinstance(context.get("step"), int):
                steps.add(context["step"])
            if context.get("tag"):
                tags[str(context["tag"])] += 1
            if context.get("cudagraph_mode"):
                modes[str(context["cudagraph_mode"])] += 1
            if context.get("ranks") and context["ranks"] not in ranks:
                ranks.append(dict(context["ranks"]))
            if call.op in kernels and call.parent is not None:
                summary.kernel_calls_with_parent += 1
        summary.ops, summary.statuses = dict(ops), dict(statuses)
        summary.tags, summary.cudagraph_modes = dict(tags), dict(modes)
        summary.layer_names, summary.steps, summary.ranks = list(names), sorted(steps), ranks
        footer = reader.footer or {}
        counters = footer.get("counters") if isinstance(footer, dict) else None
        summary.counters = dict(counters) if isinstance(counters, dict) else {}
    return summary


def run(options: argparse.Namespace) -> ServeRun:
    out: Path = options.out
    out.mkdir(parents=True, exist_ok=True)
    site = harness.make_site(out)
    env = harness.base_environment(site)
    env.update(SERVE_ENV)
    captures = out / "captures"
    if options.capture != "off":
        env.update({"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(captures)})
        if options.capture == "flight":
            env["MOEREPLAY_TRIGGER"] = "flight"
    for item in options.env:
        key, _, value = item.partition("=")
        env[key] = value
    port = harness.free_port()
    command = serve_command(options.model, port, options.mode, options.serve_arg, options.max_model_len)
    server = harness.start(command, str(options.model), port, env, out / "server.log")
    words = vocabulary_words(options.model)
    try:
        ready = server.wait_ready(options.timeout)
        print(f"serve_gpu: {options.mode} server ready in {ready:.1f} s", flush=True)
        server.complete(" ".join(words[:8]), 4)  # one warm request
        started = time.monotonic()
        # long decodes first, then a wave of prompts of different lengths: batches mix prefill and decode
        long_batch: list[harness.Batch] = []
        decodes = threading.Thread(
            target=lambda: long_batch.append(
                server.complete_many(prompts(words, [6, 9, 12, 15], offset=3), options.max_tokens * 2)
            )
        )
        decodes.start()
        time.sleep(0.5)
        lengths = [5 + (index * 37) % 180 for index in range(options.requests)]
        wave = server.complete_many(prompts(words, lengths, offset=11), options.max_tokens)
        decodes.join()
        extra = list(options.prompt or [])
        extra_batch = server.complete_many(extra, options.max_tokens) if extra else None
        fault_batch = None
        if options.fault_word and options.fault_at == "prefill":
            # the word in the prompts' middle: the prefill (eager: longer than any graph) is the first bad call
            token_id(options.model, options.fault_word)  # a word the tokenizer knows, or a one-line exit
            fault_batch = server.complete_many(
                fault_prompts(
                    words, options.fault_word, options.fault_requests, options.fault_prompt_words, 17
                ),
                options.max_tokens,
            )
        elif options.fault_word:
            # the word is never in these prompts: a logit bias makes the model emit it as its first new token,
            # so the next decode step (a CUDA-graph replay in graph mode) is the first to feed it to the layers
            bias = {str(token_id(options.model, options.fault_word)): 100}
            fault_batch = server.complete_many(
                prompts(words, [7] * options.fault_requests, offset=17),
                options.max_tokens,
                extra={"logit_bias": bias},
            )
        workload = time.monotonic() - started
        batches = [wave, *long_batch, *(b for b in (extra_batch, fault_batch) if b is not None)]
    finally:
        stop = server.stop()
        time.sleep(1.0)
    log_text = server.log.read_text(errors="replace")
    files = [summarise_file(path, server.titles) for path in sorted(captures.glob("**/*.zst"))]
    return ServeRun(
        mode=options.mode,
        capture=options.capture,
        command=command,
        ready_s=ready,
        requests=sum(len(batch.completions) for batch in batches),
        completion_tokens=sum(batch.completion_tokens for batch in batches),
        prompt_tokens=sum(batch.prompt_tokens for batch in batches),
        workload_s=workload,
        stop_s=stop,
        sample=wave.completions[0].text[:80],
        files=files,
        fault_samples=[item.text[:80] for item in fault_batch.completions] if fault_batch else [],
        plugin_lines=sorted(set(PLUGIN_LINE.findall(log_text)))[:40],
        backend_lines=sorted(set(BACKEND_LINE.findall(log_text)) | set(QUANTIZATION.findall(log_text)))[:24],
        log=str(server.log),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a local model directory (tools/models/)")
    parser.add_argument("--mode", choices=("eager", "graph"), default="eager")
    parser.add_argument("--capture", choices=("always", "flight", "off"), default="always")
    parser.add_argument("--out", type=Path, required=True, help="logs, capture files and summary.json")
    parser.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the server")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra vllm serve argument")
    parser.add_argument("--prompt", action="append", default=[], help="extra prompts sent after the workload")
    parser.add_argument(
        "--fault-word",
        default=None,
        help="after the workload, requests whose first new token is forced to this word (logit bias): a model "
        "poisoned on it (make_gpt_oss.py --poison) turns non-finite at a decode step",
    )
    parser.add_argument(
        "--fault-at",
        choices=("decode", "prefill"),
        default="decode",
        help="decode (default): the word forced as the first new token; prefill: the word in the middle of "
        "prompts of --fault-prompt-words words (an eager prefill: longer than the largest graph size)",
    )
    parser.add_argument("--fault-prompt-words", type=int, default=FAULT_PROMPT_WORDS)
    parser.add_argument("--fault-requests", type=int, default=2)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds to wait for the server")
    options = parser.parse_args()
    result = run(options)
    (options.out / "summary.json").write_text(
        json.dumps({**asdict(result), "kernel_calls": result.kernel_calls}, indent=1)
    )
    print(
        f"serve_gpu: {result.mode}, capture {result.capture}: ready {result.ready_s:.1f} s, {result.requests} "
        f"requests, {result.prompt_tokens} prompt + {result.completion_tokens} completion tokens in "
        f"{result.workload_s:.1f} s, stopped in {result.stop_s:.1f} s; sample {result.sample!r}"
    )
    for text in result.fault_samples:
        print(f"  fault request answered: {text!r}")
    for line in result.backend_lines:
        print(f"  log: {line.strip()[:200]}")
    for line in result.plugin_lines:
        print(f"  plugin: {line.strip()[:200]}")
    for item in result.files:
        print(
            f"  {item.name}: pid {item.pid} [{item.title[:50]}] calls={item.calls} footer={item.footer} "
            f"ops={item.ops} statuses={item.statuses} steps={len(item.steps)} "
            f"({item.steps[:1]}..{item.steps[-1:]}) tags={item.tags} graph={item.cudagraph_modes} "
            f"ranks={item.ranks} with-parent={item.kernel_calls_with_parent} — {item.recovery}"
        )
        if item.layer_names:
            print(f"    layers: {', '.join(item.layer_names)}")
        if item.counters:
            print(f"    counters: {item.counters}")
    answered = result.requests > 0
    if options.capture == "always":
        return 0 if answered and result.kernel_calls > 0 else 1
    return 0 if answered else 1


if __name__ == "__main__":
    sys.exit(main())
