# ✏️ EXERCISE stage_a: the bare agent: START → agent ⇄ tools → END, with no saver
from langchain_mcp_adapters.client import MultiServerMCPClient
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

THREADS = {}  # conversation → its messages, in this process's memory only


async def load_tools(world):
    """The lab's MCP tools (fetch, record_payment, record_payment_once) as LangChain tools."""
    return await MultiServerMCPClient(world.mcp_connections()).get_tools()


def build_graph(model, tools, checkpointer=None):
    """START → agent → tools → END: the tools' results are never shown to the model."""
    async def agent(state: MessagesState):
        return {"messages": [await model.bind_tools(tools).ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", END)  # wrong: the agent never reads what its tool returned
    return graph.compile(checkpointer=checkpointer)


async def run_turn(world, conversation, message):
    """The graph, on the conversation's messages so far and the new one; keep what it returns."""
    graph = build_graph(world.model(), await load_tools(world))
    history = THREADS.get(conversation, [])
    state = await graph.ainvoke({"messages": [*history, ("user", message)]})
    THREADS[conversation] = state["messages"]


async def recover(world):
    pass


async def resume(world, conversation):
    pass


async def read(world, conversation):
    return {"messages": THREADS.get(conversation, []), "runs": []}
