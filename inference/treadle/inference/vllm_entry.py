"""vLLM's OpenAI API server, started the way the inference service wants it on CPU.

    python -m treadle.inference.vllm_entry <vllm serve flags>

The same server as ``python -m vllm.entrypoints.openai.api_server`` (same flags, same
routes). One difference, with ``TREADLE_VLLM_ENGINE_FORK=1`` (``plan_launch`` sets it on
CPU unless ``inference.cpu_engine_fork = false``): vLLM 0.32's CPU platform makes its
engine process start by ``spawn``, and a spawned process imports vLLM, torch and
transformers again before it loads the model -- about 11 s of a 27 s start on one core of
a 2-core machine (`treadle rl` waits for it). Here the engine process is forked from the
API server, which has imported all of that already.

vLLM forks its engine process at the same point on GPU by default (where CUDA is not
initialized yet); the engine process sets up its own OpenMP threads. Checked here with
one and two OpenMP threads; every test that runs real vLLM (tokens, logprobs against
the reference model, LoRA, in-place updates, restarts) runs on this entry point.

Always: the garbage collector is off while vLLM is imported, and what the imports built
is frozen (``gc.freeze``) before the server starts.
"""

from __future__ import annotations

import atexit
import gc
import os

FORK_ENV = "TREADLE_VLLM_ENGINE_FORK"


def _fork_the_engine_process() -> None:
    """After the CPU platform has set spawn (in its config check), set fork again."""
    from vllm.platforms import cpu

    check = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_then_fork(cls: type, vllm_config: object) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu.CpuPlatform.check_and_update_config = classmethod(check_then_fork)  # type: ignore[method-assign,assignment]


def main() -> None:
    # Importing vLLM builds millions of objects and no garbage: with the collector off the
    # imports run faster, and frozen they are never scanned again, neither here nor in the
    # forked engine process (4.6 s less to health on one core, README "Startup").
    gc.disable()
    try:
        if os.environ.get(FORK_ENV) == "1":
            _fork_the_engine_process()
        from vllm.entrypoints.launchers.api_server.entry import main as serve
    finally:
        gc.freeze()
        gc.enable()
    # thawed at exit, so that the interpreter's last collection frees them as before
    # (frozen, triton's bindings report every one of their objects as leaked on exit)
    atexit.register(gc.unfreeze)
    serve()


if __name__ == "__main__":
    main()
