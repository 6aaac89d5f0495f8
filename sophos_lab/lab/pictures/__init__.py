"""Pictures drawn from what an experiment observed: the lab's own records, not static images.

Each picture is a `Picture`: a matplotlib figure and the names of what it shows (`elements`),
read off the same records it draws. A notebook shows it as SVG whose labels are text, followed by
its elements as text; that text is what nbval compares (the drawing itself is sanitised to `SVG`,
see tests/notebooks/sanitize.cfg), so a picture that stops showing what its lesson says fails the
lesson's test. One module per picture, beside the data it reads:

- `timeline`: a conversation's runs on a time axis, each checkpoint labelled with its step and the
  node whose write made it, and the model requests (read by `inspect.timeline_picture`, shown by
  `Lab.timeline`; lessons 00, 02, 06d, 09, 12).
- `event_ids`: event ids across a disconnect: what each connection received, what the server kept,
  the `Last-Event-ID` catch-up (lesson 04).
- `gates`: each approval gate from made to decided, the ledger's payments and moments a lesson
  noted (a kill), in the order they happened (lessons 11, 14).
- `replay`: commit, kill, replay: a paying tool across a crash of the agent, as a sequence (lanes:
  the agent process, the tool server, the checkpoint store), one panel per experiment (lessons 07, 15).
- `cancel`: a run's cancel request against its outcome, on a time axis (lesson 13).
- `lease`: the lease on a time axis: one lane per process, the lease, a kill or a freeze, the expiry
  and the takeover (lessons 08b, 16).
- `statuses`: the run-status state machine (the runtime's statuses and transitions, hand-placed),
  with the transitions a lesson's runs took in bold, read from the runs table (lessons 06a–06e).
- `topology`: who owns what: the web servers, the workers and PostgreSQL between them, with the
  runs each worker owns and each web server streamed (lesson 17).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Picture:
    figure: Any
    """A matplotlib Figure."""
    title: str
    elements: list[str] = field(default_factory=list)
    """What the picture shows, named: the words a lesson (and its test) looks for."""

    def svg(self) -> str:
        import matplotlib

        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "sophos-lab"}):
            buffer = io.StringIO()
            self.figure.savefig(buffer, format="svg", bbox_inches="tight")
        return buffer.getvalue()

    def __str__(self) -> str:
        return "\n".join([f"🖼  {self.title}", *(f"   · {element}" for element in self.elements)])

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"image/svg+xml": self.svg(), "text/plain": str(self)}


def picture(figure: Any, title: str, elements: list[str]) -> Picture:
    """Wrap a figure, and close it in pyplot (the notebook shows the Picture, not the figure a second time)."""
    import matplotlib.pyplot as plt

    plt.close(figure)
    return Picture(figure, title, elements)
