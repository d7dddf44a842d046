"""What a trainer process is: the launcher of a torchrun job, one of its ranks, or the
whole trainer in one process.

    python -m treadle.trainer / treadle serve trainer  [--nproc-per-node N --nnodes M
        --node-rank R --master-addr A --master-port P]  @ run.toml ...
      ├─ under torchrun (RANK and WORLD_SIZE set): rank 0 ─▶ the service (``service.py``)
      │                                            rank > 0 ─▶ ``follower.py``
      ├─ trainer.distributed.world_size > 1 ─▶ torch.distributed.run in this process:
      │     nproc_per_node ranks here, each `python -m treadle.trainer <same arguments>`;
      │     nnodes > 1: static rendezvous at master_addr:master_port (node 0 holds rank 0)
      └─ otherwise ─▶ the service, one process

The short flags are aliases of ``--trainer.distributed.<key>``. torchrun stops every rank
when one fails (SIGTERM, then SIGKILL after shutdown_timeout_s); this launcher then exits
1 with one line naming the rank that failed first and how. On SIGTERM/SIGINT it passes the
signal to the ranks (rank 0 checkpoints with the others, then stops them) and exits 0.
Not here: what the ranks do (``service.py``, ``follower.py``, ``ranks.py``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from treadle.services.errors import ConfigError
from treadle.services.host import load_service_config, serve
from treadle.services.logs import setup_logging
from treadle.services.redact import register_config_secrets
from treadle.trainer.spec import SPEC

log = logging.getLogger(__name__)

# `--nproc-per-node 2` == `--trainer.distributed.nproc_per_node 2` (torchrun's spelling too)
ALIASES = {
    f"--{flag}": f"--trainer.distributed.{key}"
    for key in ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")
    for flag in (key.replace("_", "-"), key)
}


def expand_aliases(argv: Sequence[str]) -> list[str]:
    """Rewrite the short torchrun-style flags into config flags."""
    out = []
    for tok in argv:
        name, eq, value = tok.partition("=")
        if name in ALIASES:
            tok = ALIASES[name] + eq + value
        out.append(tok)
    return out


def is_rank() -> bool:
    """Whether torchrun (or another launcher) started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: Sequence[str]) -> int:
    try:
        argv = expand_aliases(argv)
        if is_rank():
            _die_with_parent()
            if int(os.environ["RANK"]) > 0:
                from treadle.trainer.follower import main as follow

                return follow(argv)
            return _serve(argv)
        loaded, dry_run = load_service_config(SPEC, argv)
        cfg: Any = loaded
    except ConfigError as e:
        print(f"treadle trainer: {e}", file=sys.stderr)
        return 2
    if dry_run or cfg.trainer.distributed.world_size == 1:
        return _serve(argv)
    return launch(cfg, argv)


def _serve(argv: Sequence[str]) -> int:
    from treadle.trainer.service import build

    return serve(SPEC, build, argv)


def torchrun_argv(cfg: Any, argv: Sequence[str]) -> list[str]:
    """torchrun's command line for this node's ranks, each `-m treadle.trainer argv`."""
    d = cfg.trainer.distributed
    out = [
        f"--nproc-per-node={d.nproc_per_node}",
        f"--nnodes={d.nnodes}",
        f"--node-rank={d.node_rank}",
        f"--shutdown-timeout={d.shutdown_timeout_s}",
        "--max-restarts=0",
    ]
    if d.nnodes > 1:
        out += [f"--master-addr={d.master_addr}", f"--master-port={d.master_port}"]
    # one node: torchrun's own rendezvous on a free localhost port
    return [*out, "-m", SPEC.module, *argv]


def launch(cfg: Any, argv: Sequence[str]) -> int:
    """Run this node's ranks under torch.distributed.run until they end; the exit code."""
    register_config_secrets(cfg)
    setup_logging("trainer[launch]", cfg.log)
    d = cfg.trainer.distributed
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun would set 1 (and say so)
        cpus = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(max(1, cpus // d.nproc_per_node))
    log.info(
        "[startup] starting ranks %d..%d of %d (node %d of %d, %d per node, rendezvous %s) "
        "through torch.distributed.run",
        d.node_rank * d.nproc_per_node, (d.node_rank + 1) * d.nproc_per_node - 1,
        d.world_size, d.node_rank, d.nnodes, d.nproc_per_node,
        f"{d.master_addr}:{d.master_port}" if d.nnodes > 1 else "a free localhost port",
    )  # fmt: skip
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_argv(cfg, argv)))
    except ChildFailedError as e:
        log.error("[shutdown] trainer failed: %s", describe_failures(e.failures))
        return 1
    except SignalException as e:
        log.info(
            "[shutdown] %s: passed to the ranks (rank 0 checkpoints, then stops the others)",
            signal.Signals(e.sigval).name,
        )
        return 0
    log.info("[shutdown] every rank of this node stopped cleanly")
    return 0


def describe_failures(failures: dict[int, Any]) -> str:
    """One line: the rank that failed on its own first, then how the others ended."""

    def how(f: Any) -> str:
        if f.exitcode < 0:
            try:
                return f"was killed by {signal.Signals(-f.exitcode).name}"
            except ValueError:
                return f"was killed by signal {-f.exitcode}"
        return f"exited with {f.exitcode}"

    # a rank torchrun stopped itself ended by SIGTERM: it is a consequence, not the cause
    def order(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, f = item
        return (f.exitcode == -signal.SIGTERM, f.timestamp, rank)

    ranked = sorted(failures.items(), key=order)
    (first, f0), rest = ranked[0], ranked[1:]
    text = f"rank {first} (local rank {f0.local_rank}, pid {f0.pid}) {how(f0)}"
    if rest:
        text += "; then " + ", ".join(f"rank {r} {how(f)}" for r, f in rest)
    return (
        text + ". The job stopped; restart it and it resumes from the newest checkpoint in "
        "the object store (the steps after it are trained again, once)"
    )


def _die_with_parent() -> None:
    """A rank dies with its torchrun agent (Linux), so no rank outlives a SIGKILLed launcher."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the agent was already gone
        os._exit(1)
