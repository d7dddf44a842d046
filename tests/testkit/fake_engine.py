"""A FAKE container engine for tests: no Docker daemon or Podman runs on the development
machines or in CI. ``FakeEngine(root).path`` is an executable that records its argv (one
JSON list per line) and emulates just enough of ``docker``: ``run`` starts the command as
a local process with exactly the ``--env`` variables, in the work dir's bind source (paths
under the mount target in its argv that exist only there are mapped to that source; in its
env they are not), detached from the
client the way a real container is (killing the client does not kill it); ``kill``,
``inspect``, ``rm``. It isolates nothing: tests driving it check the runtime's behaviour
and command lines, never containment (their names say "fake engine")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# A fake `docker`: records argv (one JSON list per line), emulates run / kill / inspect / rm.
FAKE_ENGINE = r"""#!{python}
import json, os, signal, subprocess, sys
LOG, STATE = {log!r}, {state!r}
args = sys.argv[1:]
with open(LOG, "a") as f:
    f.write(json.dumps(args) + "\n")
VALUED = {{"--name", "--label", "--pull", "--log-driver", "--network", "--tmpfs", "--mount",
          "--workdir", "--user", "--cap-drop", "--security-opt", "--memory", "--memory-swap",
          "--pids-limit", "--cpus", "--ulimit", "--env"}}
FLAGS = {{"--rm", "--quiet", "--interactive", "--read-only", "--init"}}

def fail(msg, code):
    sys.stderr.write(msg + "\n")
    sys.exit(code)

if args[0] == "run":
    opts, i = {{}}, 1
    while args[i] != "--":
        if args[i] in FLAGS:
            opts.setdefault(args[i], []).append(True)
            i += 1
        elif args[i] in VALUED:
            opts.setdefault(args[i], []).append(args[i + 1])
            i += 2
        else:
            fail("unknown flag: " + args[i], 125)
    image, command = args[i + 1], args[i + 2:]
    if image.startswith("missing"):
        fail("docker: Error response from daemon: pull access denied for " + image, 125)
    workdir = opts["--workdir"][0]
    cwd = None
    for m in opts.get("--mount", []):
        spec = dict(kv.split("=", 1) for kv in m.split(","))
        if spec["target"] == workdir:
            cwd = spec["source"]
    env = dict(e.split("=", 1) for e in opts.get("--env", []))
    if cwd is not None:  # a path the argv names under the mount target is the source here
        # (only where the host has no such path: on some machines /work holds the host's files)
        def inside(a):
            mapped = cwd + a[len(workdir):] if a.startswith(workdir + "/") else a
            return mapped if not os.path.exists(a) and os.path.exists(mapped) else a
        command = [inside(a) for a in command]
    stdin = None if "--interactive" in opts else subprocess.DEVNULL
    # a container outlives its client: the program gets a session of its own
    child = subprocess.Popen(command, cwd=cwd, env=env, stdin=stdin, start_new_session=True)
    with open(os.path.join(STATE, opts["--name"][0] + ".pid"), "w") as f:
        f.write(str(child.pid))
    rc = child.wait()
    sys.exit(128 - rc if rc < 0 else rc)
if args[0] == "kill":
    try:
        pid = int(open(os.path.join(STATE, args[1] + ".pid")).read())
        # a container's every process dies with it: the program's session (its group)
        os.killpg(pid, signal.SIGKILL)
    except (OSError, ValueError):
        fail("Error response from daemon: No such container: " + args[1], 1)
    print(args[1])
    sys.exit(0)
if args[0] == "inspect":
    try:
        print(open(os.path.join(STATE, "oom_killed")).read())
    except OSError:
        fail("Error: No such object: " + args[-1], 1)
    sys.exit(0)
if args[0] == "rm":
    sys.exit(0)
fail("fake engine: unsupported command " + args[0], 125)
"""


class FakeEngine:
    def __init__(self, root: Path) -> None:
        self.log = root / "engine-argv.jsonl"
        self.state = root / "engine-state"
        self.state.mkdir()
        self.path = root / "bin" / "docker"
        self.path.parent.mkdir()
        text = FAKE_ENGINE.format(python=sys.executable, log=str(self.log), state=str(self.state))
        self.path.write_text(text)
        self.path.chmod(0o755)

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def run_argv(self) -> list[str]:
        (run,) = [c for c in self.calls() if c[0] == "run"]
        return run

    def container_name(self) -> str:
        run = self.run_argv()
        return run[run.index("--name") + 1]
