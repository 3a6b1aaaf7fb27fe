"""`appliance` command line: serve (gateway), engine (inference process), make-tiny-model, demo."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from appliance.config import ConfigError, load_config


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(Path(args.config))
    except ConfigError as exc:
        print(f"appliance serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.server.log_level.upper())
    import uvloop  # the loop must exist before any grpc.aio object

    from appliance.gateway import serve

    return uvloop.run(serve(config))


def _engine(args: argparse.Namespace) -> int:
    import torch
    import uvloop

    from appliance.engine.server import run_engine

    torch.set_num_threads(args.threads)
    return uvloop.run(run_engine(Path(args.repository), args.listen, args.device))


def _make_tiny_model(args: argparse.Namespace) -> int:
    from appliance.tiny_model import ensure_tiny_model

    model_dir, repo_dir = ensure_tiny_model(Path(args.dest))
    print(f"model: {model_dir}\nrepository: {repo_dir}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from appliance.demo import run_demo

    return run_demo(Path(args.workdir), args.requests, args.max_tokens)


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
