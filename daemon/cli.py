"""``mlxd`` command line: ``serve`` (the daemon), ``bench`` (load generator),
``launchd`` / ``systemd`` (run as a service, see ``daemon/service.py``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from mlxd.daemon import blas, service
from mlxd.daemon.bench import main as bench_main
from mlxd.daemon.security import ApiKeys
from mlxd.daemon.settings import SettingsError, load_settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxd", description="MLX serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API)")
    serve.add_argument("model", nargs="?", help="mlx-lm model dir or .gguf file (default: SmolLM2)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--config", type=Path, help="TOML file overriding config/default.toml")
    serve.add_argument(
        "--kind",
        choices=("auto", "text", "vision"),
        help="model kind (default: from the model's config.json; model.kind)",
    )
    serve.add_argument(
        "--parallel",
        choices=("off", "tensor", "pipeline", "auto"),
        help="one model over the ranks of `mlx.launch` (distributed.parallel)",
    )
    sub.add_parser("bench", help="benchmark a server or the in-process engine (see --help)")
    service.add_parsers(sub)
    return parser


def _overrides(args: argparse.Namespace) -> dict:
    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    model = {"path": args.model} if args.model else {}
    if args.kind:
        model["kind"] = args.kind
    distributed = {"parallel": args.parallel} if args.parallel else {}
    return {"server": server, "model": model, "distributed": distributed}


def serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, _overrides(args))
    except SettingsError as exc:
        print(f"mlxd: bad config: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.logging.level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        ApiKeys.from_settings(settings.auth)  # reads auth.api_key_file: fail before the model loads
    except ValueError as exc:
        logging.getLogger("mlxd").error("start-up failed: %s", exc)
        return 1
    logging.getLogger("mlxd").info(blas.status())
    import trio
    from mlxd.daemon.supervisor import serve as serve_forever

    try:
        trio.run(serve_forever, settings)
    except (FileNotFoundError, ValueError, OSError, RuntimeError, BaseExceptionGroup) as exc:
        cause = _startup_cause(exc)
        if cause is None:
            raise
        logging.getLogger("mlxd").error("start-up failed: %s", cause)
        return 1
    return 0


def _startup_cause(exc: BaseException) -> BaseException | None:
    """The model/config/bind error inside trio's exception groups, if that is what it is."""
    if isinstance(exc, BaseExceptionGroup):
        causes = [_startup_cause(e) for e in exc.exceptions]
        return next((c for c in causes if c is not None), None)
    if isinstance(exc, FileNotFoundError | ValueError | OSError):
        return exc
    # MLX's loaders say what is wrong with a weights file ("[load_safetensors] ... Perhaps
    # an incomplete download or corrupt file?"); any other RuntimeError is a bug: traceback.
    return exc if isinstance(exc, RuntimeError) and str(exc).startswith("[load") else None


def bench(argv: list[str]) -> int:
    return bench_main(argv)


COMMANDS = {
    "serve": serve,
    "launchd": service.launchd_command,
    "systemd": service.systemd_command,
}
_RUNS_MLX = ("serve", "bench")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # mlxd serves local model directories only: no library may reach for a model hub
    # (mlx-vlm's processors otherwise try a download for a missing optional file).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if argv[:1] and argv[0] in _RUNS_MLX:
        blas.reexec_with_openblas()
    if argv[:1] == ["bench"]:  # bench owns its flags
        return bench(argv[1:])
    args = _parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
