"""The inference service on this machine with a tiny model: start, generation throughput,
weight updates (in place, and by restart).

    .venv/bin/python benchmarks/inference_bench.py [--concurrency 1 8 32] [--max-tokens 128]
        [--updates 5] [--dtype float32]

Starts an embedded nats-server and ``python -m treadle.inference`` on a random-init
Qwen3 (hidden 128, 2 layers, head_dim 64: the test model), then measures:

1. start: process start until gRPC health is SERVING (vLLM start, warm-up request,
   version 0 labelled), and vLLM's own share of it;
2. generation through ``InferenceClient`` (token in/out, logprobs, per-token versions):
   ``c`` concurrent streams of ``--max-tokens`` tokens each (eos ignored), tokens/s;
3. weight updates published on the POLICY stream like the trainer does (output head
   rescaled, probe of 64 tokens): median of ``--updates`` in-place updates, with the
   service's own breakdown (fetch, drain, reload, verify), then one update whose
   config.json changes, which restarts vLLM.

A random tiny model measures the serving machinery, not a real model's compute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from testkit.inference import perturbed_copy, publish_policy  # noqa: E402
from treadle.inference.spec import SPEC  # noqa: E402
from treadle.proto.v1 import common_pb2, metrics_pb2, policy_pb2  # noqa: E402
from treadle.services.bus import Bus  # noqa: E402
from treadle.services.inference_client import InferenceClient  # noqa: E402
from treadle.services.nats_server import EmbeddedNats  # noqa: E402
from treadle.services.objectstore import LocalObjectStore  # noqa: E402
from treadle.services.ports import free_port  # noqa: E402
from treadle.services.rpc import check_health, open_channel  # noqa: E402
from treadle.services.sections import NatsSection  # noqa: E402
from treadle.services.supervisor import ManagedProcess  # noqa: E402
from treadle.services.tiny_model import build_tiny_model  # noqa: E402

RUN = "bench"
PROBE = tuple(range(3, 3 + 64))


async def wait_version(stub: object, version: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while (await stub.GetStatus(common_pb2.GetStatusRequest())).policy_version != version:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} not served after {timeout_s}s")
        await asyncio.sleep(0.02)


async def bench(args: argparse.Namespace, work: Path) -> None:
    nats = EmbeddedNats(work / "nats", work / "nats.log")
    url = nats.start()
    model = build_tiny_model(work / "base", seed=0)
    http_port, grpc_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "treadle.inference", "--nats.url", url, "--run.name", RUN,
        "--run.output_dir", str(work), "--object_store.root", str(work / "store"),
        "--inference.model", str(model), "--inference.dtype", args.dtype,
        "--inference.http_port", str(http_port), "--inference.grpc.port", str(grpc_port),
    ]  # fmt: skip
    started = time.monotonic()
    proc = ManagedProcess("inference", argv, work / "inference.log").start()
    target = f"127.0.0.1:{grpc_port}"
    bus = await Bus.connect(NatsSection(url=url), RUN)
    store = LocalObjectStore(work / "store")
    try:
        while not await check_health(target, SPEC.control.full_name):
            if proc.poll() is not None:
                raise proc.failure("died")
            await asyncio.sleep(0.1)
        serving_s = time.monotonic() - started
        report = await bus.last(
            "METRICS", bus.subjects.metrics("inference"), metrics_pb2.MetricsReport
        )
        vllm_s = report.values["vllm_start_s"] if report else float("nan")
        print(f"start: SERVING after {serving_s:.1f}s (vLLM answering after {vllm_s:.1f}s)")

        async with InferenceClient(f"http://127.0.0.1:{http_port}", timeout_s=600) as client:
            print(f"\n{'streams':>8} {'tokens':>8} {'seconds':>8} {'tokens/s':>9}")
            for streams in args.concurrency:
                t = time.monotonic()
                results = await asyncio.gather(
                    *(client.generate(list(PROBE[:16]), max_tokens=args.max_tokens, seed=i, ignore_eos=True)
                      for i in range(streams))
                )  # fmt: skip
                elapsed = time.monotonic() - t
                tokens = sum(r.num_tokens for r in results)
                print(f"{streams:>8} {tokens:>8} {elapsed:>8.2f} {tokens / elapsed:>9.0f}")

        async with open_channel(target, [SPEC.control]) as channel:
            stub = SPEC.stub(channel)
            rows = []
            for version in range(1, args.updates + 2):
                folder = perturbed_copy(model, work / f"v{version}", scale=1.0 + 0.25 * version)
                if version == args.updates + 1:  # a config change: the update restarts vLLM
                    cfg = json.loads((folder / "config.json").read_text())
                    cfg["rms_norm_eps"] = 2e-6
                    (folder / "config.json").write_text(json.dumps(cfg))
                ref = publish_policy(store, version, folder, PROBE)
                t = time.monotonic()
                message = policy_pb2.PolicyPublished(
                    policy_version=version, weights=ref, format="hf-safetensors"
                )
                await bus.publish(bus.subjects.policy_published, message, msg_id=f"bench-{version}")
                await wait_version(stub, version)
                seen_s = time.monotonic() - t
                report = await bus.last(
                    "METRICS", bus.subjects.metrics("inference"), metrics_pb2.MetricsReport
                )
                assert report is not None
                assert report.step == version
                rows.append((seen_s, dict(report.values)))
        in_place = rows[:-1]
        keys = ("fetch_s", "drain_s", "reload_s", "update_s")
        print(f"\nin-place updates (median of {len(in_place)}), seconds:")
        print("  publish->served " + f"{statistics.median(r[0] for r in in_place):.3f}")
        for key in keys:
            print(f"  {key:<15} {statistics.median(r[1].get(key, np.nan) for r in in_place):.3f}")
        print("  verify          " + f"{statistics.median(r[1]['update_s'] - sum(r[1].get(k, 0) for k in keys[:3]) for r in in_place):.3f}"
              "  (the rest of update_s: probes and labelling)")  # fmt: skip
        seen, values = rows[-1]
        print(
            f"\nupdate by restart (config.json changed): publish->served {seen:.1f}s, "
            f"restart {values.get('restart_s', float('nan')):.1f}s, update {values['update_s']:.1f}s"
        )
    finally:
        await bus.close()
        proc.stop(30)
        nats.stop()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="treadle-inference-bench-"))
    try:
        asyncio.run(bench(args, work))
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
