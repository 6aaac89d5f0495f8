/* The web page of `sophos-lab serve`: the original's UI contract (its +page.svelte) in plain JS.
 *
 * On load it lists the conversations and opens the most recent; if that one is running, it
 * follows the run. Sending POSTs /api/chat and follows the run over SSE with the browser's own
 * EventSource (which reconnects by itself, sending Last-Event-ID). Tokens go to a live bubble;
 * a tool call becomes a chip, a tool result a bubble of its own. When the run ends (`end` or
 * `chat-error`) the stream is closed and the page reloads everything from durable state: what
 * was only streamed (tokens of an unfinished step, reasoning) is gone then, as it is from disk.
 *
 * A run that stops at an approval gate (`end` with status `waiting`) leaves the conversation
 * with an `approval`: the approval card lists the calls it holds (tool and arguments), and its
 * Approve and Reject (with an optional reason) post /approve or /reject for that gate, then
 * follow the run that carries the decision on, as Resume does.
 *
 * A cancel the person asked for is told in the status line, not as an error.
 *
 * Every model and tool text is written with textContent, never as markup.
 *
 * A server with users or a server token wants a token on every request. The page asks for it
 * the first time the server answers 401 (the token dialog, which shows the server's reason: no
 * token, a wrong one, a revoked one), or takes it from a link as /?token=<token>. It keeps the
 * token in sessionStorage (this tab only), takes it out of the address bar, sends it as
 * `Authorization: Bearer` on every request and as ?token= on the SSE stream, the one request an
 * EventSource cannot add a header to.
 */
"use strict";

const TOKEN_KEY = "sophos-lab-token";
const byId = (id) => document.getElementById(id);
const ui = {
  list: byId("conversations"), newConversation: byId("new-conversation"),
  title: byId("title"), status: byId("status"), exportLink: byId("export"),
  error: byId("error-banner"), resumeBanner: byId("resume-banner"), resume: byId("resume"),
  transcript: byId("transcript"), form: byId("composer"), message: byId("message"),
  send: byId("send"), detach: byId("detach"), cancel: byId("cancel"),
  tokenDialog: byId("token-dialog"), tokenWhy: byId("token-why"), tokenInput: byId("token-input"),
  approvalCard: byId("approval-card"), approvalCalls: byId("approval-calls"),
  rejectReason: byId("reject-reason"), approve: byId("approve"), reject: byId("reject"),
};

const CANCELLED = "CANCELLED"; // a cancel someone asked for: a status, not an error

let conversation = null; // the open conversation's id; null before the first message of a new one
let source = null;       // the EventSource following its run, while the page follows one
let live = null;         // the assistant bubble the next token goes to
let approval = null;     // the gate the open conversation waits at ({gate, run, calls}), else null

let token = takeToken();
let asking = null;       // the token dialog's answer, while it is open

function takeToken() {
  const url = new URL(location.href);
  const given = url.searchParams.get("token");
  if (given !== null) {
    sessionStorage.setItem(TOKEN_KEY, given);
    url.searchParams.delete("token");
    history.replaceState(null, "", url); // out of the address bar and the history
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

// --- the API --------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

// The server said 401: show its reason and wait for a token (one dialog for every request that
// was refused meanwhile).
function askForToken(why) {
  if (!asking) {
    ui.tokenWhy.textContent = why;
    ui.tokenInput.value = "";
    ui.tokenDialog.showModal();
    asking = new Promise((resolve) => {
      ui.tokenDialog.addEventListener("close", () => {
        token = ui.tokenInput.value.trim() || null;
        if (token) sessionStorage.setItem(TOKEN_KEY, token);
        else sessionStorage.removeItem(TOKEN_KEY);
        asking = null;
        resolve();
      }, { once: true });
    });
  }
  return asking;
}

async function api(path, init = {}) {
  for (;;) {
    try {
      return await request(path, init);
    } catch (error) {
      if (error.code !== "UNAUTHORIZED") throw error;
      await askForToken(error.message);
    }
  }
}

async function request(path, init) {
  const headers = new Headers(init.headers);
  if (token) headers.set("Authorization", `Bearer ${token}`);
  if (init.body !== undefined) headers.set("Content-Type", "application/json");
  let response;
  try {
    response = await fetch(path, { ...init, headers });
  } catch (error) {
    throw new ApiError("NETWORK_ERROR", `The server did not answer (${error.message}).`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const error = body?.error ?? { code: `HTTP_${response.status}`, message: response.statusText };
    throw new ApiError(error.code, error.message);
  }
  return body;
}

const postChat = (body) => api("api/chat", { method: "POST", body: JSON.stringify(body) });

// --- rendering (text only) ------------------------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function bubble(kind, label) {
  const item = element("li", `msg ${kind}`);
  if (label) item.append(element("span", "role", label));
  ui.transcript.append(item);
  return item;
}

function userBubble(text, pending = false) {
  const item = bubble("user", "You");
  item.append(element("span", "text", text));
  if (pending) {
    item.classList.add("pending");
    item.append(element("span", "note", "Saved, not answered yet: Resume answers it."));
  }
}

function assistantBubble(text, toolCalls = []) {
  const item = bubble("assistant", "Assistant");
  item.append(element("span", "text", text));
  for (const call of toolCalls) item.append(chip(call.name, call.args));
  return item;
}

function chip(name, args) {
  return element("span", "chip", `Tool call: ${name} ${JSON.stringify(args ?? {})}`);
}

function toolBubble(name, content, status = "success") {
  const item = bubble(status === "error" ? "tool error" : "tool");
  const details = element("details");
  details.append(element("summary", "", `Tool result: ${name || "?"}${status === "error" ? " (error)" : ""}`),
                 element("pre", "", content));
  item.append(details);
}

function describe(summary, count = summary.messageCount) {
  const last = summary.status ? `Last run ${summary.status}` : "No runs yet";
  return `${last} · ${count} message${count === 1 ? "" : "s"}`;
}

function showError(code, message) {
  ui.error.replaceChildren(element("span", "code", code), ` ${message}`);
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.error.replaceChildren();
}

function showConversation(detail) {
  const summary = detail.conversation;
  ui.title.textContent = summary.title || "Untitled";
  ui.status.textContent = describe(summary, detail.messages.length); // the count of what is shown
  ui.exportLink.href = `api/conversations/${summary.id}/export?format=md`;
  ui.exportLink.download = `${summary.id}.md`;
  ui.exportLink.hidden = false;
  ui.transcript.replaceChildren();
  for (const message of detail.messages) {
    if (message.role === "user") userBubble(message.content, message.pending);
    else if (message.role === "assistant") assistantBubble(message.content, message.toolCalls);
    else if (message.role === "tool") toolBubble(message.name, message.content, message.status);
  }
  clearError();
  if (summary.status === "failed" && summary.error) showError(summary.error.code, summary.error.message);
  ui.resumeBanner.hidden = !detail.resumable;
  showApproval(detail.approval ?? null);
}

function showApproval(gate) {
  approval = gate;
  ui.approvalCalls.replaceChildren(...(gate?.calls ?? []).map((call) => {
    const item = element("li");
    item.append(element("code", "call-name", call.name), element("code", "call-args", JSON.stringify(call.args ?? {})));
    return item;
  }));
  ui.approvalCard.hidden = gate === null;
  // The server refuses a new message while a gate waits (RUN_WAITING): decide first.
  ui.send.disabled = gate !== null;
  ui.send.title = gate === null ? "" : "The run waits for your decision on its tool calls: Approve or Reject first";
}

function showCancelled() {
  ui.status.textContent = ui.resumeBanner.hidden ? "Cancelled." : "Cancelled. Resume to continue.";
}

function markCurrent() {
  for (const button of ui.list.querySelectorAll("button")) {
    if (button.dataset.id === conversation) button.setAttribute("aria-current", "true");
    else button.removeAttribute("aria-current");
  }
}

// --- durable state ----------------------------------------------------------------------------

async function loadList() {
  const { conversations } = await api("api/conversations?limit=100");
  ui.list.replaceChildren(...conversations.map((summary) => {
    const button = element("button");
    button.type = "button";
    button.dataset.id = summary.id;
    button.append(element("span", "conversation-title", summary.title || "Untitled"),
                  element("span", "conversation-status", describe(summary)));
    button.addEventListener("click", () => openConversation(summary.id, { attach: true }).catch(reportError));
    const item = element("li");
    item.append(button);
    return item;
  }));
  markCurrent();
  return conversations;
}

async function openConversation(id, { attach = false } = {}) {
  stopFollowing();
  conversation = id;
  showApproval(null); // until the conversation says otherwise
  markCurrent();
  const detail = await api(`api/conversations/${id}`);
  if (conversation !== id) return; // another one was opened meanwhile
  showConversation(detail);
  if (attach && ["running", "queued"].includes(detail.conversation.status)) follow(id);
}

function reportError(error) {
  showError(error.code ?? "ERROR", error.message);
}

// --- following a run ---------------------------------------------------------------------------

function follow(id) {
  stopFollowing();
  const url = new URL("api/chat", location.href);
  url.searchParams.set("conversation", id);
  if (token) url.searchParams.set("token", token);
  const stream = new EventSource(url);
  source = stream;
  setFollowing(true);
  ui.status.textContent = "Running…";
  const data = (event) => JSON.parse(event.data);
  stream.addEventListener("open", () => { ui.status.textContent = "Running…"; });
  stream.addEventListener("token", (event) => liveText().append(data(event)));
  stream.addEventListener("reasoning", (event) => liveReasoning().append(data(event)));
  stream.addEventListener("trace", (event) => onTrace(data(event)));
  stream.addEventListener("end", () => finish(id));
  stream.addEventListener("chat-error", (event) => finish(id, data(event)));
  stream.addEventListener("error", () => {
    if (stream !== source) return;
    if (stream.readyState === EventSource.CONNECTING) {
      // The browser reconnects by itself and sends Last-Event-ID: the server replays the gap.
      ui.status.textContent = "Connection lost: reconnecting…";
    } else {
      finish(id, { code: "SSE_ERROR", message: "The stream of the run closed; reloaded what is saved." });
    }
  });
}

function liveBubble() {
  if (!live) {
    live = assistantBubble("");
    live.classList.add("live");
  }
  return live;
}

function liveText() {
  return liveBubble().querySelector(".text");
}

function liveReasoning() {
  const bubbleNow = liveBubble();
  let reasoning = bubbleNow.querySelector(".reasoning");
  if (!reasoning) {
    reasoning = element("span", "reasoning");
    reasoning.title = "The model's reasoning: streamed, not saved";
    bubbleNow.querySelector(".text").before(reasoning);
  }
  return reasoning;
}

function onTrace(note) {
  if (note.event === "call") {
    liveBubble().append(chip(note.data.name, note.data.arguments));
  } else if (note.event === "result") {
    live?.classList.remove("live");
    live = null; // the answer to the result gets a bubble of its own
    toolBubble(note.data.name, note.data.result, note.data.status);
  }
}

function setFollowing(following) {
  const hadFocus = document.activeElement === ui.send || document.activeElement === ui.detach;
  ui.send.hidden = following;
  ui.detach.hidden = !following;
  ui.cancel.hidden = !following;
  ui.cancel.disabled = false;
  ui.resume.disabled = following;
  if (hadFocus) (following ? ui.detach : ui.send).focus();
}

function stopFollowing() {
  source?.close();
  source = null;
  live = null;
  setFollowing(false);
}

async function finish(id, error) {
  stopFollowing();
  try {
    await Promise.all([loadList(), conversation === id ? openConversation(id) : null]);
  } catch (failure) {
    reportError(failure);
  }
  if (error?.code === CANCELLED) {
    if (conversation === id) showCancelled();
  } else if (error) {
    showError(error.code, error.message);
  }
}

// --- what a person does --------------------------------------------------------------------------

ui.form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const message = ui.message.value;
  if (source || approval || !message.trim()) return; // while following a run the button is Detach
  clearError();
  ui.send.disabled = true;
  try {
    const started = await postChat(conversation ? { message, conversation } : { message });
    ui.message.value = "";
    if (conversation !== started.conversation) {
      conversation = started.conversation;
      ui.transcript.replaceChildren();
      ui.title.textContent = message.trim();
    }
    ui.resumeBanner.hidden = true;
    userBubble(message);
    follow(started.conversation);
    loadList().catch(reportError);
  } catch (error) {
    reportError(error);
  } finally {
    ui.send.disabled = approval !== null;
  }
});

ui.message.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});

ui.resume.addEventListener("click", async () => {
  clearError();
  try {
    await postChat({ conversation, resume: true });
    ui.resumeBanner.hidden = true;
    ui.message.focus();
    follow(conversation);
  } catch (error) {
    reportError(error);
  }
});

ui.detach.addEventListener("click", async () => {
  const id = conversation;
  stopFollowing();
  ui.message.focus();
  try {
    await openConversation(id);
  } catch (error) {
    reportError(error);
  }
  ui.status.textContent = "Detached: the run goes on on the server. Open the conversation again to follow it.";
});

ui.cancel.addEventListener("click", async () => {
  // The run's own stream then ends with its final event (chat-error CANCELLED, or end if it
  // finished first), and finish() reloads the conversation from the database.
  clearError();
  ui.cancel.disabled = true; // asked once
  ui.status.textContent = "Cancelling…";
  try {
    await api(`api/conversations/${conversation}/cancel`, { method: "POST" });
  } catch (error) {
    ui.cancel.disabled = false;
    reportError(error);
  }
});

async function decide(kind) {
  // Names the gate, so that a retry answers for this one (the same decision again is a no-op
  // that answers with the run it started); then follows that run, as Resume does.
  const id = conversation;
  const gate = approval;
  if (!id || !gate || source) return;
  const body = { gate: gate.gate };
  const reason = ui.rejectReason.value.trim();
  if (kind === "reject" && reason) body.reason = reason;
  clearError();
  ui.approve.disabled = ui.reject.disabled = true;
  try {
    await api(`api/conversations/${id}/${kind}`, { method: "POST", body: JSON.stringify(body) });
    ui.rejectReason.value = "";
    showApproval(null);
    ui.message.focus();
    follow(id);
  } catch (error) {
    // Decided meanwhile (GATE_DECIDED), nothing waits any more, …: show what is saved now.
    await openConversation(id).catch(() => {});
    reportError(error);
  } finally {
    ui.approve.disabled = ui.reject.disabled = false;
  }
}

ui.approve.addEventListener("click", () => decide("approve"));
ui.reject.addEventListener("click", () => decide("reject"));

ui.newConversation.addEventListener("click", () => {
  stopFollowing();
  conversation = null;
  markCurrent();
  ui.title.textContent = "New conversation";
  ui.status.textContent = "";
  ui.exportLink.hidden = true;
  ui.resumeBanner.hidden = true;
  showApproval(null);
  ui.transcript.replaceChildren();
  clearError();
  ui.message.focus();
});

ui.exportLink.addEventListener("click", async (event) => {
  if (!token) return; // a plain link: the browser downloads it
  event.preventDefault(); // a link cannot send the token: fetch with it, then save what came
  try {
    const response = await fetch(ui.exportLink.href, { headers: { Authorization: `Bearer ${token}` } });
    if (!response.ok) throw new ApiError(`HTTP_${response.status}`, "The export was refused.");
    const saved = element("a");
    saved.href = URL.createObjectURL(await response.blob());
    saved.download = ui.exportLink.download;
    saved.click();
    setTimeout(() => URL.revokeObjectURL(saved.href), 0);
  } catch (error) {
    reportError(error);
  }
});

(async () => {
  try {
    const conversations = await loadList();
    if (conversations.length) await openConversation(conversations[0].id, { attach: true });
  } catch (error) {
    reportError(error);
  }
  ui.message.focus();
})();
