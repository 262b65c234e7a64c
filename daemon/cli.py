"""``mlxd`` command line: ``serve`` (the daemon), ``config`` (print the effective settings),
``bench`` (load generator), ``launchd`` / ``systemd`` (run as a service, see
``daemon/service.py``), ``cluster`` (a router in front of several daemons,
``daemon/cluster.py``), ``status`` (a running daemon's summary, ``daemon/dashboard/``).

Settings come from ``config/default.toml``, then ``--config FILE``, then ``MLXD_<SECTION>__<KEY>``
environment variables, then the flags in ``FLAGS`` (one table: the name, the setting(s) it
sets; vLLM's and mlx_lm.server's names where they have one)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from mlxd.daemon import quiet  # noqa: F401  first: before any import loads transformers

# isort: split
from mlxd.actors.engine.loading.sources import is_hub_id
from mlxd.daemon import blas, cluster, kernel_cache, parse_cmd, service
from mlxd.daemon.bench import main as bench_main
from mlxd.daemon.dashboard import terminal
from mlxd.daemon.security import ApiKeys
from mlxd.daemon.settings import Settings, SettingsError, load_settings


@dataclass(frozen=True)
class Flag:
    """A ``serve`` / ``config`` flag: the settings it sets, and fixed values it sets too."""

    name: str
    sets: tuple[str, ...]
    help: str
    type: Callable[[str], Any] = str
    repeat: bool = False
    choices: tuple[str, ...] | None = None
    also: tuple[tuple[str, Any], ...] = ()
    gather: Callable[[list[Any]], Any] = list  # a repeated flag's values as the setting

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


def adapter_pair(text: str) -> tuple[str, str]:
    """``--adapter NAME=DIR`` as (name, directory)."""
    name, sep, path = text.partition("=")
    if not (sep and name.strip() and path.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    return name.strip(), path.strip()


def adapter_table(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """The ``--adapter`` flags as ``model.adapters``; a name given twice is an error."""
    table: dict[str, str] = {}
    for name, path in pairs:
        if name in table:
            raise SettingsError(f"--adapter: {name!r} given twice")
        table[name] = path
    return table


FLAGS = (
    Flag("--host", ("server.host",), "address to listen on"),
    Flag("--port", ("server.port",), "port to listen on", int),
    Flag("--kind", ("model.kind",), "model kind (default: from its config.json)",
         choices=("auto", "text", "vision")),
    Flag("--served-model-name", ("model.served_id",),
         "the model id clients send (default: from the path)"),
    Flag("--adapter", ("model.adapters",),
         "a LoRA adapter requests choose by NAME, over the model (repeatable; NAME=DIR)",
         type=adapter_pair, repeat=True, gather=adapter_table),
    Flag("--chat-template", ("model.chat_template",),
         "the server's chat template (a Jinja string or a file) instead of the model's"),
    Flag("--api-key", ("auth.api_keys",), "an accepted API key (repeatable); none: no auth",
         repeat=True),
    Flag("--max-num-seqs", ("engine.max_batch", "admission.max_running"),
         "sequences decoded together, and requests running at once", int),
    Flag("--max-tokens", ("engine.default_max_tokens",),
         "max_tokens of a request that names none", int),
    Flag("--draft-model", ("speculative.draft_model",),
         "speculative decoding with this draft model (a dir, .gguf or ORG/NAME)",
         also=(("speculative.enabled", True), ("speculative.drafter", "draft_model"))),
    Flag("--num-draft-tokens", ("speculative.num_draft_tokens",), "tokens drafted per step", int),
    Flag("--log-level", ("logging.level",), "DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    Flag("--parallel", ("distributed.parallel",), "one model over the ranks of `mlx.launch`",
         choices=("off", "tensor", "pipeline", "auto")),
)  # fmt: skip

_NO_REMOTE_CODE = (
    "--trust-remote-code is not supported: mlxd runs models with mlx-lm / mlx-vlm's own "
    "code and never imports Python code from a model repository"
)


def _settings_options(parser: argparse.ArgumentParser) -> None:
    """The model, ``--config`` and every flag of ``FLAGS``: what ``serve`` and ``config`` take."""
    parser.add_argument(
        "model", nargs="?", help="model dir, .gguf file or Hugging Face id ORG/NAME[@revision]"
    )
    parser.add_argument("--config", type=Path, help="TOML file overriding config/default.toml")
    for flag in FLAGS:
        kw: dict[str, Any] = {"type": flag.type}
        if flag.repeat:
            kw["action"] = "append"
        setting = " + ".join(flag.sets)
        parser.add_argument(
            flag.name, choices=flag.choices, help=f"{flag.help} ({setting})", dest=flag.dest, **kw
        )
    parser.add_argument("--trust-remote-code", action="store_true", help="not supported")


# The page each command's --help ends with: a path in the repository (the site's source,
# `mkdocs serve -f docs/mkdocs.yml`), stable across where the site is published.
DOCS = {
    "mlxd": "docs/index.md",
    "serve": "docs/operations.md#settings",
    "config": "docs/operations.md#every-setting",
    "bench": "docs/development.md#benchmarks",
    "status": "docs/operations.md#dashboard-and-mlxd-status",
    "launchd": "docs/operations.md#running-as-a-service",
    "systemd": "docs/operations.md#running-as-a-service",
    "cluster": "docs/scaling.md#several-daemons-behind-a-router",
    "parse": "docs/families.md#mlxd-parse",
}


def docs_epilog(command: str) -> str:
    """The last line of a command's help: the documentation page to read."""
    return f"docs: {DOCS.get(command, DOCS['mlxd'])}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd", description="MLX serving daemon", epilog=docs_epilog("mlxd")
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API)")
    _settings_options(serve)
    config = sub.add_parser("config", help="print the effective settings as TOML and exit")
    _settings_options(config)
    sub.add_parser("bench", help="benchmark a server or the in-process engine (see --help)")
    terminal.add_parser(sub)
    service.add_parsers(sub)
    cluster.add_parser(sub)
    parse_cmd.add_parser(sub)
    for name, command in sub.choices.items():
        command.epilog = docs_epilog(name)
    return parser


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    tree.setdefault(section, {})[key] = value


def _overrides(args: argparse.Namespace) -> dict:
    """The settings the model argument and the flags given set (a nested dict)."""
    tree: dict[str, Any] = {}
    if args.model:
        _put(tree, "model.path", args.model)
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if value is not None:
            value = flag.gather(value) if flag.repeat else value
            for dotted in flag.sets:
                _put(tree, dotted, value)
            for dotted, fixed in flag.also:
                _put(tree, dotted, fixed)
    return tree


def effective_settings(args: argparse.Namespace) -> Settings:
    """Defaults < ``--config`` file < ``MLXD_*`` environment < flags; ``SettingsError``."""
    if args.trust_remote_code:
        raise SettingsError(_NO_REMOTE_CODE)
    return load_settings(args.config, _overrides(args), os.environ)


def _model_paths(s: Settings) -> list[str]:
    """Every model the settings may load: served, draft and scorer models."""
    paths = [s.speculative.draft_model, s.spec_prefill.scorer_model]
    for entry in s.model_entries():
        paths.append(entry.path)
        paths += [entry.speculative.draft_model] if entry.speculative else []
        paths += [entry.spec_prefill.scorer_model] if entry.spec_prefill else []
    return paths


def hub_access(s: Settings) -> None:
    """Only a Hugging Face id may reach the hub: with none configured, nothing may (mlx-vlm's
    processors would otherwise look for optional files online). huggingface_hub reads
    ``HF_HUB_OFFLINE`` once, at import: call this before anything imports it."""
    if not any(is_hub_id(path) for path in _model_paths(s)):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _settings_or_report(args: argparse.Namespace) -> Settings | None:
    """The effective settings, or None after saying on stderr what is wrong with them."""
    try:
        return effective_settings(args)
    except SettingsError as exc:
        print(f"mlxd: bad config: {exc}", file=sys.stderr)
        return None


def serve(args: argparse.Namespace) -> int:
    settings = _settings_or_report(args)
    if settings is None:
        return 2
    logging.basicConfig(
        level=settings.logging.level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:  # files the settings name: fail before the model loads
        ApiKeys.from_settings(settings.auth)
        settings.model.chat_template_text()
    except ValueError as exc:
        logging.getLogger("mlxd").error("start-up failed: %s", exc)
        return 1
    hub_access(settings)
    # SIGHUP must not end the process: ignored (with a log line) until the server takes it
    # over (it re-reads the API key file), and on the ranks that follow rank 0
    signal.signal(signal.SIGHUP, _sighup_ignored)
    logging.getLogger("mlxd").info(blas.status())
    logging.getLogger("mlxd").info(kernel_cache.use(settings.engine.kernel_cache_dir))
    if (threads := blas.set_threads(settings.engine.blas_threads)) is not None:
        logging.getLogger("mlxd").info(threads)
    import trio
    from mlxd.daemon.supervisor import serve as serve_forever

    try:
        if settings.distributed.parallel != "off":  # one of the ranks of `mlx.launch`
            from mlxd.daemon.ranks import serve as serve_over_ranks

            return serve_over_ranks(settings)
        trio.run(serve_forever, settings)
    except (FileNotFoundError, ValueError, OSError, RuntimeError, BaseExceptionGroup) as exc:
        cause = _startup_cause(exc)
        if cause is None:
            raise
        logging.getLogger("mlxd").error("start-up failed: %s", cause)
        return 1
    return 0


def _sighup_ignored(signum: int, frame: object) -> None:
    logging.getLogger("mlxd").info("received SIGHUP: ignored (no HTTP server here, or not yet)")


def config(args: argparse.Namespace) -> int:
    """Print the settings ``serve`` would run with (API keys masked) as TOML."""
    settings = _settings_or_report(args)
    if settings is None:
        return 2
    tree = _without_none(msgspec.to_builtins(settings))  # TOML has no null: unset is absent
    tree["auth"]["api_keys"] = ["***"] * len(settings.auth.api_keys)
    sys.stdout.write(msgspec.toml.encode(tree).decode())
    return 0


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return [_without_none(v) for v in value] if isinstance(value, list) else value


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


def status(args: argparse.Namespace) -> int:
    """Print a running daemon's summary (``--url``, else the settings' host and port)."""
    url = args.url
    if url is None:
        try:
            server = load_settings(None, None, os.environ).server
        except SettingsError as exc:
            print(f"mlxd: bad config: {exc}", file=sys.stderr)
            return 2
        url = terminal.default_url(server.host, server.port)
    return terminal.main(args, url)


def bench(argv: list[str]) -> int:
    return bench_main(argv)


COMMANDS = {
    "serve": serve,
    "config": config,
    "status": status,
    "launchd": service.launchd_command,
    "systemd": service.systemd_command,
    "cluster": cluster.cluster_command,
    "parse": parse_cmd.parse_command,
}
_RUNS_MLX = ("serve", "bench")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in _RUNS_MLX:
        blas.reexec_with_openblas()
    if argv[:1] == ["bench"]:  # bench owns its flags; it loads local models only
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return bench(argv[1:])
    args = _parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
