"""ddp_course.lab_sheets: the lab 3 and lab 5 sheets' plumbing behind one-line calls.

In-process: run_torchrun and run_command are replaced by fakes that record their calls, so these tests
launch nothing (the sheets' own nbval runs launch the real jobs through the same code).
"""

import inspect
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddp_course import launch
from ddp_course.checkpoint import checkpoint_path
from ddp_course.lab_sheets import as_typed, configuration_sizes, print_lines, show_log, sizes_table, start_lab3_jobs
from ddp_course.launch import REPO_ROOT, RunResult, torchrun_command


def test_a_command_is_printed_as_a_learner_types_it_from_the_repository_root(tmp_path):
    script = REPO_ROOT / "labs" / "lab3_ddp.py"
    assert as_typed(torchrun_command(script, ["--lr", -1], nproc=2)) == "torchrun --standalone --nproc_per_node=2 labs/lab3_ddp.py --lr -1"
    assert as_typed([sys.executable, script, "--save", tmp_path / "a.pt"], tmp_path) == "python labs/lab3_ddp.py --save WORKDIR/a.pt"
    assert as_typed(["sh", "-c", "a b"]) == "sh -c 'a b'"  # quoted where a shell needs it


def test_a_jobs_log_shows_the_ranks_lines_sorted_first_and_no_temporary_folder(tmp_path, capsys):
    stdout = f"[rank 1] trains on cpu\nconfig: save={tmp_path}/x.pt\n[rank 0] trains on cpu\nepoch 1/2\n"
    show_log(RunResult([], 0, stdout, "", 1.0, False), tmp_path)
    assert capsys.readouterr().out == "[rank 0] trains on cpu\n[rank 1] trains on cpu\nconfig: save=WORKDIR/x.pt\nepoch 1/2\n"


def excerpt_source():
    first = 1
    second = first + 1  # the excerpt starts here
    third = second + 1
    return third  # and ends here


def test_print_lines_prints_the_excerpt_with_the_files_line_numbers(capsys):
    print_lines(excerpt_source, "the excerpt starts", "and ends here")
    lines, start = inspect.getsourcelines(excerpt_source)
    assert capsys.readouterr().out == "".join(f"{start + i:4d} {lines[i]}" for i in (2, 3, 4))
    with pytest.raises(StopIteration):  # an anchor the function does not contain: no silent empty excerpt
        print_lines(excerpt_source, "not in the source", "return")


class FakeLaunches:
    """Stands in for run_torchrun and run_command: records every command, and the DDP job writes the
    checkpoints of steps 23, 30 and 46 (2 epochs, --checkpoint-every 30) into its --checkpoint-dir."""

    def __init__(self):
        self.started, self.lock = [], threading.Lock()

    def run_torchrun(self, script, args=(), nproc=2, timeout_s=120, use_gpus=False, **_):
        args = [str(arg) for arg in args]
        with self.lock:
            self.started.append(("torchrun", nproc, args))
        if "--checkpoint-dir" in args and "--resume" not in args:
            time.sleep(0.2)  # the resume must wait for this job's checkpoints
            folder = Path(args[args.index("--checkpoint-dir") + 1])
            folder.mkdir(parents=True)  # as the lab does
            for step in (23, 30, 46):
                checkpoint_path(folder, step).write_bytes(b"weights")
        return RunResult([str(script), *args], 0, "", "", 0.0, False)

    def run_command(self, command, timeout_s=120, use_gpus=False, **_):
        with self.lock:
            self.started.append(("python", None, [str(part) for part in command[2:]]))
        return RunResult(command, 0, "", "", 0.0, False)


@pytest.mark.timeout(30)
def test_lab3s_jobs_start_as_printed_and_the_resume_gets_only_what_a_crash_after_step_30_leaves(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the sheet's folder lands in pytest's
    fake = FakeLaunches()
    monkeypatch.setattr(launch, "run_torchrun", fake.run_torchrun)
    monkeypatch.setattr(launch, "run_command", fake.run_command)
    jobs = start_lab3_jobs(nproc=2)
    kept, resumed = jobs.resumed.result(timeout=20)
    results = [getattr(jobs, name).result(timeout=20) for name in ("straight", "single", "accumulated", "one_process", "bad")]
    assert all(result.ok for result in results) and resumed.ok
    assert kept == ["checkpoint_step00000023.pt", "checkpoint_step00000030.pt"]  # not step 46's
    assert sorted(path.name for path in (jobs.out / "left_by_crash").iterdir()) == kept
    # The resume runs last, from the copies, on the DDP job's world size.
    kind, nproc, args = fake.started[-1]
    assert (kind, nproc) == ("torchrun", 2) and args[args.index("--checkpoint-dir") + 1] == str(jobs.out / "left_by_crash")
    assert "--resume" in args
    # What the sheet printed is what was started: one line per job, paths as WORKDIR, the resume last.
    printed = capsys.readouterr().out
    assert str(tmp_path) not in printed
    commands = [line.strip() for line in printed.splitlines() if line.startswith("  ") and "lab3_ddp.py" in line]

    def typed(kind, nproc, args):
        head = f"torchrun --standalone --nproc_per_node={nproc} labs/lab3_ddp.py" if kind == "torchrun" else "python labs/lab3_ddp.py"
        return " ".join([head, *args]).replace(str(jobs.out), "WORKDIR")

    started = [typed(*call) for call in fake.started]  # the first five in any order (3 run at once), the resume last
    assert len(commands) == 6 and sorted(commands[:-1]) == sorted(started[:-1]) and commands[-1] == started[-1]
    # One process trains on the DDP jobs' global batches: 2 x 32 for the curve, 2 x 3 x 64 with accumulation.
    one_process = [args for kind, _, args in fake.started if kind == "python"]
    assert sorted(args[args.index("--batch-size") + 1] for args in one_process) == ["384", "64"]


@dataclass
class Config:
    model: str
    input_shape: tuple
    batch_size: int


def test_configuration_sizes_count_the_models_parameters_and_the_table_shows_them():
    from ddp_course.models import build_model, train_flops_per_sample

    configs = {"compute_bound": Config("conv_net", (3, 32, 32), 64)}
    sizes = configuration_sizes(configs)
    parameters = sum(p.numel() for p in build_model("conv_net").parameters())
    flops = train_flops_per_sample("conv_net", (3, 32, 32))
    assert sizes["compute_bound"]["parameters"] == parameters > 0
    assert sizes["compute_bound"]["gradient_mb"] == parameters * 4 / 1e6  # fp32: 4 bytes per gradient element
    assert sizes["compute_bound"]["flop_per_gradient_byte"] == flops / (parameters * 4)
    [line] = sizes_table(configs, sizes).splitlines()
    assert re.match(r"compute_bound +conv_net +batch +64 per rank +[\d.]+ M parameters", line), line
    assert line.endswith(f"{flops / (parameters * 4):8.1f} FLOP per gradient byte")
