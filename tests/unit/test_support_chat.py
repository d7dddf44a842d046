"""support_chat: the scripted customer, the order tools, the reward, and whole
conversations driven by a scripted agent (real qwen3 token ids, real renderer)."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator, decode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.envs import support_chat
from treadle.env_runner.envs.support_chat import ENVIRONMENT, ORDERS, TASKS, goal_met, scripted_user
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.session import OpenAIChat
from treadle.proto.v1 import rollout_pb2
from treadle.services.errors import ConfigError

Status = rollout_pb2.RolloutStatus
THINK = "<think>\n\n</think>\n\n"


def say(text: str) -> str:
    return f"{THINK}{text}<|im_end|>"


def call(name: str, **arguments: Any) -> str:
    return f"{THINK}<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


class ScriptedAgent(ScriptedGenerator):
    """The agent's model (see testkit.fake_model); ``prompts`` are the calls' prompts decoded."""

    @property
    def prompts(self) -> list[str]:
        return [decode_qwen3(ids) for ids in self.calls]


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


def task(task_id: str, **changes: Any) -> dict[str, Any]:
    t = copy.deepcopy(next(t for t in TASKS if t["id"] == task_id))
    t.update(changes)
    return t


def converse(t: dict[str, Any], agent: ScriptedAgent, renderer: treadle_native.Renderer,
             env: Any = ENVIRONMENT) -> tuple[rollout_pb2.Rollout, RolloutState]:  # fmt: skip
    req = rollout_pb2.RolloutRequested(
        rollout_id=f"r-{t['id']}", group_id="g", env="support_chat", task_id=t["id"], task_json=json.dumps(t),
        sampling=rollout_pb2.SamplingParams(max_tokens=128, temperature=1.0), policy_version=1,
    )  # fmt: skip
    states: list[RolloutState] = []
    r = asyncio.run(run_rollout(req, env, RolloutContext(renderer, agent, "runner-1"), states))
    return r, states[0]


def said_by(state: RolloutState, role: str) -> list[str]:
    return [str(m.get("content") or "") for m in state.messages if m["role"] == role]


# -- the scripted customer and the tools ----------------------------------------------------------


def test_scripted_user_answers_with_the_task_facts_and_is_deterministic() -> None:
    t = task("address-blanket")
    system = [{"role": "system", "content": "..."}]
    first = scripted_user(t, system)
    assert "B456" not in first  # the agent has to ask
    assert "Galway" not in first
    history = [*system, {"role": "user", "content": first}]

    def reply_to(agent_text: str) -> str:
        return scripted_user(t, [*history, {"role": "assistant", "content": agent_text}])

    assert reply_to("Sure! What is your order number?") == "It's order #B456."
    assert reply_to("Which order, and what is the new address?") == (
        "It's order #B456. The new address is 22 Quay Street, Galway."
    )
    assert reply_to("Lovely weather today.") == (
        "Please change the delivery address of order #B456 to 22 Quay Street, Galway."
    )
    assert reply_to("Done: it now goes to 22 Quay Street, Galway.").endswith("[DONE]")
    assert reply_to("Sure! What is your order number?") == reply_to(
        "Sure! What is your order number?"
    )
    status = task("status-lamp")
    assert scripted_user(
        status,
        [
            *system,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "It is being processed."},
        ],
    ) == (
        "I'd just like to know the status of my order #A123."
    )  # fmt: skip  (A123 has shipped: "processing" is not its status)


def test_order_tools_work_on_the_rollouts_own_table() -> None:
    tools = ENVIRONMENT.toolset(task("address-blanket"))
    state = RolloutState(task=task("address-blanket"))

    async def calls() -> list[Any]:
        return [
            await tools.call(
                "update_address", {"order_id": "#b456", "address": "22 Quay Street, Galway"}, state
            ),
            await tools.call("update_address", {"order_id": "A123", "address": "1 Main St"}, state),
            await tools.call("lookup_order", {"order_id": "Z999"}, state),
            await tools.call("lookup_order", {"order_id": "B456"}, state),
        ]

    updated, shipped, missing, looked = asyncio.run(calls())
    assert updated.status == "ok"
    assert state.info["orders"]["B456"]["address"] == "22 Quay Street, Galway"
    assert ORDERS["B456"]["address"] == "17 Harbour Road, Cork"  # the shared table is untouched
    assert (shipped.status, missing.status) == ("error", "error")
    assert "A123 is shipped" in shipped.content
    assert "no order 'Z999'" in missing.content
    assert json.loads(looked.content)["address"] == "22 Quay Street, Galway"


def test_goal_met_needs_the_right_order_changed_and_no_other() -> None:
    t = task("address-blanket")
    state = RolloutState(task=t, info={"orders": copy.deepcopy(ORDERS)})
    assert goal_met(t, state, []) == 0.0
    state.info["orders"]["B456"]["address"] = "22 quay street galway"
    assert goal_met(t, state, []) == 1.0
    state.info["orders"]["D012"]["address"] = "22 Quay Street, Galway"  # also changed another order
    assert goal_met(t, state, []) == 0.0
    status = task("status-lamp")
    told = [{"role": "assistant", "content": "Your lamp has shipped."}]
    assert goal_met(status, RolloutState(task=status), told) == 0.0  # a guess: never looked it up
    assert goal_met(status, RolloutState(task=status, info={"looked_up": ["A123"]}), told) == 1.0


def test_support_chat_task_set_and_bad_tasks() -> None:
    tasks = ENVIRONMENT.task_set()
    assert len(tasks) == 8
    assert {t["goal"]["kind"] for t in tasks} == {"order_status", "change_address"}
    with pytest.raises(ValueError, match="not in the order table"):
        support_chat.prompt(task("status-lamp", goal={"kind": "order_status", "order_id": "Q1"}))
    with pytest.raises(ValueError, match="needs an address"):
        support_chat.prompt(
            task("address-light", goal={"kind": "change_address", "order_id": "F678"})
        )


def test_support_chat_can_have_a_model_play_the_customer() -> None:
    env = support_chat.make_environment(
        user_base_url="http://127.0.0.1:9/v1", user_model="judge-7b"
    )
    assert isinstance(env.harness.user, OpenAIChat)  # type: ignore[attr-defined]
    assert env.harness.user.model == "judge-7b"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="user_model"):
        support_chat.make_environment(user_base_url="http://127.0.0.1:9/v1")


# -- whole conversations --------------------------------------------------------------------------


def test_support_chat_status_conversation_succeeds(renderer: treadle_native.Renderer) -> None:
    agent = ScriptedAgent([
        say("I can help with that. What is your order number?"),
        call("lookup_order", order_id="A123"),
        say("Your desk lamp (order A123) has shipped and should arrive on 12 June."),
    ])  # fmt: skip
    r, state = converse(task("status-lamp"), agent, renderer)
    assert r.status.kind == Status.Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert [(x.name, x.value) for x in r.rewards] == [("goal_met", 1.0)]
    assert r.metrics["num_turns"] == 3
    assert r.metrics["tool_calls"] == 1
    assert r.metrics["malformed_tool_calls"] == 0
    assert said_by(state, "user") == [
        "Hi, my order hasn't arrived yet. Can you tell me where it is?",
        "It's order #A123.",
        "Great, thank you!",
    ]
    assert state.info["user_done"] is True
    assert "It's order #A123." in agent.prompts[1]  # the customer's answer reached the agent
    assert '"status": "shipped"' in agent.prompts[2]  # and so did the tool result


def test_support_chat_address_conversation_changes_the_order(
    renderer: treadle_native.Renderer,
) -> None:
    agent = ScriptedAgent([
        say("Of course. Which order is it, and what is the new address?"),
        call("update_address", order_id="B456", address="22 Quay Street, Galway"),
        say("Done: order B456 will now be delivered to 22 Quay Street, Galway."),
    ])  # fmt: skip
    r, state = converse(task("address-blanket"), agent, renderer)
    assert r.status.kind == Status.Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert state.info["orders"]["B456"]["address"] == "22 Quay Street, Galway"
    assert (
        said_by(state, "user")[1] == "It's order #B456. The new address is 22 Quay Street, Galway."
    )


def test_support_chat_agent_that_never_helps_runs_out_of_turns(
    renderer: treadle_native.Renderer,
) -> None:
    agent = ScriptedAgent([say("I'm sorry, I cannot help with that.")])
    r, _ = converse(task("status-lamp", patience=100), agent, renderer)
    assert r.status.kind == Status.Kind.KIND_TRUNCATED
    assert r.status.truncation == Status.Truncation.TRUNCATION_MAX_TURNS
    assert r.reward == 0.0
    assert len(agent.prompts) == ENVIRONMENT.harness.max_turns == r.metrics["num_turns"]  # type: ignore[attr-defined]
    assert r.metrics["tool_calls"] == 0


def test_support_chat_customer_gives_up_after_its_patience(
    renderer: treadle_native.Renderer,
) -> None:
    agent = ScriptedAgent([say("Have you tried turning it off and on again?")])
    r, state = converse(task("address-light", patience=2), agent, renderer)
    assert r.status.kind == Status.Kind.KIND_OK
    assert r.reward == 0.0
    assert r.metrics["num_turns"] == 3
    assert said_by(state, "user")[-1] == "Never mind, I'll call the shop instead."


def test_support_chat_malformed_tool_call_is_counted_and_the_rollout_goes_on(
    renderer: treadle_native.Renderer,
) -> None:
    broken = f'{THINK}<tool_call>\n{{"name": "lookup_order", "arguments": {{"order_id": "A123"}}\n</tool_call><|im_end|>'
    agent = ScriptedAgent([
        broken,
        call("lookup_order", order_id="A123"),
        say("Order A123 (your desk lamp) has shipped."),
    ])  # fmt: skip
    r, state = converse(
        task("status-shoes", goal={"kind": "order_status", "order_id": "A123"}), agent, renderer
    )
    assert r.status.kind == Status.Kind.KIND_OK, r.status.message
    assert r.metrics["malformed_tool_calls"] == 1
    assert r.metrics["tool_calls"] == 2
    first_tool_reply = said_by(state, "tool")[0]
    assert first_tool_reply.startswith("error")
    assert first_tool_reply in agent.prompts[1]  # the model was told and went on
    assert r.reward == 1.0
    statuses = [c.status for n in r.nodes for c in n.tool_calls]
    assert rollout_pb2.ToolCall.Status.STATUS_MALFORMED in statuses


def test_support_chat_unknown_tool_is_an_error_message_and_a_metric(
    renderer: treadle_native.Renderer,
) -> None:
    agent = ScriptedAgent([
        call("cancel_order", order_id="A123"),
        say("Sorry, I can only look orders up: A123 has shipped."),
    ])  # fmt: skip
    r, state = converse(task("status-lamp"), agent, renderer)
    assert r.status.kind == Status.Kind.KIND_OK, r.status.message
    assert r.metrics["tool_unknown_tool"] == 1
    [reply] = said_by(state, "tool")
    assert "unknown tool 'cancel_order'" in reply
    assert "lookup_order, update_address" in reply
    assert r.reward == 0.0  # said "shipped" without looking the order up


def test_every_builtin_task_is_solvable(renderer: treadle_native.Renderer) -> None:
    """An agent that knows the answer (one tool call, one reply) earns 1 on each task."""
    for t in ENVIRONMENT.task_set():
        goal = t["goal"]
        if goal["kind"] == "order_status":
            status = ORDERS[goal["order_id"]]["status"]
            script = [
                call("lookup_order", order_id=goal["order_id"]),
                say(f"Order {goal['order_id']} is {status}."),
            ]
        else:
            script = [
                call("update_address", order_id=goal["order_id"], address=goal["address"]),
                say(f"Done, it will go to {goal['address']}."),
            ]
        r, state = converse(t, ScriptedAgent(script), renderer)
        assert (r.status.kind, r.reward) == (Status.Kind.KIND_OK, 1.0), (t["id"], r.status.message)
        assert state.info["user_done"] is True
