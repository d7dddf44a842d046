"""Three tenants' RL runs on one hosted deployment, end to end: one nats-server with each
run's own users, one vLLM serving each run's LoRA adapter by its key, one trainer training
every adapter on one base, and per run its own orchestrator and env runner on its own
environment: reverse_text, countdown, and one the tenant wrote (`treadle env init`) and
pushed (`treadle env push`), which its env runner installs by its pin. Every run trains to
its last step; inference serves each run's last adapter; each run's usage ledger matches
its own records; one run's key does not reach another's adapter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.chaos import build_model
from testkit.hosted import nats_cfg
from testkit.platform import Deployment, RunPlan
from treadle.services import usage
from treadle.services.bus import Bus
from treadle.services.objectstore import LocalObjectStore

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

PLANS = [
    RunPlan("alpha", "reverse_text", seed=1, steps=2),
    RunPlan("beta", "countdown", seed=2, steps=2),
    RunPlan("gamma", "laptop_env", seed=3, steps=2),  # its package: made in the fixture
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from treadle.env_runner.scaffold import init

    root = tmp_path_factory.mktemp("platform")
    PLANS[2].package = init("laptop_env", root / "laptop")
    dep = Deployment(root, build_model(root / "model"), PLANS).start()
    try:
        yield dep
    finally:
        dep.stop()


def test_platform_trains_two_tenants_runs_on_one_deployment(deployment: Deployment) -> None:
    took = deployment.wait_trained()
    assert set(took) == {"alpha", "beta", "gamma"}
    for plan in PLANS:
        version, adapter = asyncio.run(deployment.served(plan.name))
        assert (version, adapter) == (plan.steps, f"{plan.name}-v{plan.steps}")
        assert asyncio.run(deployment.announced(plan.name)) == plan.steps
        # the adapters of each run live in its own store prefix only
        store = LocalObjectStore(deployment.store_root(plan.name))
        assert store.read_manifest(f"policies/v{plan.steps:06d}").metadata["format"] == "peft-lora"
    # the pushed environment ran from its pinned install, in gamma's runner only
    log = deployment.log("gamma-env_runner").read_text()
    assert "pushed environment laptop_env installed in" in log
    assert "environment laptop_env: harness" in log


def test_platform_bills_each_run_its_own_work(deployment: Deployment) -> None:
    assert deployment.server is not None

    async def ledger(run: str) -> tuple[usage.Usage, usage.UsageCheck]:
        store = LocalObjectStore(deployment.store_root(run))
        cfg = nats_cfg(deployment.server, deployment.creds[run], "admin")  # type: ignore[arg-type]
        bus = await Bus.connect(cfg, run, store=store, role="admin")
        try:
            got = await usage.read_usage(bus)
            return got, await usage.check_usage(bus, store, got)
        finally:
            await bus.close()

    for plan in PLANS:
        got, check = asyncio.run(ledger(plan.name))
        assert check.problems == [], (plan.name, check.problems)
        assert got.steps == plan.steps
        assert check.steps_checked == plan.steps
        assert check.rollouts_checked >= plan.steps * 2 * 4  # groups_per_step x group_size
        assert got.total("sampled_tokens") > 0
        assert got.total("prompt_tokens") > 0
        assert {r.tenant for r in got.units.values()} == {plan.name}
        assert all(u.startswith(("rollout/", "step/")) for u in got.units)


def test_platform_keeps_each_runs_data_apart(deployment: Deployment) -> None:
    """alpha's store holds nothing of beta's run, and its key does not reach beta's adapter."""
    import httpx

    alpha_store = deployment.store_root("alpha")
    assert not any("beta" in str(p.relative_to(alpha_store)) for p in alpha_store.rglob("*"))
    key = Path(str(deployment.creds["alpha"].inference_key)).read_text().strip()
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}, "model": "beta"}
    got = httpx.post(f"http://127.0.0.1:{deployment.http_port}/inference/v1/generate", json=body,
                     headers={"authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
    assert got.status_code == 403
