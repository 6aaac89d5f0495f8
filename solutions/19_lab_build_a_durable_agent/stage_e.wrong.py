# ✏️ EXERCISE stage_e: a replay-safe payment: the runtime's key, stored with the effect
import uuid
from typing import Annotated

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import InjectedToolCallId, tool


async def load_tools(world):
    """The lab's tools, the ledger's two payment tools replaced by a `record_payment(to, amount)`
    of yours that calls `record_payment_once(to, amount, idempotency_key)` with the key
    "<thread_id>:<tool_call_id>"."""
    tools = await MultiServerMCPClient(world.mcp_connections()).get_tools()
    pay_once = next(t for t in tools if t.name == "record_payment_once")

    @tool
    async def record_payment(to: str, amount: int, config: RunnableConfig,
                             call_id: Annotated[str, InjectedToolCallId]) -> str:
        """Record a payment of `amount` coins to account `to`."""
        key = str(uuid.uuid4())  # wrong: a replay of the same call gets a new key
        return await pay_once.ainvoke({"to": to, "amount": amount, "idempotency_key": key})

    return [t for t in tools if not t.name.startswith("record_payment")] + [record_payment]
