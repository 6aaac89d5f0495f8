"""A second Ollama-protocol server for the tests: it behaves like a real Ollama, not a script.

    python ollama_like.py [--port 0] [--model ollama-like:latest]

It prints the kit's ready line (``{"ready": true, "url": ...}``) and, started with
``SOPHOS_LAB_EXIT_WITH_PARENT=1``, exits when its stdin closes. What differs from
``sophos_lab.standins.scripted_model`` on purpose, as a real Ollama (0.12) differs:

- ``/api/version`` is a plain version number (so the lab does not take it for the scripted one);
- it chooses its reply from the request, as a model would, with no script: a user message that
  contains a URL, with a tool named like ``fetch`` offered, gets a call of that tool with the URL
  ("pay N to NAME", with a tool named like ``payment`` offered, a call with ``to`` and ``amount``);
  after a tool result it answers with a short summary of that result; anything else gets a
  plain short answer;
- it writes at a real model's pace: a streamed chunk every ``--token-seconds`` (30 ms by default),
  so a lesson that stops or drains mid-answer meets an answer that takes seconds, not microseconds;
- ``"think": true`` streams ``message.thinking`` chunks before the answer;
- tool calls carry an ``id`` and ``function.index``;
- the last chunk has ``done: true``, ``done_reason`` and the timing fields;
- an unknown model gets the newer 404 wording ``model "x" not found, try pulling it first``;
- ``/api/show`` lists ``capabilities``;
- a second tag, ``<model>-hesitant``, is the same model on a day it does not reach for tools at
  once: the first time it is asked something it would answer with a tool call, it answers in
  words instead (asked the same again, it calls the tool), as a real model sometimes does.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the kit, for its HTTP helpers

from sophos_lab.standins._httpkit import JsonHandler, now_iso, serve  # noqa: E402

VERSION = "0.12.6"
PAY = re.compile(r"\bpay\s+(\d+)\s+to\s+(\w+)", re.IGNORECASE)
URL = re.compile(r"https?://[^\s<>\"',;]*[^\s<>\"',;.)]")
WORDS = re.compile(r"\S+\s*|\s+")
BULLETS = re.compile(r"(?i)\b(\d+)\s+(?:\w+\s+)?bullet")


class OllamaLike(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], model: str, token_seconds: float = 0.03) -> None:
        super().__init__(address, _Handler)
        self.token_seconds = token_seconds
        self.tag = model if ":" in model else f"{model}:latest"
        name, _, version = self.tag.partition(":")
        self.hesitant_tag = f"{name}-hesitant:{version}"
        self.asked: set[str] = set()  # prompts the hesitant tag has answered without its tool
        self.asked_lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)  # a client that hung up is no error

    def knows(self, model: Any) -> bool:
        return self.resolve(model) is not None

    def resolve(self, model: Any) -> str | None:
        """The tag `model` names (`x` means `x:latest`), if this server has it."""
        if not isinstance(model, str):
            return None
        tag = model if ":" in model else f"{model}:latest"
        return tag if tag in (self.tag, self.hesitant_tag) else None

    def hesitates(self, model: str, prompt: str) -> bool:
        """True the first time the hesitant tag is asked `prompt`."""
        if self.resolve(model) != self.hesitant_tag:
            return False
        with self.asked_lock:
            first = prompt not in self.asked
            self.asked.add(prompt)
        return first


class _Handler(JsonHandler):
    server: OllamaLike

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/":
            data = b"Ollama is running"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/api/version":
            self.send_json(200, {"version": VERSION})
        elif path == "/api/tags":
            self.send_json(200, {"models": [self._card(self.server.tag), self._card(self.server.hesitant_tag)]})
        else:
            self.send_json(404, {"error": "404 page not found"})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        body = self.read_json()
        if path == "/api/show":
            if self.server.knows(body.get("model")):
                self.send_json(200, self._show())
            else:
                self._unknown(body.get("model"))
        elif path == "/api/chat":
            self._chat(body)
        else:
            self.send_json(404, {"error": "404 page not found"})

    def _unknown(self, model: Any) -> None:
        self.send_json(404, {"error": f'model "{model}" not found, try pulling it first'})

    # --- chat -----------------------------------------------------------

    def _chat(self, body: dict) -> None:
        model = body.get("model")
        if not self.server.knows(model):
            self._unknown(model)
            return
        started = time.monotonic()
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        thinking, text, calls = decide(messages, body.get("tools") or [])
        if calls and self.server.hesitates(model, last_user_prompt(messages)):
            thinking, text, calls = ("I can answer this without a tool.",
                                     "I would rather not open that myself. Ask me again and I will.", [])
        think = body.get("think") is True
        chunks = []
        if think:
            chunks += [{"content": "", "thinking": w} for w in WORDS.findall(thinking)]
        chunks += [{"content": w} for w in WORDS.findall(text)]
        if calls:
            chunks.append({"content": "", "tool_calls": calls})
        prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)
        if body.get("stream", True) is False:
            message = {"role": "assistant", "content": text}
            if think and thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            self.send_json(200, {**self._final(model, started, prompt_tokens, len(chunks)), "message": message})
            return
        self.start_chunked(200, "application/x-ndjson")
        try:
            for part in chunks:
                time.sleep(self.server.token_seconds)  # a real model's pace, not a barrier
                line = {"model": model, "created_at": now_iso(),
                        "message": {"role": "assistant", **part}, "done": False}
                self.send_chunk(json.dumps(line).encode() + b"\n")
            self.send_chunk(json.dumps(self._final(model, started, prompt_tokens, len(chunks))).encode() + b"\n")
            self.send_chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    @staticmethod
    def _final(model: str, started: float, prompt_tokens: int, eval_count: int) -> dict:
        total = max(1, int((time.monotonic() - started) * 1e9))
        return {
            "model": model, "created_at": now_iso(),
            "message": {"role": "assistant", "content": ""},
            "done": True, "done_reason": "stop",
            "total_duration": total, "load_duration": total // 10,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": total // 5,
            "eval_count": eval_count, "eval_duration": total // 2,
        }

    # --- metadata -------------------------------------------------------

    def _card(self, tag: str) -> dict:
        return {"name": tag, "model": tag,
                "modified_at": "2025-10-01T12:00:00.000000000Z", "size": 522653767,
                "digest": "ab" * 32, "details": DETAILS}

    def _show(self) -> dict:
        return {
            "license": "Apache License 2.0 (test stand-in)",
            "modelfile": f"# Modelfile of {self.server.tag}, a test stand-in\nFROM ollama-like\n",
            "parameters": "temperature 0.6\ntop_k 20",
            "template": "{{ .Prompt }}",
            "details": DETAILS,
            "model_info": {"general.architecture": "ollama-like", "general.parameter_count": 600_000_000},
            "capabilities": ["completion", "tools", "thinking"],
            "modified_at": "2025-10-01T12:00:00.000000000Z",
        }


DETAILS = {"parent_model": "", "format": "gguf", "family": "ollama-like", "families": ["ollama-like"],
           "parameter_size": "600M", "quantization_level": "Q4_K_M"}


def last_user_prompt(messages: list[dict]) -> str:
    return next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")


def decide(messages: list[dict], tools: list[dict]) -> tuple[str, str, list[dict]]:
    """(thinking, text, tool_calls) for this history, chosen as a model would choose them."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    prompt = last_user_prompt(messages)
    since = messages[last_user + 1:]
    results = [m for m in since if m.get("role") == "tool"]
    if results:
        content = str(results[-1].get("content") or "")
        called = [c for m in since for c in m.get("tool_calls") or []]
        url = ((called[-1].get("function") or {}).get("arguments") or {}).get("url", "the page") if called else "the page"
        if content.lower().startswith("error"):
            return (f"The tool failed for {url}. I should say so.",
                    f"I could not read {url}: {' '.join(content.split()[:12])}", [])
        words = re.sub(r"[#*_`>\[\]()]", " ", content).split()
        bullets = BULLETS.search(prompt)
        if bullets:  # asked for N bullet points: N bullets, each a slice of the page
            n = max(1, min(int(bullets[1]), 50))
            size = max(1, len(words) // n)
            lines = [f"- {' '.join(words[i * size:(i + 1) * size][:12]) or url}." for i in range(n)]
            return (f"The user wants {n} bullet points about {url}. I will take them from the text.",
                    "\n".join(lines), [])
        # As long as a real model's summary: a few hundred words, seconds at a real pace.
        return (f"The user wants a summary of {url}. The tool returned {len(words)} words. "
                "I will retell its first part.",
                f"Here is a summary of {url}. It says, in its own words: {' '.join(words[:200])}. "
                f"The page has about {len(words)} words in all.", [])
    payment = PAY.search(prompt)
    payers = [t.get("function") or {} for t in tools if "payment" in str((t.get("function") or {}).get("name", ""))]
    once = "once" in prompt.lower()  # "exactly once": the tool that says so, else the plain one
    pay = next((f for f in payers if ("once" in f.get("name", "")) == once), payers[0] if payers else None)
    if payment and pay:
        params = set(((pay.get("parameters") or {}).get("properties") or {}))
        arguments = {"to": payment[2], "amount": int(payment[1])}
        call = {"id": "call_" + secrets.token_hex(4), "function": {
            "index": 0, "name": pay["name"], "arguments": {k: v for k, v in arguments.items() if k in params}}}
        return (f"The user wants {payment[1]} paid to {payment[2]}. There is a tool for that.", "", [call])
    found = URL.search(prompt)
    fetch = next((t.get("function") or {} for t in tools
                  if "fetch" in str((t.get("function") or {}).get("name", ""))), None)
    if found and fetch:
        params = list(((fetch.get("parameters") or {}).get("properties") or {}))
        arg = "url" if "url" in params or not params else params[0]
        call = {"id": "call_" + secrets.token_hex(4),
                "function": {"index": 0, "name": fetch["name"], "arguments": {arg: found[0]}}}
        return (f"The user gave me {found[0]}. I should fetch it first.", "", [call])
    return ("A short answer will do.", "Hello! I am a small test model and this is a short, plain answer.", [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="ollama-like:latest")
    parser.add_argument("--token-seconds", type=float, default=0.03, help="the wait before each streamed chunk")
    args = parser.parse_args()
    serve(OllamaLike((args.host, args.port), args.model, args.token_seconds), model=args.model)


if __name__ == "__main__":
    main()
