"""What the env runner jail's network costs: a connection through the platform's relay
(``treadle.services.jailnet``) against the same connection made directly, side by side in
one run.

A jailed env runner (``platform.env_runner_network = "bus"``) reaches the bus and
inference only through two relays: its launcher inside the jail (its own loopback to a
unix socket) and the platform's relay outside (that socket to the real address). This
measures, for one echo server on the host's loopback and one client program run either
plainly or inside the jail (``jail_argv(network=False)`` with the launcher):

    connect      a new TCP connection and a first 1-byte round trip (ms; an HTTP client
                 without keep-alive pays it per request)
    round trip   a 512-byte request and its 512-byte answer on an open connection (ms;
                 one NATS publish acknowledged, one small model call's framing)
    throughput   64 MiB sent and echoed back (MiB/s; a model's weights never take this
                 way, a rollout's tokens are kilobytes)

medians and 90th percentiles over ``--rounds`` samples, the two paths alternating round
by round so that drift in the machine's speed hits both alike. The numbers say how much
a relayed call adds; a reverse-text step (128 rollouts, each one model call and one
publish) makes a few hundred such round trips.

    .venv/bin/python benchmarks/jail_network.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ECHO = """
import asyncio, sys
async def echo(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()
async def main():
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(1e9)
asyncio.run(main())
"""

CLIENT = """
import json, socket, sys, time
port, connects, trips, mib = map(int, sys.argv[1:5])
def exact(s, n):
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        if not chunk:
            raise OSError("closed")
        got += chunk
    return got
out = {"connect_ms": [], "round_trip_ms": []}
for _ in range(connects):
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"x")
        exact(s, 1)
    out["connect_ms"].append(1e3 * (time.perf_counter() - t))
with socket.create_connection(("127.0.0.1", port)) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = b"r" * 512
    for _ in range(trips):
        t = time.perf_counter()
        s.sendall(body)
        exact(s, len(body))
        out["round_trip_ms"].append(1e3 * (time.perf_counter() - t))
with socket.create_connection(("127.0.0.1", port)) as s:
    block = b"b" * (1 << 20)
    import threading
    got = [0]
    def read():
        while got[0] < mib << 20:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            got[0] += len(chunk)
    reader = threading.Thread(target=read)
    t = time.perf_counter()
    reader.start()
    for _ in range(mib):
        s.sendall(block)
    reader.join()
    out["mib_per_s"] = mib / (time.perf_counter() - t)
print(json.dumps(out))
"""


async def measure(argv: list[str]) -> dict[str, object]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the client failed ({proc.returncode}): {err.decode()[-2000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per path")
    p.add_argument("--connects", type=int, default=200, help="connections per round")
    p.add_argument("--trips", type=int, default=2000, help="round trips per round")
    p.add_argument("--mib", type=int, default=64, help="MiB echoed per round")
    args = p.parse_args()

    from treadle.services.jailnet import relay_path, start_relay
    from treadle.services.platform import jail_argv

    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ECHO, stdout=asyncio.subprocess.PIPE
    )
    assert server.stdout is not None
    port = int((await server.stdout.readline()).decode())
    net = Path(tempfile.mkdtemp(prefix="jail-network-"))
    relay = await start_relay(relay_path(net, port), "127.0.0.1", port)
    client = [sys.executable, "-c", CLIENT, str(port), str(args.connects), str(args.trips),
              str(args.mib)]  # fmt: skip
    jail = [*jail_argv(hidden=[], read=[], write=[net], network=False), sys.executable, "-m",
            "treadle.services.jailnet", "--dir", str(net), "--connect", f"127.0.0.1:{port}",
            "--"]  # fmt: skip
    paths = {"direct": client, "jailed": [*jail, *client]}
    print(f"{os.cpu_count()} CPUs; {args.rounds} rounds of {args.connects} connections, "
          f"{args.trips} round trips and {args.mib} MiB per path", flush=True)  # fmt: skip
    results: dict[str, dict[str, list[float]]] = {
        k: {"connect_ms": [], "round_trip_ms": [], "mib_per_s": []} for k in paths
    }
    try:
        for i in range(args.rounds):
            order = list(paths) if i % 2 == 0 else list(reversed(paths))
            for name in order:
                r = await measure(paths[name])
                for key in ("connect_ms", "round_trip_ms"):
                    results[name][key] += r[key]  # type: ignore[arg-type]
                results[name]["mib_per_s"].append(float(r["mib_per_s"]))  # type: ignore[arg-type]
            print(f"round {i + 1}/{args.rounds} done", flush=True)
    finally:
        relay.close()
        server.kill()
        await server.wait()
    print(f"\n{'path':8s}{'connect p50':>13s}{'p90':>8s}{'round trip p50':>16s}{'p90':>8s}"
          f"{'MiB/s':>8s}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:8s}{statistics.median(r['connect_ms']):11.3f}ms"
              f"{pct(r['connect_ms'], 0.9):6.3f}ms{statistics.median(r['round_trip_ms']):14.3f}ms"
              f"{pct(r['round_trip_ms'], 0.9):6.3f}ms{statistics.median(r['mib_per_s']):8.0f}")  # fmt: skip
    d, j = results["direct"], results["jailed"]
    added = statistics.median(j["round_trip_ms"]) - statistics.median(d["round_trip_ms"])
    print(f"\nthe relay adds {added:.3f} ms per round trip (median), "
          f"{statistics.median(j['connect_ms']) - statistics.median(d['connect_ms']):.3f} ms per "
          f"new connection; throughput {statistics.median(j['mib_per_s']) / statistics.median(d['mib_per_s']):.2f}x")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
