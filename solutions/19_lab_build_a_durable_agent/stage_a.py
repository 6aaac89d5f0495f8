# ✏️ EXERCISE stage_a: the bare agent: START → agent ⇄ tools → END, with no saver
from langchain_mcp_adapters.client import MultiServerMCPClient
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

THREADS = {}  # conversation → its messages, in this process's memory only


async def load_tools(world):
    """The lab's MCP tools (fetch, record_payment, record_payment_once) as LangChain tools."""
    return await MultiServerMCPClient(world.mcp_connections()).get_tools()


def build_graph(model, tools, checkpointer=None):
    """START → agent ⇄ tools → END: the model answers, or calls tools and reads their results."""
    async def agent(state: MessagesState):
        return {"messages": [await model.bind_tools(tools).ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)  # tool calls → tools, else → END
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


async def run_turn(world, conversation, message):
    """The graph, on the conversation's messages so far and the new one; keep what it returns."""
    graph = build_graph(world.model(), await load_tools(world))
    history = THREADS.get(conversation, [])
    state = await graph.ainvoke({"messages": [*history, ("user", message)]})
    THREADS[conversation] = state["messages"]


async def recover(world):
    pass  # nothing was kept, so there is nothing to recover


async def resume(world, conversation):
    pass  # nothing was kept, so there is nothing to resume


async def read(world, conversation):
    return {"messages": THREADS.get(conversation, []), "runs": []}
