"""The ``treadle`` command.

    treadle stack  [@ run.toml ...] [--section.key VALUE ...] [--check] [--dry-run]
    treadle serve  SERVICE [@ run.toml ...] [--section.key VALUE ...] [--dry-run]
    treadle report RUN_DIR
    treadle health SERVICE [@ run.toml ...] [--section.key VALUE ...] [--target HOST:PORT]
    treadle rl | sft  [@ run.toml ...] [--dry-run]  (the whole job on this machine, live progress)
    treadle eval   [@ eval.toml ...] [--eval.key VALUE ...]   (score a model on an environment)
    treadle sft-data [@ run.toml ...]          (an SFT dataset rejection-sampled from an environment)
    treadle env init NAME [--dir DIR]                          (scaffold an environment package)
    treadle check-template MODEL_DIR [--renderer R] [--cases N] (prove token-exact rendering)
    treadle platform serve @ platform.toml | submit | list | watch | cancel   (hosted runs)

Errors print as one line (``treadle: error: ...``) and exit non-zero; ``--debug`` before
the subcommand shows tracebacks.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from treadle.services import __version__
from treadle.services.config import ConfigSources, split_argv
from treadle.services.errors import ConfigError, TreadleError

CONFIG_HELP = (
    "config: `@ a.toml [b.toml ...]` (merged in order), then `--section.key VALUE` flags; "
    "env vars TREADLE_<SECTION>__<KEY> sit between files and flags. --dry-run prints the "
    "resolved config and exits."
)

# Jobs whose services have not landed yet: what they will do, and what to use meanwhile.
NOT_YET: dict[str, str] = {}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="treadle",
        description="Treadle: evaluate and post-train LLMs with RL. " + CONFIG_HELP,
    )
    p.add_argument("--version", action="version", version=f"treadle {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    usage = "%(prog)s [@ run.toml ...] [--section.key VALUE ...] [--dry-run]"

    def job(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=f"{help_}. {CONFIG_HELP}", usage=usage)

    job("rl", "train a policy with asynchronous RL on the local stack")
    job(
        "sft",
        "supervised fine-tuning on the local stack, on a chat dataset (orchestrator.tasks) "
        "or on samples of an environment ([sft_data], sampled first)",
    )
    job("eval", "evaluate a model on an environment (pass@k, mean reward)")
    job(
        "sft-data",
        "write an SFT dataset from an environment by rejection sampling a source model "
        "([sft_data]: k samples per task, kept when reward >= min_reward)",
    )
    st = sub.add_parser(
        "stack",
        help="start the local stack (embedded NATS + installed services) and report health",
        description="Start the local stack: an embedded nats-server (unless nats.url is set) and "
        "every installed service (inference and the trainer side by side, then the rest once "
        "they are healthy). " + CONFIG_HELP,
        usage="%(prog)s [--check] " + usage.removeprefix("%(prog)s "),
    )
    st.add_argument("--check", action="store_true", help="stop again once everything is healthy")
    sv = sub.add_parser(
        "serve",
        help="run one service alone against given NATS / S3 / inference addresses",
        description="Run one service in the foreground (multi-node deployments). The trainer "
        "also takes --nproc-per-node N [--nnodes M --node-rank K --master-addr HOST "
        "--master-port P]: that many ranks through torchrun (trainer/README.md). " + CONFIG_HELP,
        usage="%(prog)s SERVICE " + usage.removeprefix("%(prog)s "),
    )
    sv.add_argument("service", help="env_runner | orchestrator | inference | trainer")
    hc = sub.add_parser(
        "health",
        help="probe a service's gRPC health; say what it waits for when not serving",
        description="Ask a service's gRPC health (and, unless SERVING, its GetStatus for the "
        "reason) at 127.0.0.1:<its grpc.port>, with the control plane's TLS and token from the "
        "same config the service reads. Exit 0 when SERVING, 1 otherwise: a container "
        "healthcheck. " + CONFIG_HELP,
        usage="%(prog)s SERVICE [--target HOST:PORT] " + usage.removeprefix("%(prog)s "),
    )
    hc.add_argument("service", help="env_runner | orchestrator | inference | trainer")
    hc.add_argument("--target", help="HOST:PORT to probe instead of the configured grpc port")
    en = sub.add_parser("env", help="environment packages", description="Environment packages.")
    env_sub = en.add_subparsers(dest="env_command", required=True, metavar="ENV_COMMAND")
    ei = env_sub.add_parser(
        "init",
        help="scaffold a new environment package with a test",
        description="Create DIR/NAME: a pip-installable environment package (task set, rubric, "
        "test, eval.toml).",
    )
    ei.add_argument("name", help="environment name (letters, digits, _)")
    ei.add_argument("--dir", type=Path, default=Path("."), help="parent folder (default: .)")
    ep = env_sub.add_parser(
        "push",
        help="store an environment package in a run's object store; print its pin",
        description="Build DIR (a pip-installable environment package) into a wheel, check "
        "that its entry loads as an Environment, and store it in the object store the config "
        "names, under envs/<name>/<sha256>. Prints the pin env runners install it by "
        '(env_runner.pushed_envs = ["<name>@<sha256>"]). ' + CONFIG_HELP,
        usage="%(prog)s DIR [--entry MODULE:ATTR] " + usage.removeprefix("%(prog)s "),
    )
    ep.add_argument("package_dir", type=Path, help="the package folder (with pyproject.toml)")
    ep.add_argument("--entry", help='its Environment, "module:attribute" (default: '
                    '"<DIR name>:ENVIRONMENT")')  # fmt: skip
    ct = sub.add_parser(
        "check-template",
        help="prove token-exact chat rendering on a model folder (vs transformers)",
        description="Say which renderer MODEL_DIR's chat template gets and why, then render the "
        "conformance corpus with it and with transformers and compare text, token ids, loss "
        "masks and bridges. Exits non-zero with the first difference.",
    )
    ct.add_argument("model_dir", type=Path, help="folder with tokenizer.json and the chat template")
    ct.add_argument("--renderer", default="auto", help='"auto" (default), a family port or "jinja"')
    ct.add_argument("--cases", type=int, default=120, help="corpus cases (default 120)")
    us = sub.add_parser(
        "usage",
        help="print runs' usage ledgers: rollouts, prompt and sampled tokens, trained tokens, "
        "trainer time",
        description="Print the usage ledger of the configured run (a finished local run is "
        "read from its folder; a live or hosted one from nats.url with admin credentials), or "
        "of each --run-file, and the sums per tenant. --check holds each ledger against the "
        "run's ROLLOUTS and stored batches and exits 1 on a difference. " + CONFIG_HELP,
        usage="%(prog)s [--check] [--run-file RUN.toml ...] " + usage.removeprefix("%(prog)s "),
    )
    us.add_argument(
        "--check", action="store_true", help="check the ledgers; exit 1 on a difference"
    )
    us.add_argument("--run-file", type=Path, action="append", default=[],
                    help="a run's own config file (repeatable), read alone")  # fmt: skip
    ex = sub.add_parser(
        "export",
        help="write a run's published policy of one step (default: its newest) as a model "
        "folder, e.g. to start another run from it",
        description="Write the policy a run's trainer published at step N (every step is "
        "published to the run's object store) as a folder vLLM, transformers and treadle "
        "load: its weights and config (a LoRA run: its PEFT adapter), sha256-verified, plus "
        "trainer.model's tokenizer files. Name the run as when it was started (its config "
        "file and overrides, e.g. run.name). " + CONFIG_HELP,
        usage="%(prog)s --out DIR [--step N] " + usage.removeprefix("%(prog)s "),
    )
    ex.add_argument("--out", type=Path, required=True, help="the folder to write (new or empty)")
    ex.add_argument("--step", type=int, help="policy version (= trainer step; default: newest)")
    pf = sub.add_parser(
        "platform",
        add_help=False,
        help="a shared deployment tenants train runs on: serve | submit | list | watch | "
        "cancel (`treadle platform --help`)",
    )
    pf.add_argument("rest", nargs=argparse.REMAINDER)
    rp = sub.add_parser(
        "report",
        help="summarize a run folder (outputs/<run>), with plots and an HTML page",
        description="Summarize a run folder's metrics per service, reward first, and write "
        "PNG plots (RUN_DIR/plots/) and one self-contained page (RUN_DIR/report.html) with "
        "them and the run's config. Plots need treadle-services[report] (matplotlib).",
    )
    rp.add_argument("run_dir", type=Path)
    rp.add_argument(
        "--no-write", action="store_true", help="print the summary only; write no files"
    )
    return p


# Commands that run for long and hold sockets: a peer that goes away must be an error
# there (EPIPE), not SIGPIPE killing the process (entrypoint's default is for piping
# short output into `head`). `treadle platform serve` (which sets it itself) died so,
# silently, when nats-server refused a connection it was writing to.
LONG_RUNNING = ("rl", "sft", "stack", "serve")


def _run(args: argparse.Namespace) -> int:
    if args.command in LONG_RUNNING:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if args.command in ("rl", "sft"):
        from treadle.services.launcher import resolve, resolved_toml, run_job
        from treadle.services.logs import setup_logging

        sources = split_argv(args.config)
        sources = _sft_dataset(sources, args.command)
        if sources.dry_run:
            print(resolved_toml(*resolve(sources, args.command)), end="")
            return 0
        setup_logging("launcher")
        return asyncio.run(run_job(sources, args.command))
    if args.command == "eval":
        return _env_runner_module("evaluate").main(args.config)
    if args.command == "sft-data":
        return _env_runner_module("sft_data").main(args.config)
    if args.command == "platform":
        from treadle.services.platform import main as platform_main

        return platform_main(args.rest)
    if args.command == "env" and args.env_command == "push":
        return _env_push(args)
    if args.command == "env":
        path = _env_runner_module("scaffold").init(args.name, args.dir)
        print(f"created {path}: `pip install -e {path}` then `pytest {path}`; "
              f"`treadle eval @ {path / 'eval.toml'}` scores a model on it")  # fmt: skip
        return 0
    if args.command in NOT_YET:
        split_argv(args.config)  # still reject malformed arguments clearly
        print(
            f"treadle {args.command}: not available yet: {NOT_YET[args.command]}. "
            "Meanwhile `treadle stack` starts the local stack and reports its health.",
            file=sys.stderr,
        )
        return 3
    if args.command == "stack":
        from treadle.services.launcher import resolve, resolved_toml, run_stack

        sources = split_argv(args.config)
        if sources.dry_run:
            print(resolved_toml(*resolve(sources)), end="")
            return 0
        from treadle.services.logs import setup_logging

        setup_logging("launcher")
        return asyncio.run(run_stack(sources, check_only=args.check))
    if args.command == "serve":
        from treadle.services.registry import get_service

        spec = get_service(args.service)
        module = importlib.import_module(spec.module + ".__main__")
        code: int = module.main(args.config)
        return code
    if args.command == "health":
        return _health(args)
    if args.command == "usage":
        from treadle.services import usage

        return usage.main(args.config, args.run_file, args.check)
    if args.command == "export":
        from treadle.services import export

        return export.main(args.config, args.step, args.out)
    if args.command == "check-template":
        try:
            from treadle_native.conformance.check import check_template
        except ImportError:
            raise TreadleError(
                "check-template needs treadle-native (installed with treadle-env-runner)"
            ) from None
        if not (args.model_dir / "tokenizer.json").is_file():
            raise TreadleError(f"{args.model_dir} has no tokenizer.json")
        return check_template(args.model_dir, renderer=args.renderer, num_cases=args.cases)
    if args.command == "report":
        from treadle.services.report import load_run, summary_text

        data = load_run(args.run_dir)
        print(summary_text(data))
        if not data.num_records:
            raise TreadleError(
                f"{args.run_dir} has no metrics to report (metrics.jsonl "
                f"{'holds no readable record' if (args.run_dir / 'metrics.jsonl').exists() else 'is absent'}): "
                "metrics are recorded by `treadle rl`/`sft` as the run goes"
            )
        if not args.no_write:
            from treadle.services.report_html import describe, write_report

            print(describe(write_report(data)))
        return 0
    raise AssertionError(f"unhandled command {args.command}")


def _health(args: argparse.Namespace) -> int:
    from treadle.services.host import load_service_config
    from treadle.services.registry import get_service
    from treadle.services.rpc import ControlSecurity
    from treadle.services.startup import probe, probe_target

    spec = get_service(args.service)
    cfg, _ = load_service_config(spec, args.config)
    target = args.target or probe_target(spec.grpc_section(cfg))
    ok, line = asyncio.run(probe(spec, target, ControlSecurity.load(cfg.control)))
    print(line)
    return 0 if ok else 1


def _env_push(args: argparse.Namespace) -> int:
    from treadle.services.config import gather, validate
    from treadle.services.objectstore import open_store
    from treadle.services.registry import known_sections
    from treadle.services.sections import ServiceConfig

    cfg = validate(ServiceConfig, gather(split_argv(args.config)), known_sections())
    store = open_store(cfg.object_store, cfg.run.name, cfg.run.run_dir)
    pushed = _env_runner_module("pushed").push(store, args.package_dir, args.entry)
    print(f"pushed environment {pushed.name} ({pushed.entry}) to "
          f"{store.uri(f'envs/{pushed.name}/{pushed.sha256}')}")  # fmt: skip
    print(f'env_runner.pushed_envs = ["{pushed.pin}"]')
    return 0


def _sft_dataset(sources: ConfigSources, job: str) -> ConfigSources:
    """The job's chat data, ready before anything starts: with ``[sft_data] env`` set,
    rejection-sample the dataset (resumable) and point the setting that reads it at it --
    ``treadle sft``'s orchestrator.tasks, ``treadle rl``'s orchestrator.demos.data (the
    demonstrations of every RL batch); then, for sft, read and render every row (a bad row
    is an error naming it, before the stack starts; rl's orchestrator renders its
    demonstrations before its first request)."""
    from treadle.services.config import gather
    from treadle.services.launcher import resolve
    from treadle.services.registry import SFT_DATA_SECTION, get_service

    raw = gather(sources).data
    sampled = bool(raw.get(SFT_DATA_SECTION, {}).get("env"))
    if not sampled and job != "sft":
        return sources
    if sampled:
        setting, use = {
            "sft": ("tasks", "train on that dataset"),
            "rl": ("demos.data", "train on those demonstrations beside RL"),
        }[job]
        value: Any = raw.get("orchestrator", {})
        for key in setting.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            raise ConfigError(
                f"set either orchestrator.{setting} ({use}) or sft_data.env (sample a dataset "
                "from the environment and train on it), not both"
            )
        sft_data = _env_runner_module("sft_data")
        data_cfg = sft_data.load(sources)
        path = sft_data.dataset_path(data_cfg)
        sources = replace(
            sources,
            overrides=[*sources.overrides, (f"orchestrator.{setting}", str(path), "sft_data")],
        )
    _, specs = resolve(sources, job)  # the whole job's config is valid before sampling
    if sources.dry_run:
        return sources
    if sampled:
        summary = asyncio.run(sft_data.build(data_cfg))
        print(sft_data.summary_text(summary), flush=True)
    if job != "sft":
        return sources
    orchestrator: Any = next(c for spec, c in specs if spec.name == "orchestrator")
    module = importlib.import_module(get_service("orchestrator").module + ".chat_data")
    print(module.check_job_dataset(orchestrator.orchestrator), flush=True)
    return sources


def _env_runner_module(name: str) -> Any:
    """A module of the env runner package (installed separately from the CLI)."""
    from treadle.services.registry import get_service

    spec = get_service("env_runner")  # a clear error when treadle-env-runner is not installed
    return importlib.import_module(f"{spec.module}.{name}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, config_argv = parser.parse_known_args(argv)
    args.config = config_argv
    if args.command == "env" and args.env_command != "push" and config_argv:
        parser.error(f"env {args.env_command} takes no config arguments: {' '.join(config_argv)}")
    if args.command == "check-template" and config_argv:
        parser.error(f"check-template takes a model folder only: {' '.join(config_argv)}")
    if args.command == "report" and config_argv:
        parser.error(
            f"report takes only a run folder, got extra arguments: {' '.join(config_argv)}"
        )
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("treadle: interrupted", file=sys.stderr)
        return 130
    except TreadleError as e:
        if args.debug:
            raise
        kind = "configuration error" if isinstance(e, ConfigError) else "error"
        print(f"treadle: {kind}: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


def entrypoint() -> None:
    """The `treadle` console script: main() plus process-wide settings tests must not inherit."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `treadle ... | head` ends quietly
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
