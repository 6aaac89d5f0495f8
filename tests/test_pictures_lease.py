"""The lease picture (`sophos_lab.lab.pictures.lease`), drawn from constructed records: what it
names follows the order of the events (a takeover before or after the expiry), not their timing."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from sophos_lab.lab.pictures import Picture  # noqa: E402
from sophos_lab.lab.pictures.lease import TITLE, Lane, LeaseStory, Run, lease_picture  # noqa: E402

T = 1_700_000_000.0


def killed() -> LeaseStory:
    return LeaseStory(
        lanes=[Lane("A", lease_from=T, lease_until=T + 15.0, lease_seconds=15.0,
                    runs=[Run(T, T + 1.5, "interrupted")]),
               Lane("B", lease_from=T + 1.5, lease_until=T + 16.5, lease_seconds=15.0,
                    runs=[Run(T + 1.5, T + 2.0, "completed")])],
        owner="A", taken_by="B", takeover=T + 1.5, killed=T + 1.0, scenario="A killed")


def frozen() -> LeaseStory:
    return LeaseStory(
        lanes=[Lane("A", lease_from=T, lease_until=T + 2.5, lease_seconds=1.5,
                    runs=[Run(T, T + 2.6, "interrupted")]),
               Lane("B", runs=[Run(T + 2.6, T + 3.0, "completed")])],
        owner="A", taken_by="B", takeover=T + 2.6, frozen=(T + 1.1, T + 3.2),
        woke=(T + 3.3, "OWNERSHIP_LOST"), scenario="A frozen")


def test_a_kill_taken_over_before_the_lease_ran_out() -> None:
    shown = lease_picture(killed())

    assert isinstance(shown, Picture)
    assert shown.title == f"{TITLE}: A killed"
    assert shown.elements == [
        "A: lease", "A: run interrupted", "B: lease", "B: run completed",
        "kill: A (SIGKILL), with time left on its lease",
        "expiry of A's lease",
        "takeover: B takes A's run over before A's lease ran out",
    ]
    svg = shown.svg()
    for label in ("kill -9", "takeover", "last renewal", "A's lease runs out", "process A", "process B"):
        assert label in svg, label  # labels stay text in the SVG
    assert str(shown).splitlines()[0] == f"🖼  {TITLE}: A killed"


def test_a_freeze_past_the_lease_taken_over_after_it_ran_out() -> None:
    shown = lease_picture(frozen())

    assert shown.elements == [
        "A: lease", "A: run interrupted", "B: run completed",
        "freeze: A (SIGSTOP), past its lease",
        "expiry of A's lease",
        "takeover: B takes A's run over after A's lease ran out",
        "A wakes: OWNERSHIP_LOST",
    ]
    svg = shown.svg()
    assert "frozen (SIGSTOP)" in svg and "wakes: OWNERSHIP_LOST" in svg
    bundle = shown._repr_mimebundle_()
    assert set(bundle) == {"image/svg+xml", "text/plain"}
    assert "freeze" in bundle["text/plain"] and "takeover" in bundle["text/plain"]


def test_the_elements_do_not_depend_on_timing() -> None:
    story = frozen()
    later = frozen()
    for lane in later.lanes:
        lane.lease_from = lane.lease_from and lane.lease_from + 100
        lane.lease_until = lane.lease_until and lane.lease_until + 100.7
        lane.runs = [Run(r.started + 100.3, r.finished + 100.9, r.status) for r in lane.runs]
    later.takeover += 100.8
    later.frozen = (later.frozen[0] + 100, later.frozen[1] + 101)
    later.woke = (later.woke[0] + 101.5, later.woke[1])

    assert lease_picture(later).elements == lease_picture(story).elements


def test_a_takeover_is_read_off_the_runs_table() -> None:
    import pandas as pd

    from sophos_lab.lab.pictures.lease import takeover

    runs = pd.DataFrame([
        {"status": "interrupted", "started_at": "2023-11-14T22:13:20.000000+00:00",
         "finished_at": "2023-11-14T22:13:21.500000+00:00"},
        {"status": "completed", "started_at": "2023-11-14T22:13:21.500000+00:00",
         "finished_at": "2023-11-14T22:13:22.000000+00:00"},
    ])
    # The lease was last written a moment before the run's recorded start (two clocks, one write):
    # its last renewal is drawn all the same.
    story = takeover(runs, deadline=T + 14.99, lease_seconds=15.0, scenario="A killed", killed=T + 1.0)

    assert story.takeover == T + 1.5 and story.lanes[0].lease_from == T
    assert [run.status for lane in story.lanes for run in lane.runs] == ["interrupted", "completed"]
    assert lease_picture(story).elements == [
        "A: lease", "A: run interrupted", "B: run completed",
        "kill: A (SIGKILL), with time left on its lease",
        "expiry of A's lease",
        "takeover: B takes A's run over before A's lease ran out",
    ]
    assert "last renewal" in lease_picture(story).svg()
