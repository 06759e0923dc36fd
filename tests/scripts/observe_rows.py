"""Several observed jobs in one torchrun launch, for the checkers' tests: the launching side.

Most of an observed job is Python, torch and torch._dynamo start-up (about 10 CPU-seconds for the
agent and 2 ranks), and the two checkers' planted mistakes are dozens of short jobs of the same kind.
ddp_course/checking/observer.py --runs runs them one after another in the same ranks, each exactly as its own
launch would (its own Recorder, output files, process group under a store prefix of its own, and its
checker's observer settings, which apply to that run only); ddp_course/checking/lab4.py's observe_runs()
writes the runs file, launches it, and reads each run back as the Observation that the checker's
own observe() would have given, for the checker to judge. Here a row is named and made from a
checker's own settings.
"""

from __future__ import annotations

from pathlib import Path


def observe_in_one_launch(lab4, jobs: dict, folder: Path, timeout_s: float, nodes: int = 1, world_size: int | None = None, env=None) -> dict:
    """{name: Observation} of each job, observed as lab4.observe would, all in one torchrun launch, in order.

    lab4 is ddp_course.checking.lab4; jobs is {name: (script, script_args, env)} or {name: (script,
    script_args, env, copy)}: script_args(out_dir) gives the script's flags, env the checker's own
    observer settings for that row only ({} for lab 4's), copy(out_dirs) the files to copy before the
    row ([[source, target]], e.g. an earlier row's checkpoint); timeout_s bounds the whole launch;
    nodes: the launch runs as that many nodes on this host, world_size ranks in all (lab4.run_job; None:
    lab 4's WORLD_SIZE); env: more environment variables for the whole launch (its processes start with them).
    """
    out_dirs = {name: folder / f"{name}-observed" for name in jobs}
    runs = []
    for name, (script, script_args, row_env, *copy) in jobs.items():
        run = {"name": name, "out_dir": out_dirs[name], "script": script, "args": script_args(out_dirs[name]), "env": dict(row_env)}
        if copy:
            run["copy"] = [[str(source), str(target)] for source, target in copy[0](out_dirs)]
        runs.append(run)
    return lab4.observe_runs(runs, folder, timeout_s, nodes, env=env, world_size=world_size or lab4.WORLD_SIZE)
