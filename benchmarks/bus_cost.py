"""What the bus and tracing cost a reverse-text RL step.

    .venv/bin/python benchmarks/bus_cost.py [--steps 12] [--repeats 1] [--json out.json]

Runs `treadle rl` on the reverse-text example's shape (examples/reverse-text/rl.toml:
16 groups x 8 rollouts per step, 24 sampled tokens, seq_len 1024) from the model
`examples/reverse-text/prepare.py` builds (made here when missing; RL from it without SFT
has the same step shape), with tracing on and off, ``--repeats`` times each, alternating:

- tracing on: every service exports traces and metrics over OTLP to a receiver in this
  process (``testkit.otlp``), vLLM's request spans included; metrics every second, for
  the bus counters below (``--modes traced``: at the default 10 s, as a user would run);
- tracing off: no ``telemetry.otlp_endpoint`` (no spans recorded, no traceparent sent).

Bus cost, from the tracing-on runs: every process's ``treadle.bus.time`` and
``treadle.bus.operations`` counters (``treadle.services.bus_time``: protobuf encode and
decode, JetStream publishes until acked, fetches that returned messages, acks, direct
reads, claim checks and the batch payload's store put/get) between the first and the
last trainer step, divided by the steps in between, beside the step time (the trainer's
steps/min over the same steps). The share is the sum over all services, although they
run in parallel and little of it is on the step's critical path: an upper bound. A
fetch counts from its call, so it includes waiting for the first message: the table
gives the share with and without fetches.

Tracing on vs off: steps/min between the first and last trainer step of each run. On a
shared machine the load of other work moves steps/min more than tracing does, so the
spans' own cost is also measured apart from it: spans per step (tracing-on runs) times
the CPU time to record and export one span over OTLP (``span_cpu_s``: a loop in this
process, the receiver's decoding included, so an upper bound).

Timings on a shared 2-core machine are noisy; the startup (vLLM) is outside both
measurements. Goals: bus < 2 % of step time; tracing < 3 % steps/min.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from testkit.otlp import Receiver  # noqa: E402

EXAMPLE = ROOT / "examples" / "reverse-text"
PREPARED = ROOT / "outputs" / "reverse-text"
Sums = dict[tuple[str, str, str, tuple[tuple[str, str], ...]], float]


def prepare() -> Path:
    model = PREPARED / "model"
    if not (model / "config.json").is_file() or not (PREPARED / "data" / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(EXAMPLE / "prepare.py")], cwd=ROOT, check=True)
    return model


def trainer_rows(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.is_file():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("service") == "trainer" and row.get("step", 0) > 0:
                rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def service_of(cmdline: str) -> str:
    """The service a launcher child runs: `python -m treadle.<service> ...` or nats-server."""
    argv = cmdline.split()
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return module.removeprefix("treadle.").split(".")[0]
    return "nats" if argv and "nats-server" in argv[0] else "other"


def cpu_by_process(root_pid: int) -> dict[tuple[int, str], float]:
    """{(pid, service): CPU seconds (user + system) used so far} for every process under
    root_pid (a service's own children, e.g. vLLM's engine core, count for it; the launcher
    itself is 'launcher'); from /proc, Linux only."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parent[int(d.name)] = int(fields[1])
        ticks[int(d.name)] = int(fields[11]) + int(fields[12])
    out: dict[tuple[int, str], float] = {}
    for pid, t in ticks.items():
        chain = [pid]
        while chain[-1] not in (root_pid, 0, 1) and chain[-1] in parent:
            chain.append(parent[chain[-1]])
        if chain[-1] != root_pid:
            continue
        top = chain[-2] if len(chain) > 1 else root_pid  # the launcher's direct child
        name = "launcher" if top == root_pid else service_of(cmd.get(top, ""))
        out[(pid, name)] = t * TICK_S
    return out


def cpu_delta(
    first: dict[tuple[int, str], float], last: dict[tuple[int, str], float]
) -> dict[str, float]:
    """CPU seconds per service between two samples, process by process (a process that
    started in between counts from 0; one that ended in between is lost)."""
    out: dict[str, float] = {}
    for (pid, name), t in last.items():
        out[name] = out.get(name, 0.0) + t - first.get((pid, name), 0.0)
    return out


def run(name: str, steps: int, model: Path, receiver: Receiver | None,
        extra: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """One `treadle rl`; with a receiver, its bus counters at the first and last step."""
    out = ROOT / "outputs" / name
    shutil.rmtree(out, ignore_errors=True)
    argv = [
        str(Path(sys.executable).parent / "treadle"), "rl", "@", str(EXAMPLE / "rl.toml"),
        "--run.name", name,
        "--orchestrator.max_steps", str(steps), "--trainer.max_steps", str(steps),
        "--trainer.checkpoint_every", "0", "--launcher.health_timeout_s", "900",
        "--inference.model", str(model), "--trainer.model", str(model),
        "--env_runner.tokenizer", str(model),
        "--orchestrator.tasks", str(PREPARED / "data" / "train.jsonl"),
    ]  # fmt: skip
    argv += list(extra)
    if receiver is not None:
        argv += ["--telemetry.otlp_endpoint", receiver.endpoint]
        with receiver._lock:
            receiver.sums.clear()
            receiver.spans.clear()
    print(f"$ {' '.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, cwd=ROOT, env=os.environ.copy())
    first: Sums | None = None
    cpu_first: dict[tuple[int, str], float] | None = None
    cpu_last: dict[tuple[int, str], float] = {}
    seen_steps = 0
    while proc.poll() is None:
        rows = trainer_rows(out / "metrics.jsonl")
        if rows and cpu_first is None:
            cpu_first, own_first = cpu_by_process(proc.pid), time.process_time()
            seen_steps = len(rows)
        if rows and len(rows) > seen_steps:  # CPU at the last step seen so far
            cpu_last, own_last, seen_steps = (
                cpu_by_process(proc.pid),
                time.process_time(),
                len(rows),
            )
        if receiver is not None and first is None and rows and FAST_METRICS[0] in argv:
            time.sleep(1.2)  # the next export (every 1 s) carries the counters at step 1
            with receiver._lock:
                first = dict(receiver.sums)
        time.sleep(0.2)
    if proc.returncode != 0:
        sys.exit(f"{name} failed with exit code {proc.returncode}")
    rows = trainer_rows(out / "metrics.jsonl")
    minutes = (rows[-1]["time"] - rows[0]["time"]) / 60
    result: dict[str, Any] = {
        "steps_per_min": (len(rows) - 1) / minutes,
        "step_s": 60 * minutes / (len(rows) - 1),
        "steps": len(rows) - 1,
    }
    if cpu_first is not None and cpu_last:
        # sampled when each step's row appeared, so over nearly the same steps
        n = max(1, seen_steps - 1)
        cpu = {k: v / n for k, v in cpu_delta(cpu_first, cpu_last).items()}
        cpu["benchmark (receiver)"] = (own_last - own_first) / n
        result["cpu_s_per_step"] = cpu
    if receiver is not None:
        time.sleep(1.0)
        with receiver._lock:
            last = dict(receiver.sums)
            result["num_spans"] = len(receiver.spans)
        result["bus"] = bus_per_step(first or {}, last, len(rows) - 1)
    return result


def span_cpu_s(receiver: Receiver, n: int = 5000) -> float:
    """CPU seconds to start, end, batch and export one span with a few attributes."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True), max_queue_size=n + 1
        )
    )
    tracer = provider.get_tracer("bench")
    started = time.process_time()
    for i in range(n):
        with tracer.start_as_current_span("span", attributes={"treadle.rollout_id": f"r{i}",
                                                              "treadle.step": i}):  # fmt: skip
            pass
    provider.shutdown()  # exports what is left: encoding and sending count
    return (time.process_time() - started) / n


def bus_per_step(first: Sums, last: Sums, steps: int) -> dict[str, dict[str, float]]:
    """{service: {op: seconds per step}} and {service: {op: operations per step}}, summed
    over a service's processes."""
    out: dict[str, dict[str, float]] = {}
    for (svc, _inst, metric, attrs), value in last.items():
        if metric not in ("treadle.bus.time", "treadle.bus.operations"):
            continue
        op = dict(attrs)["treadle.bus.op"]
        delta = value - first.get((svc, _inst, metric, attrs), 0.0)
        key = f"{svc.removeprefix('treadle-')}:{'s' if metric == 'treadle.bus.time' else 'n'}"
        out.setdefault(key, {})
        out[key][op] = out[key].get(op, 0.0) + delta / steps
    return out


def report(results: dict[str, list[dict[str, Any]]], span_s: float) -> None:
    def spm(rs: list[dict[str, Any]]) -> float:
        return sum(r["steps_per_min"] for r in rs) / len(rs)

    print("\nsteps/min per run:", "; ".join(
        f"{m} {[round(r['steps_per_min'], 2) for r in rs]}" for m, rs in results.items()
    ))  # fmt: skip
    if off := results.get("off"):
        for m, rs in results.items():
            if m == "off":
                continue
            # run i of a mode beside run i of off: the same repeat, next to it in time
            pairs = [
                100 * (a["steps_per_min"] / b["steps_per_min"] - 1)
                for a, b in zip(rs, off, strict=True)
            ]
            print(f"tracing {m} vs off: {spm(rs):.2f} vs {spm(off):.2f} steps/min "
                  f"({m}/off - 1: {100 * (spm(rs) / spm(off) - 1):+.1f} %; per repeat "
                  f"{', '.join(f'{x:+.1f}' for x in pairs)} %)")  # fmt: skip
    traced = [r for rs in results.values() for r in rs if "num_spans" in r]
    traced_step_s = sum(r["step_s"] for r in traced) / len(traced)
    spans = sum(r["num_spans"] / r["steps"] for r in traced) / len(traced)
    print(f"spans per step {spans:.0f} (startup included), {1e6 * span_s:.0f} us CPU each: "
          f"{1000 * spans * span_s:.0f} ms CPU per step, "
          f"{100 * spans * span_s / traced_step_s:.2f} % of one core over the step")  # fmt: skip
    if "on" not in results:
        return
    on = results["on"]
    step_s = sum(r["step_s"] for r in on) / len(on)
    seconds: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, float]] = {}
    for r in on:
        for key, ops in r["bus"].items():
            svc, kind = key.rsplit(":", 1)
            into = seconds if kind == "s" else counts
            for op, v in ops.items():
                into.setdefault(svc, {})[op] = into.setdefault(svc, {}).get(op, 0.0) + v / len(on)
    ops = sorted({op for per in seconds.values() for op in per})
    print(f"\nbus work per step (ms; operations in brackets), step {step_s:.2f} s:")
    print(f"{'service':14s}" + "".join(f"{op:>18s}" for op in ops) + f"{'total':>10s}")
    total = total_no_fetch = 0.0
    for svc in sorted(seconds):
        cells = "".join(
            f"{1000 * seconds[svc].get(op, 0):10.1f} [{counts.get(svc, {}).get(op, 0):5.0f}]"
            for op in ops
        )
        svc_total = sum(seconds[svc].values())
        total += svc_total
        total_no_fetch += svc_total - seconds[svc].get("fetch", 0.0)
        print(f"{svc:14s}{cells}{1000 * svc_total:10.1f}")
    print(f"bus share of the step: {100 * total / step_s:.2f} % (all services summed), "
          f"{100 * total_no_fetch / step_s:.2f} % without fetches (which include waiting)")  # fmt: skip
    trainer = seconds.get("trainer", {})
    own = sum(trainer.values()) - trainer.get("fetch", 0.0)
    print(f"the trainer's own bus work (it sets the pace while it is busy): {1000 * own:.1f} ms "
          f"per step, {100 * own / step_s:.2f} %")  # fmt: skip
    codec = sum(per.get(op, 0.0) for per in seconds.values() for op in ("encode", "decode"))
    claims = sum(per.get("claim_check", 0.0) for per in seconds.values())
    print(f"protobuf encode + decode, all services: {1000 * codec:.1f} ms per step "
          f"({100 * codec / step_s:.2f} %); claim checks {1000 * claims:.1f} ms "
          f"({100 * claims / step_s:.2f} %)")  # fmt: skip


FAST_METRICS = ("--telemetry.metrics_interval_s", "1")  # the bus counters at step 1 and the end
MODES: dict[str, tuple[bool, tuple[str, ...]]] = {
    # name: (export to the receiver, extra flags)
    "on": (True, FAST_METRICS),
    "off": (False, ()),
    # tracing on as a user turns it on: metrics exported every 10 s (the default), not 1 s
    "traced": (True, ()),
    # tracing on without vLLM's own request spans
    "no-engine": (True, ("--telemetry.engine_traces", "false", *FAST_METRICS)),
    # metrics exported, no trace sampled (the spans' cost apart from the metrics')
    "unsampled": (True, ("--telemetry.sample_ratio", "0", *FAST_METRICS)),
}


def report_cpu(results: dict[str, list[dict[str, Any]]]) -> None:
    """CPU seconds per step by service and mode, means over repeats."""
    modes = [m for m in results if results[m] and "cpu_s_per_step" in results[m][0]]
    names = sorted({k for m in modes for r in results[m] for k in r["cpu_s_per_step"]})
    print("\nCPU seconds per trainer step, by service (mean over repeats):")
    print(f"{'service':22s}" + "".join(f"{m:>11s}" for m in modes))
    for k in [*names, "total"]:
        cells = []
        for m in modes:
            rs = results[m]
            if k == "total":
                v = sum(sum(r["cpu_s_per_step"].values()) for r in rs) / len(rs)
            else:
                v = sum(r["cpu_s_per_step"].get(k, 0.0) for r in rs) / len(rs)
            cells.append(f"{v:11.2f}")
        print(f"{k:22s}" + "".join(cells))
    print(f"{'steps/min':22s}" + "".join(
        f"{sum(r['steps_per_min'] for r in results[m]) / len(results[m]):11.2f}" for m in modes
    ))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", default="on,off",
                   help=f"comma-separated, run in turn (order reversed on odd repeats): "
                        f"{', '.join(MODES)}; the bus table needs 'on'")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    if not any(MODES[m][0] for m in modes):
        p.error("--modes needs a mode that exports (the span counts come from it)")
    model = prepare()
    receiver = Receiver().start()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for i in range(args.repeats):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                export, extra = MODES[mode]
                r = run(f"bus-cost-{mode}{i}", args.steps, model,
                        receiver if export else None, extra)  # fmt: skip
                results[mode].append(r)
                print(f"{mode}: {r['steps_per_min']:.2f} steps/min", flush=True)
        span_s = span_cpu_s(receiver)
    finally:
        receiver.stop()
    report(results, span_s)
    report_cpu(results)
    if args.json:
        args.json.write_text(json.dumps({**results, "span_cpu_s": span_s}, indent=1))


if __name__ == "__main__":
    main()
