"""Lab 3 conversion checker: the solution passes all seven checks, and each plausible mistake fails its own check only.

Each mistake is a small edit of solutions/my_ddp.py made here, so the mistakes cannot drift from the
solution. One module fixture runs two launches side by side: the checker's main() on the solution,
exactly as a learner runs it (one torchrun job of 2 gloo ranks under lab 4's observer), and ONE
launch of 2 gloo ranks that runs the 7 mistakes one after another, each under the same observer with
the checker's arguments and settings (tests/scripts/observe_rows.py). Most of a job is torch start-up
(issue 22): one launch for the 7 mistakes instead of 7 saves about 25 s on 2 cores. The checker
judges each mistake's observation with the same function as a learner's (judge); the one-process
reference is computed in this process. The command-line errors are checked in this process too.
"""

import contextlib
import io
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddp_course.launch import REPO_ROOT, import_script

CHECKER = REPO_ROOT / "labs" / "lab3_convert_check.py"
SOLUTION = REPO_ROOT / "solutions" / "my_ddp.py"
TRAIN_SINGLE = REPO_ROOT / "labs" / "train_single.py"
# The launching side of tests/scripts/observe_rows.py (lab 4's checker test shares it)
observe_rows = import_script(REPO_ROOT / "tests" / "scripts" / "observe_rows.py")

# Each mistake: (the check it must fail, the edits that put it into the solution: (old text, new text)).
MISTAKES = {
    "no-sampler": (1, [  # the DataLoader shuffles the whole training set on every rank
        ("batch_size=args.batch_size, sampler=sampler)", "batch_size=args.batch_size, shuffle=True)"),
    ]),
    "no-set-epoch": (2, [  # the sampler never learns the epoch: every epoch repeats epoch 0's order
        ("        sampler.set_epoch(epoch)  # DDP: a new permutation every epoch, the same on every rank\n", ""),
    ]),
    "unequal-start": (3, [  # no DDP: a seed per rank and gradients averaged by hand; nothing broadcasts the weights
        ("torch.manual_seed(args.seed)  #", "torch.manual_seed(args.seed + rank)  #"),
        ('ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)', "ddp_model = model"),
        ("            loss.backward()  # DDP all-reduces here: every rank now holds the gradient averaged over ranks\n",
         "            loss.backward()\n            for parameter in model.parameters():  # average the gradients by hand\n"
         "                dist.all_reduce(parameter.grad)\n                parameter.grad /= world_size\n"),
        ("ddp_model.module.state_dict()", "ddp_model.state_dict()"),
    ]),
    "loss-over-world-size": (4, [  # DDP averages, and the loss is divided by the world size on top
        ("            loss.backward()  #", "            (loss / world_size).backward()  #"),
    ]),
    "save-on-every-rank": (5, [
        ("    if rank == 0 and args.save:", "    if args.save:"),
    ]),
    "rank0-metrics": (6, [  # the held-out counts are not summed over ranks: rank 0 prints its slice's accuracy
        ("        dist.all_reduce(counts)  # DDP: each rank scored its slice; the job's accuracy counts them all\n", ""),
    ]),
    "barrier-on-rank-0": (7, [  # the barrier indented into rank 0's block: rank 0 waits for a peer that has left
        ("        torch.save(ddp_model.module.state_dict(), args.save)\n    dist.barrier()",
         "        torch.save(ddp_model.module.state_dict(), args.save)\n        dist.barrier()"),
    ]),
}  # fmt: skip

# What the checker must say about each mistake: the failed check's line matches this (status, then evidence).
EVIDENCE = {
    "no-sampler": r"FAIL +ranks 0 and 1 both trained on sample \d+ in epoch 0 \(1438 of the 1438 training samples were read by both\)",
    "no-set-epoch": r"FAIL +rank 0 read the same 719 samples in the same order in epochs 0 and 1",
    "unequal-start": r"FAIL +before the first optimizer step rank 1's weights differ from rank 0's \(relative difference \d\.\d\d\): the replicas started apart",
    "loss-over-world-size": r"FAIL +step 1's gradient is 0\.50 x the gradient of the mean loss over the global batch \(2 ranks x 128 samples\)",
    "save-on-every-rank": r"FAIL +ranks 0 and 1 each called torch\.save on model\.pt: one file, 2 writers",
    "rank0-metrics": r"FAIL +the reported accuracy 0\.\d{4} is the saved model's score on the 180 held-out images rank 0 evaluated \(\d+/180\); on all 359 held-out images it scores 0\.\d{4} \(\d+/359\)",
    "barrier-on-rank-0": r"FAIL +rank 0 called barrier after optimizer step 12 \(epoch 1\); rank 1 finished without making that call .*until their process group's timeout",
}  # fmt: skip
# Checks that a mistake leaves undecidable, with the reason the checker must give instead of a guess.
BLOCKED_BY = {
    "unequal-start": {6: "BLOCKED the ranks ended with different weights (check 3): no one model's accuracy is the job's"},
}
LINE = re.compile(r"^(\d) (\S+) +(PASS|FAIL|BLOCKED) +(.*)$")


def with_mistake(source: str, edits) -> str:
    for old, new in edits:
        assert source.count(old) == 1, f"the solution must contain this text exactly once: {old!r}"
        source = source.replace(old, new)
    return source


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
    """labs/lab3_convert_check.py as a module: calling it in this process saves a checker start-up per job."""
    module = import_script(CHECKER)
    # Two launches run at once here, on a machine that may be shared: give each more time than a
    # learner's single job needs. The limit only stops a hung job; a passing run is never near it.
    module.JOB_TIMEOUT_S = 400
    return module


@pytest.fixture(scope="module")
def runs(checker, tmp_path_factory):
    """Every job of this file, in two launches side by side: {name: (RunResult, {check: 'STATUS evidence'}, exit status of main or None)}."""
    folder = tmp_path_factory.mktemp("lab3_convert")

    def command_line(script):
        """The learner's command, `python labs/lab3_convert_check.py SCRIPT`, run by its main() here."""
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # only main() prints; the other launch's thread does not
            status = checker.main([str(script)])
        return printed.getvalue(), verdict_lines(printed.getvalue()), status

    scripts = {}
    for name, (_, edits) in MISTAKES.items():
        scripts[name] = folder / name / "my_ddp.py"
        scripts[name].parent.mkdir()
        scripts[name].write_text(with_mistake(SOLUTION.read_text(), edits))
    with ThreadPoolExecutor(max_workers=2) as pool:
        solution = pool.submit(command_line, SOLUTION)
        observations = observe_rows.observe_in_one_launch(
            checker.lab4, scripts, folder, checker.script_args, checker.OBSERVER_ENV, checker.JOB_TIMEOUT_S
        )
        judged = {name: (obs.run, verdict_lines("\n".join(v.line() for v in checker.judge(obs))), None) for name, obs in observations.items()}
        return {"solution": solution.result(), **judged}


@pytest.mark.timeout(900)
def test_solution_passes_all_seven_checks(runs):
    output, verdicts, status = runs["solution"]
    assert status == 0, output
    assert "the job finished" in output
    assert all(line.startswith("PASS ") for line in verdicts.values()), output
    assert "in epoch 0 the ranks read disjoint shares (719, 719 samples) covering all 1438" in verdicts[1]
    assert "both ranks held the same weights before each of their 12 optimizer steps" in verdicts[3]
    assert verdicts[4] == (
        "PASS the gradient of each of the first 3 steps is the global batch's mean-loss gradient (2 ranks x 128 samples), "
        "and after 3 steps the weights equal those of one process trained on the same global batches"
    )
    assert verdicts[5].startswith("PASS rank 0 alone wrote it; it loads into a bare DigitsCNN (strict)"), verdicts[5]
    assert re.fullmatch(r"PASS the reported accuracy 0\.\d{4} is the saved model's on all 359 held-out images \(\d+/359\)", verdicts[6])
    assert "result: 7 passed, 0 failed, 0 blocked of 7 checks" in output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_mistake_fails_its_own_check_and_no_other(runs, mistake):
    run, verdicts, _ = runs[mistake]
    number = MISTAKES[mistake][0]
    assert run.ok, run.describe()  # even the job whose barrier goes unmatched: the observer skips that call
    assert re.match(EVIDENCE[mistake], verdicts[number]), verdicts[number]
    blocked = BLOCKED_BY.get(mistake, {})
    for other, line in verdicts.items():
        if other in blocked:
            assert line == blocked[other], line
        elif other != number:
            assert line.startswith("PASS "), (other, line, run.describe())


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        (CHECKER, ["no_such_script.py"], "lab3_convert_check.py: error: no such script: no_such_script.py"),
        (CHECKER, ["--verbose"], "lab3_convert_check.py: error: unrecognized arguments: --verbose"),
        (TRAIN_SINGLE, ["--epochs", "0"], "train_single.py: error: argument --epochs: must be a positive integer, got 0"),
        (TRAIN_SINGLE, ["--save", "no/such/folder/model.pt"], "train_single.py: error: --save: the folder of no/such/folder/model.pt does not exist"),
        (SOLUTION, [], "my_ddp.py: error: launch me with torchrun, e.g. torchrun --standalone --nproc_per_node=2 solutions/my_ddp.py"),
        (SOLUTION, ["--batch-size", "many"], "my_ddp.py: error: argument --batch-size: must be an integer, got 'many'"),
    ],
)
def test_bad_command_lines_fail_with_one_clear_line(script, args, expected, monkeypatch, capsys):
    """Called in this process, as `python SCRIPT ARGS` would run it (no torchrun: RANK is unset)."""
    module = import_script(script, name=f"{script.stem}_command_line")
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as stopped:
        module.main(args) if script == CHECKER else module.main()
    assert stopped.value.code == 2
    printed = capsys.readouterr()
    assert not printed.out and printed.err.strip().splitlines()[-1] == expected, printed


def test_the_default_script_says_how_to_start(checker, monkeypatch, capsys):
    """Without an argument the checker checks labs/my_ddp.py; when it is missing, it says how to make it."""
    monkeypatch.setattr(checker, "REPO_ROOT", CHECKER.parent / "no_checkout_here")  # as if labs/my_ddp.py were missing
    monkeypatch.chdir(CHECKER.parent)
    with pytest.raises(SystemExit) as stopped:
        checker.main([])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "lab3_convert_check.py: error: no such script: labs/my_ddp.py "
        "(start with: cp labs/train_single.py labs/my_ddp.py, then make it a DDP script)"
    )
