"""Run a script under torchrun in a subprocess, with a timeout: used by tests and notebooks.

A notebook kernel cannot host several ranks (functions defined in a cell cannot be pickled into
spawned processes), and a test must never hang, so both launch the real script the way a learner
does, `python -m torch.distributed.run --standalone --nproc_per_node=N script args...`, and read
what it printed or wrote.

CPU only unless asked: every launch hides the GPUs from the job (CUDA_VISIBLE_DEVICES="") so that
tests and notebooks run gloo on the CPU, and print what their stored outputs say, on a machine with
GPUs too. Pass use_gpus=True (benchmarks/gpu_smoke.py, lab 5's sweep driver) to let the job see the
GPUs the caller sees.

Launch log: with DDP_COURSE_LAUNCH_LOG=PATH in the environment, every command run here appends one JSON
line to PATH (the script, its exit status, whether it aborted at exit, the test that launched it), so a
whole `pytest --nbval` run can be counted: `python benchmarks/teardown_stability.py --from-log PATH`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Variables that describe a surrounding torchrun job; a nested launch must not inherit them.
_JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
# An empty list of devices: CUDA then reports no GPU, so every lab's `--backend auto` picks gloo/CPU.
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


LAUNCH_LOG_VARIABLE = "DDP_COURSE_LAUNCH_LOG"
# What a gloo worker prints when it crashes during interpreter shutdown, after its work is done: a
# teardown bug that teardown_distributed() avoids (none in over 400 launches since); the launch log
# and benchmarks/teardown_stability.py count it, so it cannot come back unseen.
GLOO_EXIT_ABORT = "terminate called without an active exception"


@dataclass
class RunResult:
    command: list[str]
    returncode: int | None  # None when the run was killed for exceeding its timeout
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def aborted_at_exit(self) -> bool:
        """True when a rank died of gloo's exit crash (see GLOO_EXIT_ABORT), not of its own error."""
        return not self.ok and GLOO_EXIT_ABORT in self.stderr

    def stderr_tail(self, lines: int = 20) -> str:
        """The last lines the job wrote to stderr: where a failed job says why (torchrun's report ends it)."""
        return "\n".join(self.stderr.rstrip().splitlines()[-lines:])

    def describe(self) -> str:
        """Everything a failing test should show: the command, the status and both streams."""
        status = "timed out" if self.timed_out else f"exit status {self.returncode}"
        return f"$ {' '.join(self.command)}\n[{status} after {self.wall_s:.1f} s]\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def show_failures(*results: RunResult, expected: int = 0, lines: int = 20) -> None:
    """In a notebook cell: for every job that did not exit with `expected`, print why (its stderr's last lines).

    A job that ends as expected prints nothing here, so a cell's stored output stays the same; one that
    fails explains itself to the learner and in nbval's diff, instead of showing only a wrong status.
    """
    for result in results:
        if result.returncode == expected:
            continue
        status = "timed out" if result.timed_out else f"exit status {result.returncode}"
        print(f"--- {status} (expected {expected}); the last lines of its stderr:")
        print(result.stderr_tail(lines) or "(nothing on stderr)")


def torchrun_command(script: str | Path, args=(), nproc: int = 2, torchrun_args=()) -> list[str]:
    """The command line a learner would type, with this interpreter's torchrun module."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        *map(str, torchrun_args), str(script), *map(str, args),
    ]  # fmt: skip


def run_torchrun(
    script: str | Path,
    args=(),
    nproc: int = 2,
    timeout_s: float = 120,
    threads_per_rank: int | None = 1,
    env: dict | None = None,
    torchrun_args=(),
    cwd: str | Path | None = None,
    use_gpus: bool = False,
) -> RunResult:
    """Launch script under torchrun with nproc ranks; kill the whole job if it runs past timeout_s.

    threads_per_rank fixes OMP_NUM_THREADS for every rank (torchrun would set 1 and print a warning
    about it) so that timings with different numbers of ranks compare fairly. The job sees no GPU
    unless use_gpus=True (see the module docstring).
    """
    command = torchrun_command(script, args, nproc, torchrun_args)
    return run_command(command, timeout_s=timeout_s, threads_per_rank=threads_per_rank, env=env, cwd=cwd, use_gpus=use_gpus)


def start_in_background(script: str | Path, args=(), nproc: int = 2, timeout_s: float = 180, **options) -> "Future[RunResult]":
    """Start run_torchrun(script, args, nproc, ...) in a background thread; `.result()` waits for it.

    A lecture starts its slow job (several seconds of process start-up and torch imports per rank) in
    its first code cell and reads the result sections later, so the reader never waits for it.
    """
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrun")
    future = pool.submit(run_torchrun, script, args, nproc=nproc, timeout_s=timeout_s, **options)
    pool.shutdown(wait=False)  # the thread ends with the job; nothing else will be submitted
    return future


def run_command(command: list[str], timeout_s: float = 120, threads_per_rank: int | None = 1, env=None, cwd=None, use_gpus: bool = False) -> RunResult:
    """Run a command in its own process group; on timeout kill the group (torchrun and its workers).

    threads_per_rank=None leaves OMP_NUM_THREADS as the caller's environment has it.
    """
    full_env = child_environment(os.environ, threads_per_rank, env, use_gpus)
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=cwd or REPO_ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, so a timeout can kill every rank
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_job(process)
        stdout, stderr = process.communicate()
        timed_out = True
    result = RunResult(
        command=[str(part) for part in command],
        returncode=None if timed_out else process.returncode,
        stdout=stdout,
        stderr=stderr,
        wall_s=time.perf_counter() - start,
        timed_out=timed_out,
    )
    if os.environ.get(LAUNCH_LOG_VARIABLE):
        append_to_launch_log(os.environ[LAUNCH_LOG_VARIABLE], result)
    return result


def append_to_launch_log(path: str | Path, result: RunResult) -> None:
    """One JSON line per finished command (see the module docstring), written in one call."""
    script = next((Path(part).name for part in result.command if part.endswith(".py")), Path(result.command[-1]).name)
    record = {
        "script": script,
        "returncode": result.returncode,
        "timed_out": result.timed_out,
        "aborted_at_exit": result.aborted_at_exit,
        # torchrun's report of a rank that crashed (lab 7's injected faults use SIGKILL: not a crash here)
        "killed_by_signal": any(f"Signal {n} (SIG{name})" in result.stderr for n, name in ((6, "ABRT"), (11, "SEGV"))),
        "wall_s": round(result.wall_s, 2),
        "launched_by": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] or Path(sys.argv[0]).name,
    }
    with open(path, "a") as log:  # append mode: lines from parallel launches do not interleave
        log.write(json.dumps(record) + "\n")


def child_environment(parent: dict, threads_per_rank: int | None, env: dict | None, use_gpus: bool) -> dict:
    """The environment a launched job gets: the parent's, minus any surrounding torchrun job's
    variables, with unbuffered output, the thread count, no GPUs unless use_gpus, then env on top
    (an explicit env entry, CUDA_VISIBLE_DEVICES included, wins)."""
    full_env = {k: v for k, v in parent.items() if k not in _JOB_VARIABLES}
    full_env["PYTHONUNBUFFERED"] = "1"  # ranks' lines arrive as they are printed, also on a timeout
    if threads_per_rank is not None:
        full_env["OMP_NUM_THREADS"] = str(threads_per_rank)
    if not use_gpus:
        full_env.update(HIDE_GPUS)
    full_env.update(env or {})
    return full_env


def kill_job(process: subprocess.Popen, grace_s: float = 5) -> None:
    """Stop a launched job and every process it started.

    SIGTERM first: torchrun forwards it to its workers and exits. torchrun starts each worker in a
    session of its own, so a worker that outlives it would escape a process-group kill and keep our
    output pipes open; hence the SIGKILL to every descendant found before we started killing.
    """
    descendants = descendant_pids(process.pid)
    _signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(process.pid, signal.SIGKILL)
    for pid in descendants:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def descendant_pids(root_pid: int) -> list[int]:
    """Children, grandchildren... of root_pid, read from /proc (Linux); [] where there is no /proc."""
    parent_of = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Format: "pid (command) state ppid ..."; the command may contain spaces and parentheses.
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            parent_of[int(stat_file.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    found, frontier = [], [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parent_of.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def import_script(path: str | Path, name: str | None = None):
    """Import a lab or benchmark script as a module, to call its functions in this process.

    Its `if __name__ == "__main__":` block does not run, so nothing is launched. The module is
    registered in sys.modules under its name, as a normal import would be (dataclasses look it up there).
    While its own imports run, its folder comes first on sys.path, as it does when Python runs the file:
    a script imports a file beside it (lab 8 and lab 9 `import minizero2`) the same way in both cases.
    """
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)  # the first occurrence: the one inserted above
    return module


class SheetJobs:
    """The jobs of a notebook: one temporary folder for their files, a few running at once, each with a timeout.

    A sheet starts the jobs it needs in its first code cell and reads each one where it teaches from
    it, so the reader never waits for process start-up (several seconds of torch imports per rank):

        jobs = SheetJobs("lab2_sheet_")                          # jobs.out: a fresh temporary folder
        two = jobs.start(LAB2, "--json", jobs.out / "two.json")  # returns at once; two.result() waits
        alone = jobs.start(LAB2, "--resume", nproc=1, after=two) # starts once `two` has ended (its files)
        report = jobs.read_json("two.json")                      # after two.result()

    Jobs beyond `at_once` queue, in the order started: on a few CPU cores more jobs at once only slow
    each other down. Every job gets a timeout (run_torchrun's), so a sheet never hangs; arguments may
    be paths or numbers.
    """

    def __init__(self, prefix: str, nproc: int = 2, use_gpus: bool = False, timeout_s: float = 180, at_once: int = 3):
        import tempfile
        from concurrent.futures import ThreadPoolExecutor

        self.out = Path(tempfile.mkdtemp(prefix=prefix))  # every file the sheet's jobs write goes here
        self.nproc, self.use_gpus, self.timeout_s = nproc, use_gpus, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="sheet_job")

    def start(self, script: str | Path, *args, nproc: int | None = None, after: "Future | None" = None, **options) -> "Future[RunResult]":
        """torchrun --standalone --nproc_per_node=nproc script args... in the background; `.result()` waits.

        after: a job started earlier that this one must wait for (it reads that job's files). options:
        run_torchrun's own (env, torchrun_args, timeout_s), for this job only."""
        return self._pool.submit(_after, after, self.run, script, *args, nproc=nproc, **options)

    def run(self, script: str | Path, *args, nproc: int | None = None, **options) -> RunResult:
        """The same job, now: returns when it has ended (or was killed at the timeout)."""
        options = {"timeout_s": self.timeout_s, "use_gpus": self.use_gpus, **options}
        return run_torchrun(script, [str(arg) for arg in args], nproc=nproc or self.nproc, **options)

    def start_command(self, *command, after: "Future | None" = None, **options) -> "Future[RunResult]":
        """A command that is not a torchrun launch (`python script.py`, or lab 5's sweep driver, which launches
        torchrun itself), in the same queue and with the same timeout; `.result()` waits."""
        options = {"timeout_s": self.timeout_s, "use_gpus": self.use_gpus, **options}
        return self._pool.submit(_after, after, run_command, [str(part) for part in command], **options)

    def read_json(self, name: str):
        """A JSON file a job wrote into self.out (its --json report, say)."""
        return json.loads((self.out / name).read_text())


def _after(earlier: "Future | None", function, *args, **kwargs):
    """Wait for an earlier job, then run. The earlier one was queued first, so it holds a thread or has ended."""
    if earlier is not None:
        earlier.result()
    return function(*args, **kwargs)


def verdict_lines(stdout: str, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The PASS / FAIL / SKIP lines of a lab's output, in order, without those that mention a leave_out word."""
    return [line for line in stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP") and not any(word in line for word in leave_out)]


# --- reading what a job printed ------------------------------------------------------------------


def lines_by_rank(text: str) -> dict[int, list[str]]:
    """{rank: its lines, in order} from the "[rank r] ..." lines of a job's output (ddp_course.distributed.log)."""
    import re

    lines: dict[int, list[str]] = {}
    for rank, line in re.findall(r"^\[rank (\d+)\] (.*)$", text, flags=re.MULTILINE):
        lines.setdefault(int(rank), []).append(line)
    return dict(sorted(lines.items()))


def rank_errors(stderr: str) -> list[str]:
    """The distinct exceptions a torchrun job's ranks printed ("[rankN]: SomeError: ..."), sorted, without
    the source-file prefix gloo puts in front of its messages ("[../gloo/transport/...] ")."""
    import re

    found = re.findall(r"^\[rank\d+\]: (\w+(?:Error|Exception): .*)$", stderr, flags=re.MULTILINE)
    return sorted({re.sub(r"\[[^\]]*\]\s*", "", line) for line in found})


def detail_mismatches(text: str) -> dict[int, tuple[int, str]]:
    """{rank: (position of its collective in its sequence, from 0; the collective's type)} from the
    "Detected mismatch between collectives" reports of TORCH_DISTRIBUTED_DEBUG=DETAIL: each rank's report
    starts with its own collective (what it says about its peer is the checker's own exchange)."""
    import re

    own = re.compile(r"\[rank (\d+)\] Detected mismatch.*?Rank \d+ is running collective: "
                     r"CollectiveFingerPrint\(SequenceNumber=(\d+),? ?OpType=(\w+)")  # fmt: skip
    return {int(rank): (int(position), operation) for rank, position, operation in sorted(own.findall(text))}


def copy_with_line_after(script: str | Path, anchor: str, line: str, folder: str | Path) -> Path:
    """Write a copy of script into folder with `line` inserted after the one line that equals `anchor`.

    How a sheet adds a logging probe to a script without editing it. ValueError when the anchor is not
    exactly one line of the script (the script changed: the probe would go to the wrong place).
    """
    script = Path(script)
    lines = script.read_text().splitlines(keepends=True)
    matches = [index for index, text in enumerate(lines) if text.rstrip("\n") == anchor.rstrip("\n")]
    if len(matches) != 1:
        raise ValueError(f"{script.name}: the anchor line occurs {len(matches)} times, not once: {anchor.strip()!r}")
    lines.insert(matches[0] + 1, line if line.endswith("\n") else line + "\n")
    copy = Path(folder) / script.name
    copy.write_text("".join(lines))
    return copy


# --- ports -------------------------------------------------------------------------------------------
# The ports the kernel hands out by itself, to every socket that binds port 0 (gloo's listeners,
# srun's, get_free_port()'s): Linux's default is 32768-60999, but busy servers and some Kubernetes
# nodes widen it (1024-65535, 15000-65000), so it is read, not assumed.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL_RANGE = (49152, 65535)  # where there is no such file (macOS, Windows): their default
# Below this port sit many services' fixed ports (5432, 6379, 8080, 8888...): never picked.
QUIET_FLOOR = 10000
_PICK = random.SystemRandom()  # not the seeded `random`: seeded processes would all pick the same ports


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """(first, last) of this host's ephemeral port range, as the kernel reads it."""
    try:
        first, last = map(int, path.read_text().split())
    except (OSError, ValueError):
        return IANA_EPHEMERAL_RANGE
    return first, last


def quiet_ports(ephemeral: tuple[int, int] | None = None) -> list[int]:
    """The ports from QUIET_FLOOR to 65535 outside the ephemeral range (default: this host's).

    The kernel never hands these out by itself, so one that is free now stays free until it is
    bound by number. A port from the ephemeral range, however free now, goes to the next socket
    that binds port 0 as easily as to us: labs/slurm/lab3.sbatch says how that once failed a job.
    """
    first, last = ephemeral or ephemeral_port_range()
    below, above = range(QUIET_FLOOR, min(first, 65536)), range(max(last + 1, QUIET_FLOOR), 65536)  # either may be empty
    return [*below, *above]


def free_port(host: str = "127.0.0.1", ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port free on host now, outside its ephemeral range (quiet_ports); bind to it soon, as it is not reserved."""
    candidates = quiet_ports(ephemeral)
    first, last = ephemeral or ephemeral_port_range()
    if not candidates:
        raise OSError(f"every port from {QUIET_FLOOR} to 65535 is in this host's ephemeral range ({first}-{last}, "
                      f"{EPHEMERAL_RANGE_FILE}): no port is safe from the next socket that binds port 0")  # fmt: skip
    for port in _PICK.sample(candidates, min(64, len(candidates))):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:  # in use: try another
                continue
            return port
    raise OSError(f"no free port among 64 tries from {QUIET_FLOOR} to 65535 outside {first}-{last} on {host}")


def port_is_open(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


def wait_until(condition, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll condition() until it is true (True) or timeout_s passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return bool(condition())
