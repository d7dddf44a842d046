"""support_chat: a shop-support conversation with a simulated customer.

The agent is the support assistant of a small online shop. Each task is one customer —
a persona and a scenario — with a hidden goal: to learn the status of an order, or to
have an order delivered to a new address. The agent has two tools over the rollout's
own copy of the order table, ``lookup_order(order_id)`` and
``update_address(order_id, address)``, and must ask the customer for what it does not
know (the customer opens without the order number).

Task (``ENVIRONMENT.task_set()`` holds 8):

    {"id": "status-lamp", "persona": "...", "scenario": "...",
     "goal": {"kind": "order_status", "order_id": "A123"},   # or "change_address" + "address"
     "opening": "...",   # optional: the customer's first line
     "patience": 6,      # optional: customer replies before giving up
     "orders": {...}}    # optional: the order table (default ORDERS)

The customer. By default ``scripted_user``, a deterministic policy: it opens with its
need, answers a question for the order number or the new address with the task's facts,
restates its need (with the facts) otherwise, and says ``[DONE]`` once the agent's reply
visibly meets the goal (names the order's true status / the new address or confirms a
change) or after ``patience`` replies. A model can play the customer instead, from the
persona and the scenario (which holds the facts), at any OpenAI-compatible endpoint:

    # my_envs.py, then [env_runner] environments = {support_chat_llm = "my_envs:SUPPORT_CHAT"}
    SUPPORT_CHAT = make_environment(user_base_url="http://127.0.0.1:8001/v1", user_model="Qwen/Qwen3-8B")

Reward ``goal_met`` (0/1): for a status goal, the agent looked the order up and told the
customer its status; for an address goal, the rollout's order table holds the new
address for that order and no other order's address changed. Metrics: ``num_turns``
(agent model calls), ``tool_calls``, ``malformed_tool_calls``; non-ok tool results are
counted as ``tool_<status>`` (e.g. ``tool_unknown_tool``), as the ToolUse harness does.

Not here: judging tone or politeness (add a JudgeReward), customers with several goals.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from treadle.env_runner.environments import Environment
from treadle.env_runner.harnesses.chat import UserSimulator
from treadle.env_runner.rubric import RolloutState, Rubric
from treadle.env_runner.tasksets import TaskSet
from treadle.services.errors import ConfigError

DONE = "[DONE]"
KINDS = ("order_status", "change_address")
STATUSES = ("processing", "shipped", "delivered", "cancelled")
"""Only a ``processing`` order's address may change."""

ORDERS: dict[str, dict[str, str]] = {
    "A123": {
        "item": "desk lamp",
        "status": "shipped",
        "address": "4 Mill Lane, Leeds",
        "eta": "12 June",
    },
    "B456": {
        "item": "wool blanket",
        "status": "processing",
        "address": "17 Harbour Road, Cork",
        "eta": "20 June",
    },
    "C789": {
        "item": "coffee grinder",
        "status": "delivered",
        "address": "9 Rue Haute, Lyon",
        "eta": "3 June",
    },
    "D012": {
        "item": "running shoes",
        "status": "processing",
        "address": "88 Kings Road, Bristol",
        "eta": "18 June",
    },
    "E345": {
        "item": "board game",
        "status": "cancelled",
        "address": "2 Birch Close, York",
        "eta": "-",
    },
    "F678": {
        "item": "bike light",
        "status": "processing",
        "address": "40 Oudegracht, Utrecht",
        "eta": "21 June",
    },
    "G901": {
        "item": "rain jacket",
        "status": "shipped",
        "address": "6 Castle Street, Cardiff",
        "eta": "14 June",
    },
    "H234": {
        "item": "teapot",
        "status": "processing",
        "address": "12 Elm Row, Edinburgh",
        "eta": "19 June",
    },
}

SYSTEM = (
    "You are the customer-support assistant of Treadle Shop. Help the customer with their "
    "order using your tools: lookup_order shows an order's item, status, delivery address "
    "and expected delivery date; update_address changes where an order that has not shipped "
    "yet is delivered. Ask the customer for any detail you need, such as the order number or "
    "the new address, and tell them the result in plain words."
)


# -- the order table (one copy per rollout, in state.info) -----------------------------------


def order_key(order_id: str) -> str:
    """``"#a123 "`` -> ``"A123"``."""
    return str(order_id).strip().lstrip("#").strip().upper()


def initial_orders(task: dict[str, Any]) -> dict[str, dict[str, str]]:
    return task.get("orders") or ORDERS


def rollout_orders(state: RolloutState) -> dict[str, dict[str, str]]:
    """The rollout's own order table (the task's, copied on first use)."""
    orders = state.info.get("orders")
    if orders is None:
        orders = state.info["orders"] = copy.deepcopy(initial_orders(state.task))
    return orders


def lookup_order(order_id: str, state: RolloutState) -> str:
    """Look up an order: its item, status, delivery address and expected delivery date.

    Args:
        order_id: the order number, e.g. "A123".
    """
    key = order_key(order_id)
    order = rollout_orders(state).get(key)
    if order is None:
        raise ValueError(f"there is no order {order_id!r}")
    state.info.setdefault("looked_up", []).append(key)
    return json.dumps({"order_id": key, **order})


def update_address(order_id: str, address: str, state: RolloutState) -> str:
    """Change the delivery address of an order that has not shipped yet.

    Args:
        order_id: the order number, e.g. "A123".
        address: the complete new delivery address.
    """
    key = order_key(order_id)
    order = rollout_orders(state).get(key)
    if order is None:
        raise ValueError(f"there is no order {order_id!r}")
    if order["status"] != "processing":
        raise ValueError(f"order {key} is {order['status']}: its address can no longer change")
    if not address.strip():
        raise ValueError("the new address is empty")
    order["address"] = address.strip()
    return json.dumps({"order_id": key, "address": order["address"], "result": "updated"})


# -- checking tasks ---------------------------------------------------------------------------


def check_goal(task: dict[str, Any]) -> dict[str, Any]:
    """The task's goal, checked against its order table; ValueError says what is wrong."""
    goal = task.get("goal")
    if not isinstance(goal, dict) or goal.get("kind") not in KINDS:
        raise ValueError(
            f"support_chat task {task.get('id')!r}: goal must be an object with kind in {KINDS}"
        )
    orders = initial_orders(task)
    if order_key(goal.get("order_id", "")) not in orders:
        raise ValueError(
            f"support_chat task {task.get('id')!r}: goal order {goal.get('order_id')!r} is not in the order table"
        )
    if goal["kind"] == "change_address" and not str(goal.get("address") or "").strip():
        raise ValueError(
            f"support_chat task {task.get('id')!r}: a change_address goal needs an address"
        )
    return goal


def prompt(task: dict[str, Any]) -> list[dict[str, Any]]:
    check_goal(task)
    return [
        {"role": "system", "content": SYSTEM}
    ]  # the customer speaks first (the harness asks it)


# -- the scripted customer ---------------------------------------------------------------------

ASKS_ORDER = re.compile(r"order\s*(?:id|number|no\b|#|code)|which order|what order", re.I)
ASKS_ADDRESS = re.compile(r"address", re.I)
CONFIRMS = re.compile(r"\b(?:updated|changed)\b", re.I)


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def goal_visible(task: dict[str, Any], reply: str) -> bool:
    """Whether ``reply`` shows the customer that its goal is met (it believes what it reads)."""
    goal = check_goal(task)
    if goal["kind"] == "order_status":
        status = initial_orders(task)[order_key(goal["order_id"])]["status"]
        return re.search(rf"\b{re.escape(status)}\b", reply, re.I) is not None
    return _norm(goal["address"]) in _norm(reply) or CONFIRMS.search(reply) is not None


def opening(task: dict[str, Any]) -> str:
    if task.get("opening"):
        return str(task["opening"])
    if check_goal(task)["kind"] == "order_status":
        return "Hi, my order hasn't arrived yet. Can you tell me where it is?"
    return "Hello, I need to change the delivery address of my order."


def restate(task: dict[str, Any]) -> str:
    goal = check_goal(task)
    if goal["kind"] == "order_status":
        return f"I'd just like to know the status of my order #{goal['order_id']}."
    return f"Please change the delivery address of order #{goal['order_id']} to {goal['address']}."


def scripted_user(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """The default customer: deterministic, from the task's facts (see the module doc)."""
    goal = check_goal(task)
    said = [m for m in messages if m.get("role") == "user"]
    if not said or messages[-1].get("role") != "assistant":
        return opening(task)
    reply = str(messages[-1].get("content") or "")
    if goal_visible(task, reply):
        return f"Great, thank you! {DONE}"
    if len(said) - 1 >= int(task.get("patience", 6)):
        return f"Never mind, I'll call the shop instead. {DONE}"
    parts = []
    if ASKS_ORDER.search(reply):
        parts.append(f"It's order #{goal['order_id']}.")
    if goal["kind"] == "change_address" and ASKS_ADDRESS.search(reply):
        parts.append(f"The new address is {goal['address']}.")
    return " ".join(parts) or restate(task)


# -- rubric -------------------------------------------------------------------------------------


def goal_met(task: dict[str, Any], state: RolloutState, messages: list[dict[str, Any]]) -> float:
    goal = check_goal(task)
    key = order_key(goal["order_id"])
    initial = initial_orders(task)
    if goal["kind"] == "order_status":
        status = initial[key]["status"]
        told = any(
            m.get("role") == "assistant"
            and re.search(rf"\b{re.escape(status)}\b", str(m.get("content") or ""), re.I)
            for m in messages
        )
        return float(told and key in state.info.get("looked_up", []))
    orders = state.info.get("orders") or initial
    others_kept = all(orders[k]["address"] == initial[k]["address"] for k in initial if k != key)
    return float(_norm(orders[key]["address"]) == _norm(goal["address"]) and others_kept)


def num_turns(state: RolloutState) -> float:
    return float(state.num_turns)


def tool_calls(state: RolloutState) -> float:
    return float(state.metrics.get("tool_calls", 0.0))


def malformed_tool_calls(state: RolloutState) -> float:
    return float(state.metrics.get("malformed_tool_calls", 0.0))


# -- tasks ------------------------------------------------------------------------------------

TASKS: list[dict[str, Any]] = [
    {
        "id": "status-lamp",
        "persona": "Maya, a busy nurse who writes short messages",
        "scenario": "You ordered a desk lamp (order A123) a week ago and it has not arrived. You want to know the status of the order.",
        "goal": {"kind": "order_status", "order_id": "A123"},
    },
    {
        "id": "status-grinder",
        "persona": "Tom, a retired teacher who is polite and a little wordy",
        "scenario": "You ordered a coffee grinder (order C789) and are not sure whether it was delivered to your old flat. You want to know its status.",
        "goal": {"kind": "order_status", "order_id": "C789"},
        "opening": "Good morning! I was wondering whether my coffee grinder has been delivered yet.",
    },
    {
        "id": "status-game",
        "persona": "Lena, a student in a hurry",
        "scenario": "You ordered a board game (order E345) for a party and have heard nothing since. You want to know the status of the order.",
        "goal": {"kind": "order_status", "order_id": "E345"},
    },
    {
        "id": "status-shoes",
        "persona": "Ravi, a runner training for a marathon",
        "scenario": "You ordered running shoes (order D012) and need them soon. You want to know the status of the order.",
        "goal": {"kind": "order_status", "order_id": "D012"},
        "opening": "Hey, any news on my running shoes? Order D012.",
    },
    {
        "id": "address-blanket",
        "persona": "Aoife, who just moved house",
        "scenario": "You ordered a wool blanket (order B456). You moved last week and want it delivered to 22 Quay Street, Galway instead.",
        "goal": {"kind": "change_address", "order_id": "B456", "address": "22 Quay Street, Galway"},
    },
    {
        "id": "address-shoes",
        "persona": "Ravi, a runner training for a marathon",
        "scenario": "You ordered running shoes (order D012) to your home, but you will be at your sister's: you want them delivered to 5 Elm Road, Bath.",
        "goal": {"kind": "change_address", "order_id": "D012", "address": "5 Elm Road, Bath"},
        "opening": "Hi, can I still change where my running shoes are delivered?",
    },
    {
        "id": "address-light",
        "persona": "Joost, a cyclist who writes in brief, friendly messages",
        "scenario": "You ordered a bike light (order F678). You want it delivered to your office at 31 Canal Walk, Utrecht.",
        "goal": {"kind": "change_address", "order_id": "F678", "address": "31 Canal Walk, Utrecht"},
    },
    {
        "id": "address-teapot",
        "persona": "Margaret, who is sending a gift to her granddaughter",
        "scenario": "You ordered a teapot (order H234) as a gift and want it delivered to your granddaughter at 7 Rose Street, Glasgow.",
        "goal": {"kind": "change_address", "order_id": "H234", "address": "7 Rose Street, Glasgow"},
        "opening": "Hello dear, I'd like my teapot order to go to my granddaughter instead of me.",
    },
]

REQUIRED = ("persona", "scenario", "goal")


def task_set() -> TaskSet:
    return TaskSet.from_rows("support_chat", copy.deepcopy(TASKS), REQUIRED)


def make_environment(
    *,
    user_base_url: str | None = None,
    user_model: str = "",
    user_api_key: str | None = None,
    user_temperature: float = 0.7,
    max_turns: int = 10,
) -> Environment:
    """The support_chat environment; with ``user_base_url`` (an OpenAI-compatible
    endpoint, e.g. ``http://127.0.0.1:8001/v1``) the model ``user_model`` plays the
    customer instead of ``scripted_user``."""
    user: Any = scripted_user
    if user_base_url:
        if not user_model:
            raise ConfigError("support_chat: user_model must name the model behind user_base_url")
        from treadle.env_runner.session import OpenAIChat

        user = OpenAIChat(user_base_url, user_model, api_key=user_api_key)
    elif user_model:
        raise ConfigError("support_chat: user_model needs user_base_url (the endpoint serving it)")
    return Environment(
        "support_chat",
        prompt=prompt,
        rubric=Rubric(rewards=[goal_met], metrics=[num_turns, tool_calls, malformed_tool_calls]),
        harness=UserSimulator(
            user, done_marker=DONE, max_turns=max_turns, user_temperature=user_temperature
        ),
        tools=[lookup_order, update_address],
        tasks=task_set,
        required=REQUIRED,
        description="shop support with a simulated customer: look up an order's status or change its delivery address",
    )


ENVIRONMENT = make_environment()
