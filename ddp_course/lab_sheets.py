"""The lab sheets' plumbing behind one-line calls: the jobs a sheet starts, a script's lines, a job's log.

A lab sheet starts every job it needs in its first code cell, in the background (ddp_course.launch's
SheetJobs: a timeout each, so nothing can hang), and each section reads its own job's result. What
the sheet must show stays in the sheet: `start_lab3_jobs` prints every command line it starts the way
a learner types it from the repository root (`torchrun --standalone --nproc_per_node=2 labs/...`),
with the jobs' temporary folder written WORKDIR.

    jobs = start_lab3_jobs(nproc=2, use_gpus=False)    # lab 3: prints the six command lines
    straight = jobs.straight.result()                  # section 3 waits for its job here
    print_lines(lab3.train, "sampler.set_epoch", "optimizer.zero_grad")  # a script's lines, numbered
    model_sizes = configuration_sizes(lab5.CONFIGS)    # lab 5: parameters, gradient bytes, FLOPs
    plot_learning_curves(metrics, single_curve)        # a sheet's figure: the data in the sheet, the drawing here
"""

from __future__ import annotations

import inspect
import shlex
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ddp_course.checkpoint import checkpoint_path, list_checkpoints
from ddp_course.launch import REPO_ROOT, RunResult, SheetJobs, torchrun_command
from ddp_course.models import build_model, train_flops_per_sample

WORKDIR = "WORKDIR"  # how a job's temporary folder is written in what a sheet prints (it changes every run)


# --- showing a script and what a job printed -----------------------------------------------------------


def print_lines(function, first: str, last: str) -> None:
    """Print function's source from the line containing `first` to the next one containing `last`,
    each with its line number in the file (the sheet's text can then point at line 177)."""
    lines, start = inspect.getsourcelines(function)
    begin = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(begin, len(lines)) if last in lines[i])
    print("".join(f"{start + i:4d} {lines[i]}" for i in range(begin, end + 1)), end="")


def show_log(result: RunResult, workdir: str | Path) -> None:
    """Print what a job printed, its temporary folder written WORKDIR; the "[rank r]" lines first and
    sorted, as the ranks print them in any order."""
    lines = result.stdout.replace(str(workdir), WORKDIR).splitlines()
    by_rank = sorted(line for line in lines if line.startswith("[rank "))
    print("\n".join(by_rank + [line for line in lines if not line.startswith("[rank ")]))


def as_typed(command: list, workdir: str | Path | None = None) -> str:
    """A launched command as a learner types it from the repository root: `torchrun` for this
    interpreter's torch.distributed.run, `python` for this interpreter, paths relative to the
    repository, the jobs' temporary folder written WORKDIR."""
    words = [str(word) for word in command]
    if words[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    elif words[:1] == [sys.executable]:
        words = ["python", *words[1:]]
    words = [word.removeprefix(f"{REPO_ROOT}/") for word in words]
    if workdir is not None:
        words = [word.replace(str(workdir), WORKDIR) for word in words]
    return shlex.join(words)


# --- lab 3: the sheet's six jobs and its figure -------------------------------------------------------

LAB3 = REPO_ROOT / "labs" / "lab3_ddp.py"
CRASH_AFTER_STEP = 30  # section 4: the step after which a crash is simulated


@dataclass
class Lab3Jobs:
    """The lab 3 sheet's jobs, started in the background: each `.result()` waits for its job's RunResult."""

    out: Path  # every file the jobs write (WORKDIR in what the sheet prints)
    checkpoints: Path  # the DDP job's checkpoints, every epoch and every 30 steps (section 4)
    straight: Future  # section 3: the DDP job, 46 steps (2 epochs), its metrics, weights and checkpoints
    single: Future  # section 3: one process on the same global batch, without torchrun
    accumulated: Future  # section 3: 2 ranks x 3 micro-batches of 64, 6 steps
    one_process: Future  # section 3: one process on the batch of 384, 6 steps
    bad: Future  # section 5: a mistake on the command line, `--lr -1`
    resumed: Future  # section 4: (names of the checkpoints a crash after step 30 leaves, the resumed job's RunResult)


def start_lab3_jobs(nproc: int = 2, use_gpus: bool = False) -> Lab3Jobs:
    """Start every job of the lab 3 sheet (3 at a time; the resume once the DDP job has ended) and print
    their command lines. nproc: ranks per DDP job; the one-process jobs take nproc x the per-rank batch."""
    jobs = SheetJobs("lab3_sheet_", nproc=nproc, use_gpus=use_gpus)  # 3 jobs at a time; every file in jobs.out
    out, checkpoints = jobs.out, jobs.out / "checkpoints"
    curve = ["--max-steps", 46, "--log-every", 2]  # 2 epochs of the digits, a loss point every 2 steps
    runs = {  # name: (torchrun or not, arguments)
        "straight": (True, [*curve, "--metrics-json", out / "metrics.json", "--save", out / "straight.pt",
                            "--checkpoint-dir", checkpoints, "--checkpoint-every", CRASH_AFTER_STEP]),
        "single": (False, [*curve, "--batch-size", 32 * nproc, "--metrics-json", out / "single.json"]),
        "accumulated": (True, ["--batch-size", 64, "--accumulation-steps", 3, "--max-steps", 6,
                               "--save", out / "accumulated.pt", "--metrics-json", out / "accumulated.json"]),
        "one_process": (False, ["--batch-size", 64 * 3 * nproc, "--max-steps", 6, "--save", out / "one_process.pt"]),
        "bad": (True, ["--lr", -1]),
    }  # fmt: skip
    started, commands = {}, []
    for name, (distributed, args) in runs.items():
        if distributed:
            started[name] = jobs.start(LAB3, *args)
            commands.append(torchrun_command(LAB3, args, nproc))
        else:
            started[name] = jobs.start_command(sys.executable, LAB3, *args)
            commands.append([sys.executable, LAB3, *args])
    kept_dir = out / "left_by_crash"
    resume_args = ["--max-steps", 46, "--checkpoint-dir", kept_dir, "--resume", "--save", out / "resumed.pt"]
    resumed = _in_background(_resume_after_a_crash, jobs, started["straight"], checkpoints, kept_dir, resume_args)
    print("Started in the background (WORKDIR: their temporary folder); each section waits for its own:")
    for command in commands:
        print(" ", as_typed(command, out))
    print(f"  then, once the first has ended: its checkpoints up to step {CRASH_AFTER_STEP} copied to WORKDIR/left_by_crash, and")
    print(" ", as_typed(torchrun_command(LAB3, resume_args, nproc), out))
    return Lab3Jobs(out, checkpoints, resumed=resumed, **started)


def _resume_after_a_crash(jobs: SheetJobs, straight: Future, checkpoints: Path, kept_dir: Path, resume_args: list):
    """Section 4: keep only the checkpoints a crash right after step 30 would leave, and resume from them."""
    straight.result()
    kept_dir.mkdir()
    last_kept = checkpoint_path(checkpoints, CRASH_AFTER_STEP)
    kept = [shutil.copy(path, kept_dir) for path in list_checkpoints(checkpoints) if path <= last_kept]  # zero-padded steps
    return [Path(path).name for path in kept], jobs.run(LAB3, *resume_args)


def _in_background(function, *args) -> Future:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sheet_resume")
    future = pool.submit(function, *args)
    pool.shutdown(wait=False)  # the thread ends with the function; nothing else is submitted
    return future


def plot_learning_curves(metrics: dict, single_curve: list[dict]) -> None:
    """Section 3's figure: the DDP job's train loss laid over one process's on the same global batch
    (the --metrics-json "history" points), and the held-out accuracy after each epoch."""
    import matplotlib.pyplot as plt

    ddp_curve = metrics["history"]
    fig, (ax_loss, ax_accuracy) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax_loss.semilogy(
        [e["step"] for e in single_curve],
        [e["train_loss"] for e in single_curve],
        lw=4,
        alpha=0.4,
        color="tab:orange",
        label=f"1 process x {metrics['global_batch_size']}",
    )
    ax_loss.semilogy(
        [e["step"] for e in ddp_curve],
        [e["train_loss"] for e in ddp_curve],
        marker=".",
        color="tab:blue",
        label=f"DDP: {metrics['world_size']} ranks x {metrics['per_rank_batch_size']}",
    )
    ax_loss.set(xlabel="optimizer step", ylabel="train loss (job-wide, per 2 steps)", title="same global batch, same curve")
    ax_loss.legend()
    epochs = metrics["epochs"]
    ax_accuracy.plot([e["step"] for e in epochs], [100 * e["eval_accuracy"] for e in epochs], marker="o", color="tab:green")
    ax_accuracy.set(xlabel="optimizer step", ylabel="held-out accuracy (%)", title="all 359 held-out digits, per epoch")
    fig.tight_layout()
    plt.show()


# --- lab 5: the configurations' sizes, the reference run's figure ----------------------------------


def configuration_sizes(configs: dict) -> dict[str, dict]:
    """{name: parameters, fp32 gradient MB, training GFLOP per sample, FLOP per gradient byte} for lab 5's configurations
    (a name -> config with .model and .input_shape); FLOPs counted by torch (ddp_course.models)."""
    sizes = {}
    for name, config in configs.items():
        parameters = sum(p.numel() for p in build_model(config.model).parameters())
        flops = train_flops_per_sample(config.model, config.input_shape)
        sizes[name] = {
            "parameters": parameters,
            "gradient_mb": parameters * 4 / 1e6,
            "train_gflop_per_sample": flops / 1e9,
            "flop_per_gradient_byte": flops / (parameters * 4),
        }
    return sizes


def sizes_table(configs: dict, sizes: dict[str, dict]) -> str:
    """One line per configuration: model, per-rank batch, parameters, gradient MB, GFLOP per sample and
    FLOP per gradient byte (the column that decides how it scales)."""
    lines = []
    for name, config in configs.items():
        size = sizes[name]
        lines.append(f"{name:<14} {config.model:<9} batch {config.batch_size:>3} per rank  {size['parameters'] / 1e6:6.2f} M parameters"
                     f"  {size['gradient_mb']:6.2f} MB of fp32 gradients  {size['train_gflop_per_sample']:6.3f} GFLOP per sample (train)"
                     f"  {size['flop_per_gradient_byte']:8.1f} FLOP per gradient byte")  # fmt: skip
    return "\n".join(lines)


def plot_weak_scaling(records: list[dict], targets=(0.85, 0.6)) -> None:
    """Section 4's figure: throughput on 1 and 2 ranks against the ideal (dotted), and each configuration's
    2-rank efficiency against the targets (compute_bound's, dashed; comm_bound's, dotted)."""
    import matplotlib.pyplot as plt

    fig, (throughput_axes, efficiency_axes) = plt.subplots(1, 2, figsize=(10, 3.8))
    for config, colour in [("compute_bound", "tab:blue"), ("comm_bound", "tab:red")]:
        points = sorted((r for r in records if r["config"] == config), key=lambda r: r["world_size"])
        sizes = [r["world_size"] for r in points]
        throughput_axes.plot(sizes, [r["samples_per_s"] for r in points], "o-", color=colour, label=config)
        throughput_axes.plot(sizes, [n * points[0]["samples_per_s"] for n in sizes], ":", color=colour)
        efficiency_axes.bar([f"{config}\nN={sizes[-1]}"], [points[-1]["weak_scaling_efficiency"]], color=colour)
    throughput_axes.set(
        xlabel="ranks", ylabel="samples / s (dotted: ideal)", xticks=sorted({r["world_size"] for r in records}), title="throughput, reference run"
    )
    throughput_axes.legend()
    for target, style in zip(targets, ("--", ":")):
        efficiency_axes.axhline(target, color="grey", ls=style, lw=1)
    efficiency_axes.set(ylim=(0, 1.05), ylabel="weak scaling efficiency", title=f"targets: {targets[0]} (dashed), {targets[1]} (dotted)")
    fig.tight_layout()
    plt.show()
