"""Lab 10: the per-rank timeline of four training steps, before and after the fixes.

The data are two runs of `python -m ddp_course.timeline` on 2 gloo ranks (solutions/lab10_reference/broken
and .../fixed: labs/lab10_slow_ddp.py and solutions/lab10_slow_ddp.py, 10 steps each, recorded on the
course's 2-core machine while other jobs shared it). Each bar is one step of one rank, split into the
timeline's categories (ddp_course.timeline.split_step); the two panels share no scale, since the
broken steps are several times longer.
"""

from __future__ import annotations

from pathlib import Path

from ddp_course.timeline import CATEGORIES, COLOURS, read_run, split_step, summarize

NAME = "lab10_timeline"
TITLE = "Lab 10: where four steps' time went on each of 2 ranks, before and after the fixes (measured)"
DATA = Path(__file__).resolve().parent.parent.parent / "solutions" / "lab10_reference"
STEPS = range(2, 6)  # past DDP's bucket rebuild in step 1
PANELS = {"broken": "labs/lab10_slow_ddp.py (before)", "fixed": "solutions/lab10_slow_ddp.py (after)"}


def describe() -> dict:
    """Per panel and rank, each shown step's segments (category, start ms, length ms) on the panel's clock,
    and the run's counts: threads, all-reduce calls and buckets per step."""
    panels = {}
    for key, title in PANELS.items():
        records = read_run(DATA / key, 2)
        first = min(records[rank]["steps"][STEPS[0]]["start"] for rank in records)
        bars = {}
        for rank in sorted(records):
            segments = []
            for index in STEPS:
                at = round((records[rank]["steps"][index]["start"] - first) * 1e3, 2)
                for category, seconds in split_step(records, index)[rank].items():
                    segments.append([category, at, round(seconds * 1e3, 2)])
                    at = round(at + seconds * 1e3, 2)
            bars[str(rank)] = segments
        ranks = summarize(records)["ranks"]
        panels[key] = {"title": title, "bars": bars,
                       "facts": {str(r): {k: v[k] for k in ("threads", "allreduce_calls_per_step", "buckets_per_round")} for r, v in ranks.items()}}  # fmt: skip
    return {"source": "solutions/lab10_reference/{broken,fixed} (python -m ddp_course.timeline, 2 gloo ranks)",
            "steps": list(STEPS), "categories": list(CATEGORIES), "panels": panels}  # fmt: skip


def draw(description: dict):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 4.2))
    for ax, (key, panel) in zip(axes, description["panels"].items()):
        for rank, segments in panel["bars"].items():
            for category, start, length in segments:
                ax.barh(int(rank), length, left=start, color=COLOURS[category], edgecolor="white", linewidth=0.4)
        facts = panel["facts"]["0"]
        ax.set_title(f"{panel['title']}: {facts['threads']} threads/rank, {facts['allreduce_calls_per_step']} all-reduce calls "
                     f"per step in {facts['buckets_per_round']} bucket(s)", fontsize=9)  # fmt: skip
        ax.set_yticks([int(r) for r in panel["bars"]], [f"rank {r}" for r in panel["bars"]])
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[c]) for c in description["categories"]]
    fig.legend(handles, description["categories"], loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
