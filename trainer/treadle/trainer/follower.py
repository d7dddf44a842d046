"""Ranks 1..W-1 of a trainer job: no NATS, no gRPC; they do what rank 0 orders.

    config ─▶ logging ─▶ object store ─▶ process group ─▶ Trainer (FSDP2) ─▶ resume
        ─▶ loop: order ◀── rank 0 (``ranks.py``)
             TRAIN(ready, batch) ─▶ train_step (its micro-batches, FSDP collectives,
                                    the weight gather rank 0 publishes)
             CHECKPOINT ─▶ save_checkpoint (its DCP shard and RNG file, uploaded by itself)
             NOOP ─▶ nothing;  STOP ─▶ exit 0

SIGTERM/SIGINT (torchrun forwards them to every rank) are noted and otherwise ignored
once the rank follows: rank 0 got the same signal, checkpoints with everyone and then
sends STOP. A rank 0 that is gone fails the next exchange (RankLostError, exit 1).
Exit codes as the service host's: 0 stopped by rank 0, 1 failed, 2 bad configuration.
Not here: the decisions (rank 0's ``service.py``), starting the ranks (``launch.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from treadle.proto.v1 import batch_pb2
from treadle.services.errors import ConfigError, TreadleError
from treadle.services.host import apply_cpu_affinity, load_service_config
from treadle.services.logs import setup_logging
from treadle.services.objectstore import open_store
from treadle.services.redact import register_config_secrets
from treadle.trainer.spec import SPEC

log = logging.getLogger(__name__)


def main(argv: Sequence[str]) -> int:
    """Run this process as rank ``$RANK`` (> 0) of a torchrun job until rank 0's STOP."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg, _ = load_service_config(SPEC, argv)
    except ConfigError as e:
        print(f"treadle trainer (rank {rank}): {e}", file=sys.stderr)
        return 2
    register_config_secrets(cfg)
    setup_logging(f"trainer[rank {rank}]", cfg.log)
    try:
        apply_cpu_affinity(os.environ)
        _follow(cfg, rank)
    except TreadleError as e:
        log.error("[shutdown] trainer rank %d failed: %s", rank, e)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("[shutdown] trainer rank %d crashed", rank)
        return 1
    log.info("[shutdown] trainer rank %d stopped cleanly", rank)
    return 0


def _follow(cfg: Any, rank: int) -> None:
    section = cfg.trainer
    if section.model is None:
        log.warning("[startup] trainer.model is not set: rank %d has nothing to do", rank)
        return
    from treadle.trainer.distributed import device_type, init_topology
    from treadle.trainer.ranks import Command, OrderChannel, is_collective_failure, lost
    from treadle.trainer.trainer import Trainer

    store = open_store(cfg.object_store, cfg.run.name, cfg.run.run_dir)
    topology = init_topology(device_type(section.device))
    orders = OrderChannel(topology)  # before the model: the same point as rank 0
    checkpoint_dir = section.checkpoint_dir or cfg.run.run_dir / "trainer" / "checkpoints"
    trainer = Trainer(section, store, checkpoint_dir=checkpoint_dir, topology=topology)
    trainer.resume()
    log.info("[startup] rank %d follows rank 0 from step %d", rank, trainer.step + 1)

    def noted(signum: int, _frame: Any) -> None:
        log.info("[shutdown] %s: waiting for rank 0's last orders", signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, noted)
    while True:
        order = orders.receive()
        try:
            if order.command == Command.TRAIN:
                ready = batch_pb2.BatchReady.FromString(order.ready)
                result = trainer.train_step(ready, order.batch)
                log.info("step %d trained on rank %d", result.step, rank)
            elif order.command == Command.CHECKPOINT:
                trainer.save_checkpoint()
            elif order.command == Command.STOP:
                return
        except TreadleError:
            raise
        except Exception as e:
            if is_collective_failure(e):
                raise lost(e, f"following order {order.command.name}") from None
            raise
