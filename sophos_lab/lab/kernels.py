"""Jupyter kernels forked from the lab's fork server: a kernel provisioner.

A kernel is `python -m ipykernel_launcher -f CONNECTION_FILE`, and most of its start-up is
imports (IPython, ipykernel, ZeroMQ, then the lab: pandas, LangGraph). `ForkedProvisioner` starts
that same command forked from the fork server (`forkserver.py`), which imported them once: the
kernel is a real process of its own (its pid, session, environment, directory and argv), that
jupyter_client signals, interrupts and kills as it would a `Popen` child, and a real SIGKILL ends.

A kernel spec picks it with `"metadata": {"kernel_provisioner": {"provisioner_name":
"sophos-lab-forked"}}` (the entry point in pyproject.toml); `LabKernel` writes such a spec for
the lab's kernel children, and the tests one named `python3` for nbval's and papermill's lesson
kernels. `SOPHOS_LAB_FORKSERVER=0` in the kernel's environment starts a fresh interpreter instead.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import LocalProvisioner

from .forkserver import forking, start_child

PROVISIONER_NAME = "sophos-lab-forked"
KERNEL_PRELOAD = ("ipykernel.kernelapp", "sophos_lab.lab.harness")
"""Imported by the fork server before its first kernel: the kernel's own start-up, and the lab a
lesson imports in its setup cell."""


class ForkedProvisioner(LocalProvisioner):  # type: ignore[misc]
    """`LocalProvisioner`, with the kernel forked instead of started as a fresh interpreter."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        env = kwargs.get("env") or dict(os.environ)
        if cmd[:3] != [sys.executable, "-m", "ipykernel_launcher"] or not forking(env):  # not a kernel of ours
            return await super().launch_kernel(cmd, **kwargs)
        cwd = kwargs.get("cwd") or os.getcwd()
        with open(os.devnull, "w") as devnull:
            self.process = start_child(
                "ipykernel_launcher", cmd[3:], env=env, cwd=pathlib.Path(cwd),
                stdout=kwargs.get("stdout") or devnull, stderr=kwargs.get("stderr") or devnull,
                preload=KERNEL_PRELOAD,
            )
        self.pid = self.process.pid
        self.pgid = self.process.pid  # the child is the leader of a session of its own
        self.cwd = cwd
        return self.connection_info


def kernel_spec(display_name: str) -> dict[str, Any]:
    """A kernel.json for this interpreter's ipykernel, forked by `ForkedProvisioner`."""
    return {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "metadata": {"debugger": True, "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME}},
    }
