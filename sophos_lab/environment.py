"""Where the kit is, and the environment the lab's commands run in (`cli`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = KIT_ROOT / "data" / "scripts"


def lab_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the lab: the kit's settings, and Jupyter's own state under `.lab/jupyter/`.

    JupyterLab's settings and workspaces and the server's config and runtime files live under the
    lab home, not the home directory, so a second `make lab` does not reopen old tabs and
    `sophos-lab reset` forgets them too.
    """
    from .lab.harness import lab_home

    env = dict(os.environ if environ is None else environ)
    home = lab_home()
    env.setdefault("CONFIG_DIR", str(KIT_ROOT / "config"))
    env.setdefault("DATABASE_PATH", str(home / "default" / "sophos.db"))
    env.setdefault("MEMORY_FILE_PATH", str(home / "default" / "memory.jsonl"))
    jupyter = home / "jupyter"
    env.update(
        JUPYTERLAB_SETTINGS_DIR=str(jupyter / "lab" / "user-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(jupyter / "lab" / "workspaces"),
        JUPYTER_CONFIG_DIR=str(jupyter / "config"),
        JUPYTER_RUNTIME_DIR=str(jupyter / "runtime"),
    )
    return env
