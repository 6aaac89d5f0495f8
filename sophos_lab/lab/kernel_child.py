"""A child of the lab that is a Jupyter kernel of its own (see `children`, and `kernels` for
how it is forked from the fork server)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .child_base import CELL_DONE, EXITED, KERNEL_ERROR, ChildFailed, EventLog, _Child
from .forkserver import ForkedProcess, wait_stopped
from .worker import parse_line


KERNEL_NAME = "sophos-lab-child"
# Run while the kernel boots, before it answers its first request: the runtime's imports (most
# of a child's start-up) overlap the client's connecting and waiting for the kernel, ~0.1 s
# sooner ready than importing them in the setup cell. A failure here only shows in the kernel's
# log; the setup cell imports again and raises it where the lab sees it.
_PRELOAD = "from sophos_lab.lab.worker import load_runtime as _load_runtime; _load_runtime()"
_SETUP = (
    "from sophos_lab.lab.worker import ChildRuntime as _ChildRuntime\n"
    "_sophos = _ChildRuntime()\n"
    "_sophos.install_signal_handlers(request_dir={request_dir!r})\n"
)
REQUEST_SIGNAL = signal.SIGUSR1
"""Tells a kernel child that a command waits in its request directory (see `LabKernel.cancel`)."""


class LabKernel(_Child):
    """The agent in a Jupyter kernel of its own (jupyter_client), killable from the notebook.

    The kernelspec is built from the running interpreter, the kernel's history stays in memory,
    and the kernel's raw output goes to a log file. Each chat or resume is one cell executed
    with a non-blocking `execute`; the events come back as stdout lines on IOPub.

    A cancel cannot be a cell: the shell runs one cell at a time, and the chat's is still
    running. It goes as a request file and a signal instead (`cancel`).
    """

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path, spec_dir: Path) -> None:
        super().__init__(env, cwd, log_path)
        self.spec_dir = Path(spec_dir)
        self.request_dir = self.spec_dir / "requests" / self.log_path.stem
        """Where `cancel` leaves its requests for the kernel (one directory per child)."""
        self.km = None
        self.kc = None
        self.output: list[str] = []
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._requests_sent = 0

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def start(self, timeout: float = 60.0) -> LabKernel:
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        self._write_kernelspec()
        self.log = EventLog()
        self._stop = threading.Event()
        self.km = KernelManager(
            kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(self.spec_dir)])
        )
        with open(self.log_path, "ab") as out:
            self.km.start_kernel(
                env=self.env, cwd=str(self.cwd), stdout=out, stderr=out,
                extra_arguments=["--HistoryManager.hist_file=:memory:"],
            )
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=timeout)
        self._reader = threading.Thread(target=self._read, args=(self.km, self.kc, self._stop), daemon=True)
        self._reader.start()
        shutil.rmtree(self.request_dir, ignore_errors=True)  # a restarted child takes no old request
        self.execute(_SETUP.format(request_dir=str(self.request_dir)), timeout=timeout)
        return self

    def execute(self, code: str, timeout: float = 60.0) -> None:
        """Run code in the child kernel and wait for it to finish; raises on an error."""
        msg_id = self.kc.execute(code, store_history=False)
        done = self.log.wait_for(CELL_DONE, timeout=timeout, since=0, msg_id=msg_id)
        if done["data"]["error"]:
            raise RuntimeError(f"the child kernel raised {done['data']['error']}")

    def is_alive(self) -> bool:
        return self.km is not None and self.km.is_alive()

    def wait_stopped(self, timeout: float | None = 60.0) -> None:
        """As a worker's: block until the kernel has stopped itself (SIGSTOP; once per stop).
        Its own `write-stop` event may not reach the lab first: the kernel stops before its
        output thread has sent it. A kernel started without the fork server cannot be waited on."""
        process = self.km.provisioner.process if self.km is not None and self.km.provisioner else None
        if not isinstance(process, ForkedProcess):
            raise ChildFailed("wait_stopped needs a forked kernel (SOPHOS_LAB_FORKSERVER is 0 here)")
        try:
            wait_stopped(process, timeout)
        except ChildProcessError as error:
            raise ChildFailed(str(error)) from None

    def kill(self) -> int:
        """SIGKILL to the kernel's process group (not `shutdown_kernel(now=True)`: no SIGINT first)."""
        self.km.signal_kernel(signal.SIGKILL)
        code = self.km.provisioner.process.wait()
        self._tidy(code)
        return code

    def shutdown(self, timeout: float = 60.0) -> int:
        """SIGTERM to the kernel process alone: the child drains, records, closes and exits."""
        process = self.km.provisioner.process
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()
        self.log.wait_for(EXITED, timeout=timeout, since=0)  # as a worker's: the reader has read all
        self._tidy(code)
        return code

    def close(self) -> None:
        if self.km is None:
            return
        if self.is_alive():
            self.kill()
        else:
            self._tidy(self.km.provisioner.process.poll() if self.km.provisioner else None)

    def cancel(self, conversation: str, timeout: float = 60.0) -> dict[str, Any]:
        """As a worker's: the run's final event, or the `rejected` event (`RUN_NOT_ACTIVE`, ...).

        The kernel's shell is busy with the chat's cell, so the command does not go as a cell:
        it is written to the child's request directory, then SIGUSR1 tells the kernel, whose
        handler starts it on the loop the chat runs on. A dead kernel raises `ChildFailed`.
        """
        if not self.is_alive():
            raise ChildFailed("the kernel child is not running: nothing to cancel")
        return super().cancel(conversation, timeout)

    def _send(self, cmd: str, **args: Any) -> None:
        if cmd == "cancel":
            self._send_request({"cmd": cmd, **args})
            return
        if cmd == "conversations":
            code = "await _sophos.conversations();"
        elif cmd == "chat":
            code = f"await _sophos.chat({args['message']!r}, {args['conversation']!r})"
        elif cmd == "approve":
            code = f"await _sophos.approve({args['conversation']!r}, {args['decisions']!r}, {args['gate']!r})"
        elif cmd == "reject":
            code = f"await _sophos.reject({args['conversation']!r}, {args['reason']!r}, {args['gate']!r})"
        else:
            code = f"await _sophos.resume({args['conversation']!r})"
        self.kc.execute(code, store_history=False)

    def _send_request(self, command: dict[str, Any]) -> None:
        """Leave `command` in the request directory (whole, by a rename; numbered, so the kernel
        takes them in order) and signal the kernel process."""
        self._requests_sent += 1
        path = self.request_dir / f"{self._requests_sent:06d}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(command), encoding="utf-8")
        os.replace(partial, path)
        try:
            os.kill(self.pid, REQUEST_SIGNAL)
        except ProcessLookupError:
            pass  # it died just now: the waiting sees its exit

    def _tidy(self, returncode: int | None) -> None:
        self._stop.set()
        if self._reader is not None:
            # Out of its poll of the channels (at most 0.2 s) before they close: a zmq socket is
            # one thread's, and closing the context under a poll could hang its termination.
            self._reader.join(timeout=5)
        self.log.append_once({"event": EXITED, "data": {"returncode": returncode}})
        self.kc.stop_channels()
        self.km.cleanup_resources()

    def _write_kernelspec(self) -> None:
        folder = self.spec_dir / KERNEL_NAME
        folder.mkdir(parents=True, exist_ok=True)
        from .kernels import kernel_spec

        # Forked from the fork server, which imported the runtime (`kernels.py`); the argv is a
        # fresh interpreter's, which `SOPHOS_LAB_FORKSERVER=0` starts instead.
        spec = kernel_spec("sophos_lab child")
        spec["argv"].append(f"--IPKernelApp.exec_lines={_PRELOAD}")
        (folder / "kernel.json").write_text(json.dumps(spec, indent=1))

    def _read(self, km: Any, kc: Any, stop: threading.Event) -> None:
        partial = ""
        errors: dict[str, str] = {}
        while not stop.is_set():
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if not km.is_alive():
                    code = km.provisioner.process.poll() if km.provisioner else None
                    self.log.append_once({"event": EXITED, "data": {"returncode": code}})
                    return
                continue
            except Exception:  # channels closed under us by kill()/shutdown()
                return
            kind, content = msg["msg_type"], msg["content"]
            parent = msg.get("parent_header", {}).get("msg_id")
            if kind == "stream":
                partial += content["text"]
                *lines, partial = partial.split("\n")
                for line in lines:
                    event = parse_line(line)
                    if event is not None:
                        self.log.append(event)
                    elif line.strip():
                        self.output.append(line)
            elif kind == "error":
                errors[parent] = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle" and parent:
                error = errors.pop(parent, None)
                self.log.append({"event": CELL_DONE, "data": {"msg_id": parent, "error": error}})
                if error:
                    self.log.append({"event": KERNEL_ERROR, "data": {"msg_id": parent, "error": error}})
