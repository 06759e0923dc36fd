"""Lab 4: the checker finds every planted bug from what the script does, and only that bug.

Each test reads a real torchrun job (2 gloo ranks on the CPU) run under labs/lab4_observe.py and
judged by labs/lab4_check.py. The copies with one bug are made here from the solution, with the same
edits that turn the solution into labs/lab4_broken_ddp.py, so the exercise, the solution and these
tests cannot drift apart.

Nearly all of a job's CPU is start-up (Python and torch imports: about 10 CPU-seconds for torchrun's
agent and 2 ranks), not its 2 epochs of training (issue 22). So the file launches as few jobs as
its proofs need, all at once in one module fixture, `jobs`:

- the learner's command, `python labs/lab4_check.py` on the exercise, end to end (exit status, output);
- ONE launch for the 7 single-bug copies and the solution, row after row in the same 2 ranks
  (tests/scripts/observe_rows.py; each row has its own observer, process group and store keys),
  each judged by the checker's own judge(); bug 5's row is rescued by the observer, and the rows
  after it must pass, so a rescued row is shown not to spoil the next ones;
- the job that hangs and the unrescued exercise, each in a launch of its own: one is killed at the
  checker's limit, the other dies at gloo's timeout, and both spend most of their time waiting while
  the 2 cores run the others;
- the minimal hang under TORCH_DISTRIBUTED_DEBUG=DETAIL.

The bad command lines are parsed in this process (no torch start-up each). The observed ranks read
the checker's saved copy of the digits instead of importing scikit-learn (LAB4_OBSERVE_DIGITS;
test_observed_ranks_read_the_same_digits proves the tensors equal).
"""

import ast
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ddp_course.data import load_digits
from ddp_course.launch import REPO_ROOT, import_script, run_command, run_torchrun

BROKEN = REPO_ROOT / "labs" / "lab4_broken_ddp.py"
SOLUTION = REPO_ROOT / "solutions" / "lab4_broken_ddp.py"
CHECKER = REPO_ROOT / "labs" / "lab4_check.py"
# The launching side of tests/scripts/observe_rows.py (lab 3's checker test shares it)
observe_rows = import_script(REPO_ROOT / "tests" / "scripts" / "observe_rows.py")

# The seven planted bugs, each as the edit that puts it back into the solution: (old text, new text).
BUGS = {
    1: (  # no DistributedSampler in the DataLoader: every rank reads the whole training set, in the same order
        "loader = DataLoader(splits.train, batch_size=args.batch_size, sampler=sampler)",
        "loader = DataLoader(splits.train, batch_size=args.batch_size, shuffle=True)",
    ),
    2: (  # no zero_grad(): gradients accumulate across steps
        "            optimizer.zero_grad(set_to_none=True)  # backward() adds to .grad: clear the last step's\n",
        "",
    ),
    3: (  # saves the DDP wrapper's state_dict: keys start with "module."
        "atomic_save(model.state_dict(), args.save)  # the bare model's weights: keys without \"module.\"",
        "atomic_save(ddp_model.state_dict(), args.save)  # the trained weights",
    ),
    4: (  # no set_epoch(): the same order every epoch
        "        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank\n",
        "",
    ),
    5: (  # a collective called on rank 0 only: rank 0 waits in all_reduce, the others in the barrier
        "        dist.all_reduce(loss_sum)  # every rank joins a collective, also the ranks that print nothing\n",
        "        if ctx.is_main:\n            dist.all_reduce(loss_sum)  # the job's loss, for the log line\n",
    ),
    6: (  # held-out counts never summed over ranks: rank 0 reports the accuracy of its slice
        "    dist.all_reduce(counts)  # sum over ranks: each rank scored its slice, the job's accuracy counts them all\n",
        "",
    ),
    7: (  # the loss divided by the world size on top of DDP's averaging
        "            loss.backward()  # DDP all-reduces: every rank now holds the gradient averaged over ranks\n",
        "            (loss / ctx.world_size).backward()  # each rank contributes 1/world_size of the gradient\n",
    ),
}  # fmt: skip

# What the checker must say about each bug: the check's line matches this (status, then evidence).
EVIDENCE = {
    1: r"FAIL +ranks 0 and 1 both trained on sample \d+ in epoch 0 \(1438 of the 1438 training samples were read by both\)",
    2: r"FAIL +step 2's gradient is step 1's gradient plus that of its own batch",
    3: r"FAIL +its keys start with 'module\.' \('module\.features\.0\.weight'\)",
    4: r"FAIL +rank 0 read the same 719 samples in the same order in epochs 0 and 1",
    5: r"FAIL +rank 0 called all_reduce of a 2-element float32 tensor after optimizer step \d+ \(epoch 0\) while rank 1 called barrier",
    6: r"FAIL +the reported eval_accuracy 0\.\d{4} is the saved model's score on the 180 held-out images rank 0 evaluated \(\d+/180\); on all 359 held-out images it scores 0\.\d{4} \(\d+/359\)",
    7: r"FAIL +step 1's gradient is 0\.50 x the gradient of the mean loss over the global batch",
}  # fmt: skip
LINE = re.compile(r"^(\d) (\S+) +(PASS|FAIL|BLOCKED) +(.*)$")

# The checker's limit for the job that hangs: below its default (JOB_TIMEOUT_S, 60 s), so the test
# sees the limit it was given, and 2.5x the time the job takes to reach its sleep (its last state
# file written, counted from the launch) under this file's own load: 15.7, 15.4 and 15.2 s in 3
# runs here (2 cores, 12:34-12:44 UTC, load average about 3). The job is killed at this limit, so
# it bounds the file's wall time.
HUNG_JOB_LIMIT_S = 40
# The one launch of the single-bug copies and the solution (8 rows of 2 epochs each, after one start-up):
# it ended after about 25 s under this file's own load here, 12:38 UTC; a hung row is killed at this limit.
ROWS_TIMEOUT_S = 120
# (script, its arguments, the one error line it must print)
BAD_COMMAND_LINES = [
    (CHECKER, ["no_such_script.py"], r"^lab4_check\.py: error: no such script: no_such_script\.py$"),
    (CHECKER, ["--verbose"], r"^lab4_check\.py: error: unrecognized arguments: --verbose$"),
    (CHECKER, ["--job-timeout-s", "0"], r"^lab4_check\.py: error: argument --job-timeout-s: must be a positive number, got 0$"),
    (BROKEN, ["--timeout-s", "0"], r"^lab4_broken_ddp\.py: error: argument --timeout-s: must be a positive number, got 0$"),
    (SOLUTION, ["--batch-size", "many"], r"^lab4_broken_ddp\.py: error: argument --batch-size: must be an integer, got 'many'$"),
]  # fmt: skip


def with_bugs(source: str, bugs) -> str:
    for bug in bugs:
        old, new = BUGS[bug]
        assert source.count(old) == 1, f"bug {bug}: the solution must contain its text exactly once: {old!r}"
        source = source.replace(old, new)
    return source


def solution_with(bugs) -> str:
    return with_bugs(SOLUTION.read_text(), bugs)


def code_without_docstring(source: str) -> str:
    docstring = ast.parse(source).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), "no module docstring"
    return "".join(source.splitlines(keepends=True)[docstring.end_lineno :])


def verdict_lines(output: str) -> dict[int, str]:
    """{check number: 'STATUS evidence'} from the checker's output: every check once, a hint on every FAIL."""
    found = {}
    for line in output.splitlines():
        match = LINE.match(line)
        if match:
            number, status, text = int(match.group(1)), match.group(3), match.group(4)
            evidence, _, hint = text.partition(" -- hint: ")
            assert number not in found and bool(hint) == (status == "FAIL"), line
            found[number] = f"{status} {evidence}"
    assert sorted(found) == list(range(1, 8)), output
    return found


@pytest.fixture(scope="module")
def checker():
    """labs/lab4_check.py as a module: calling it in this process saves the checker's start-up."""
    return import_script(CHECKER)


def hung_solution() -> str:
    """The solution, stuck after training (weights saved) and before writing its metrics."""
    source, before = SOLUTION.read_text(), "        if args.metrics_json and ctx.is_main:\n"
    assert source.count(before) == 1, f"the solution must contain this line exactly once: {before!r}"
    return source.replace(before, "        time.sleep(3600)  # stuck after training, before writing the metrics\n" + before)


def observe_bugs_and_solution(checker, folder) -> dict:
    """{bug number, or "solution": Observation}, from ONE launch that runs them as rows (see the docstring).

    Bug 5's row is rescued by the observer and finishes; the solution's row comes last, so the rows
    after a rescued one are checked to be unharmed. A row that fails ends the launch: its test and
    those of the rows after it fail, each with the row's own output.
    """
    scripts = {}
    for bug in sorted(BUGS):
        scripts[bug] = folder / f"bug{bug}" / "lab4_broken_ddp.py"  # the exercise's file name
        scripts[bug].parent.mkdir()
        scripts[bug].write_text(solution_with([bug]))
    scripts["solution"] = SOLUTION
    return observe_rows.observe_in_one_launch(checker, scripts, folder, checker.default_script_args, {}, ROWS_TIMEOUT_S)


@pytest.fixture(scope="module")
def jobs(checker, tmp_path_factory):
    """Every launch of this file, started at once: {name: Future}.

    A test waits for its own job's result (a failed job fails only the tests that read it). A check
    runs in this process (checker.check saves the checker's start-up) and gives (Observation, its
    seven lines); "rows" gives {bug number or "solution": Observation}; the others give RunResults.
    """

    def check(name: str, script=None, make_source=None, **options):
        folder = tmp_path_factory.mktemp(name)  # a new folder for every attempt
        if make_source:  # the copy is written here, in the job: a missing edit fails only its test
            script = folder / "lab4_broken_ddp.py"  # the exercise's file name
            script.write_text(make_source())
        (folder / "observed").mkdir()
        observation, verdicts = checker.check(script, folder / "observed", **options)
        return observation, "\n".join(verdict.line() for verdict in verdicts)

    # 5 jobs of 3 processes (4 for the command line), all at once: the 2 cores stay busy while two of
    # them wait (see the module docstring), and every job keeps over 2x headroom under its time limit
    # on a slower machine. A rank that crashes at exit fails its test: no relaunch here, and none by
    # pytest (a rerun would only read this result again).
    minimal = REPO_ROOT / "labs" / "lab4_minimal_hang.py"
    detail = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = {
            "hung": pool.submit(check, "hung", make_source=hung_solution, job_timeout_s=HUNG_JOB_LIMIT_S),
            "unrescued": pool.submit(check, "unrescued", BROKEN, rescue=False),
            "broken": pool.submit(run_command, [sys.executable, str(CHECKER)], timeout_s=150),
            "rows": pool.submit(observe_bugs_and_solution, checker, tmp_path_factory.mktemp("rows")),
            "minimal": pool.submit(run_torchrun, minimal, [], nproc=2, timeout_s=120, env=detail),
        }
        yield futures  # leaving the block waits for every job, also when a test failed


def checked(jobs, name) -> tuple[object, dict[int, str]]:
    """(Observation, {check: 'STATUS evidence'}) of a job that jobs ran through checker.check."""
    observation, lines = jobs[name].result()
    return observation, verdict_lines(lines)


def judged_row(checker, jobs, name) -> tuple[object, dict[int, str], list]:
    """(Observation, {check: 'STATUS evidence'}, the verdicts) of a row, judged as the checker judges its own job."""
    observation = jobs["rows"].result()[name]
    verdicts = checker.judge(observation)
    return observation, verdict_lines("\n".join(verdict.line() for verdict in verdicts)), verdicts


def test_broken_script_is_the_solution_with_the_seven_bugs_put_back():
    solution, broken = SOLUTION.read_text(), BROKEN.read_text()
    assert code_without_docstring(with_bugs(solution, BUGS)) == code_without_docstring(broken)
    assert code_without_docstring(solution) != code_without_docstring(broken)
    # The exercise says what the script should do and how to check it, not where the bugs are.
    docstring = ast.get_docstring(ast.parse(broken))
    assert "python labs/lab4_check.py" in docstring and "seven bugs" in docstring
    assert not re.search(r"zero_grad|set_epoch|module\.|DistributedSampler|all_reduce|world_size\)", docstring)


def test_observed_ranks_read_the_same_digits(checker, tmp_path):
    """The observer serves the checker's saved digits (no scikit-learn in the ranks): the same tensors."""
    observer = import_script(REPO_ROOT / "labs" / "lab4_observe.py")
    served, loaded = observer._load_saved_digits(str(checker.save_digits(tmp_path / "digits.pt"))), load_digits()
    assert served.num_classes == loaded.num_classes
    for split in ("train", "test"):
        for a, b in zip(getattr(served, split).tensors, getattr(loaded, split).tensors, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), split


@pytest.mark.timeout(300)  # this and the tests below wait for their job, started with the others by `jobs`
def test_checker_fails_the_broken_script_with_evidence(jobs):
    broken_check = jobs["broken"].result()
    assert broken_check.returncode == 1, broken_check.describe()
    assert "the job finished" in broken_check.stdout, broken_check.describe()
    verdicts = verdict_lines(broken_check.stdout)
    for bug in (1, 2, 3, 5, 6, 7):
        assert re.match(EVIDENCE[bug], verdicts[bug]), verdicts[bug]
    # Bug 4 hides behind bug 1: without a DistributedSampler, the DataLoader's own shuffle gives each
    # epoch a new order. The checker reports what the run did; the bug shows once bug 1 is fixed.
    assert verdicts[4] == "PASS every rank read its samples in a new order in epoch 1"
    assert "result: 1 passed, 6 failed, 0 blocked of 7 checks" in broken_check.stdout


@pytest.mark.timeout(300)
def test_when_the_hang_kills_the_job_later_checks_are_blocked_not_guessed(jobs):
    """Unrescued, the broken job hangs at the end of epoch 0 and dies at --timeout-s."""
    observation, verdicts = checked(jobs, "unrescued")
    assert not observation.run.ok and not observation.run.timed_out, observation.run.describe()
    # Both ranks time out; the one that gives up second may instead see its peer's connection close,
    # or be stopped by torchrun before it records anything.
    assert verdicts[5].startswith("FAIL rank "), verdicts[5]
    assert verdicts[5].endswith("until gloo gave up: Timed out waiting 10000ms for recv operation to complete"), verdicts[5]
    assert re.search(
        r"rank 0 waited in all_reduce of a 2-element float32 tensor after optimizer step 12 \(epoch 0\)"
        r"|rank 1 waited in barrier after optimizer step 12 \(epoch 0\)",
        verdicts[5],
    ), verdicts[5]
    for bug in (1, 2, 7):  # observed before the hang
        assert re.match(EVIDENCE[bug], verdicts[bug]), verdicts[bug]
    died = r"the job died \(exit status 1: RuntimeError: Timed out waiting 10000ms for recv operation to complete\)"
    assert re.fullmatch(f"BLOCKED no file at --save: {died} before writing it", verdicts[3]), verdicts[3]
    assert re.fullmatch(f"BLOCKED rank 0 never started a second epoch: {died}", verdicts[4]), verdicts[4]
    assert re.fullmatch(f"BLOCKED no --metrics-json: {died} before writing it", verdicts[6]), verdicts[6]


@pytest.mark.timeout(300)
def test_solution_passes_all_seven_checks(checker, jobs):
    """The solution's row, judged and summed up by the functions behind the checker's output and exit status."""
    observation, lines, verdicts = judged_row(checker, jobs, "solution")
    assert observation.run.ok and observation.ended() == "finished", observation.run.describe()
    assert all(line.startswith("PASS ") for line in lines.values()), lines
    assert "in epoch 0 the ranks read disjoint shares (719, 719 samples) covering all 1438" in lines[1]
    assert re.search(r"reported eval_accuracy 0\.\d{4} is the saved model's on all 359 held-out images", lines[6])
    assert checker.summary(verdicts) == ("result: 7 passed, 0 failed, 0 blocked of 7 checks", 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_alone_fails_its_check_and_only_it(checker, jobs, bug):
    """A row of its own for each bug: the solution with that one edit (see observe_bugs_and_solution)."""
    observation, verdicts, _ = judged_row(checker, jobs, bug)
    assert observation.run.ok, observation.run.describe()
    assert re.match(EVIDENCE[bug], verdicts[bug]), verdicts[bug]
    others = {number: line for number, line in verdicts.items() if number != bug}
    assert all(line.startswith("PASS ") for line in others.values()), others


@pytest.mark.timeout(300)
def test_a_job_that_hangs_is_killed_and_reported(checker, jobs):
    """A hang outside any collective: the checker kills the job at the limit it was given and says so."""
    observation, verdicts = checked(jobs, "hung")
    # Killed at its own limit (HUNG_JOB_LIMIT_S), well before the checker's default one.
    assert observation.run.timed_out and observation.run.wall_s < checker.JOB_TIMEOUT_S, observation.run.describe()
    killed = f"the job hung and was killed after {HUNG_JOB_LIMIT_S} s"
    assert verdicts[5] == f"FAIL {killed}: no rank was inside a collective called from Python"
    assert verdicts[6] == f"BLOCKED no --metrics-json: {killed} before writing it"
    for number in (1, 2, 3, 4, 7):  # all observed before the hang
        assert verdicts[number].startswith("PASS "), verdicts[number]


@pytest.mark.parametrize(("script", "args", "expected"), BAD_COMMAND_LINES, ids=[f"{s.name} {' '.join(a)}" for s, a, _ in BAD_COMMAND_LINES])
def test_bad_command_lines_fail_with_one_line(script, args, expected, monkeypatch, capsys):
    """Parsed in this process, as `python SCRIPT ARGS` would parse them (no torchrun: RANK is unset)."""
    module = import_script(script, name=f"{script.parent.name}_{script.stem}_command_line")
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.delenv("RANK", raising=False)  # under torchrun, ranks other than 0 stay silent
    with pytest.raises(SystemExit) as stopped:
        module.main(args) if script == CHECKER else module.parse_args(args)
    printed = capsys.readouterr()
    assert stopped.value.code == 2 and not printed.out, printed
    assert re.match(expected, printed.err.strip()) and len(printed.err.strip().splitlines()) == 1, printed


@pytest.mark.timeout(300)
def test_detail_mode_names_each_ranks_collective_in_the_minimal_hang(jobs):
    """The sheet's reproduction: with DETAIL both ranks stop at once, each naming its own collective."""
    result = jobs["minimal"].result()
    # Stopped by DETAIL's check, not by the 30 s timeout: a fact about the output, not the clock (on a
    # loaded machine the start-up alone can take many seconds).
    assert result.returncode == 1 and "Timed out" not in result.stdout + result.stderr, result.describe()
    assert "the default group's gloo backend is a _ProcessGroupWrapper" in result.stdout
    own_collective = re.compile(r"^\[rank (\d)\] Detected mismatch between collectives on ranks\. Rank \1 is running "
                                r"collective: CollectiveFingerPrint\(SequenceNumber=2,? ?OpType=(\w+)", re.MULTILINE)
    assert sorted(own_collective.findall(result.stdout)) == [("0", "ALLREDUCE"), ("1", "BARRIER")], result.stdout
