"""Lab 10: the broken script is the solution plus nine planted faults, and the checker finds each one.

The proof the checker needs: the solution passes every check; each planted fault alone, added to the
solution, fails its own check and no other; the unfixed script fails every check it can decide; and a
slowdown no signature explains (the same extra work on every rank) fails the throughput check.

All of it comes from few launches, started by one fixture (ddp_course/checking/lab10.py runs the
same code for a learner's script): one 2-rank launch runs the reference and every variant but the
unfixed script, alternately, then the full trainings and the solution's time-out case. Once its
timed runs are over (nothing else shares the cores while they are timed), the rest start beside its
untimed tail: a second launch runs the time-out fault's time-out case (it fails, so it ends its
launch), a third the unfixed script, and the one-process reference. The time-out case (an 8 s save) is run for the solution and the two scripts
that break it; the other variants share the solution's save code unchanged
(test_the_other_faults_leave_the_save_path_alone), so their check 9 is not run here.
"""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ddp_course.checking import lab10 as checker
from ddp_course.launch import REPO_ROOT, import_script

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
import lab10_faults as faults  # noqa: E402

# On a quiet 2-core machine the launches take about a minute and a half together; the limits leave
# room for a machine shared with other jobs (load average 15 on 2 cores: about 8 minutes).
pytestmark = pytest.mark.timeout(1200)
LAUNCH_TIMEOUT_S = 1000
NAMES = {number: name for number, (name, _) in checker.CHECKS.items()}
THROUGHPUT, ACCURACY, TIMEOUT, BATCH_NORM = 7, 8, 9, 10
FULL_TRAINING = ["learning-rate", "batch-norm"]  # the faults that change the training maths
VARIANTS = ["solution", *faults.FAULTS, "extra-work"]  # run in the shared launch (every full run)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """{variant: [Verdict]} for every variant, from the launches described above (about a minute on a quiet machine)."""
    folder = tmp_path_factory.mktemp("lab10")
    scripts = {"solution": faults.SOLUTION, "extra-work": faults.write_variant([], folder / "extra_work.py", faults.EXTRA_WORK)}
    for name in faults.FAULTS:
        scripts[name] = faults.write_variant([name], folder / f"fault_{name.replace('-', '_')}.py")
    scripts = {name: scripts[name] for name in VARIANTS}
    # Full training where the accuracy can differ from the solution's: the other faults change how
    # fast the same arithmetic runs, not the arithmetic (test_the_other_faults_keep_the_training_maths).
    shared = checker.plan_runs(folder, scripts, full_of=["solution", *FULL_TRAINING], timeout_of=["solution"], references_between=4)
    timeout_fault = [checker.timeout_case(folder, "timeout", scripts["timeout"])]
    unfixed = checker.plan_runs(folder, {"unfixed": faults.BROKEN}, full_of=["unfixed"], timeout_of=["unfixed"])
    with ThreadPoolExecutor(max_workers=4) as pool:
        timed = pool.submit(checker.launch, shared, folder, LAUNCH_TIMEOUT_S)
        # Nothing else runs beside the timed runs (the speed ratios compare runs timed minutes apart on
        # shared cores: an extra-work control once passed throughput with the other launches beside it).
        checker.wait_until_the_timed_runs_end(shared, timed)
        baseline = pool.submit(checker.one_process_accuracy, folder, LAUNCH_TIMEOUT_S)
        launches = [timed] + [pool.submit(checker.launch, runs, folder, LAUNCH_TIMEOUT_S) for runs in (timeout_fault, unfixed)]
        results = [launch.result() for launch in launches]
        one_process = baseline.result()
    assert one_process is not None, "the one-process reference did not finish"
    assert results[0].ok, results[0].describe()  # the time-out fault and the unfixed script end their launches failing
    assert not any(result.timed_out for result in results), [result.describe() for result in results if result.timed_out]
    found = checker.read_runs(shared + timeout_fault + unfixed)
    judged = {name: checker.judge(found, name, one_process) for name in [*VARIANTS, "unfixed"]}
    for name, lines in judged.items():  # the evidence, in the test log (pytest -s, or on a failure)
        print(f"--- {name}\n" + "\n".join(v.line() for v in lines))
    return judged


def statuses(verdicts) -> dict[str, str]:
    return {v.check: v.status for v in verdicts}


def report(verdicts) -> str:
    """Every verdict line, one per line: a failure shows the whole evidence (a list's repr is cut short)."""
    return "\n" + "\n".join(v.line() for v in verdicts)


def test_the_solution_passes_every_check(verdicts):
    failing = [v.line() for v in verdicts["solution"] if not v.passed]
    assert not failing, failing


@pytest.mark.parametrize("fault", list(faults.FAULTS))
def test_each_fault_alone_fails_its_own_check_and_no_other(verdicts, fault):
    own = faults.FAULTS[fault][0]
    found = statuses(verdicts[fault])
    assert found[own] == "FAIL", report(verdicts[fault])
    for check, status in found.items():
        if check == own:
            continue
        if check == NAMES[THROUGHPUT] and own in [NAMES[n] for n in checker.SIGNATURES]:
            # the fault's own signature explains a slowdown: throughput waits for it
            assert status == "BLOCKED", report(verdicts[fault])
        elif check in (NAMES[ACCURACY], NAMES[2]) and own == NAMES[BATCH_NORM]:
            # batches too small for BatchNorm cost accuracy too, and dilute the data share of the step:
            # the accuracy and data-wait checks wait for batch-norm
            evidence = next(v.evidence for v in verdicts[fault] if v.check == check)
            assert status == "BLOCKED" and evidence.startswith("decided once batch-norm passes"), report(verdicts[fault])
        elif (check == NAMES[TIMEOUT] and fault != "timeout") or (check == NAMES[ACCURACY] and fault not in FULL_TRAINING):
            assert status == "BLOCKED" and "not run" in next(v.evidence for v in verdicts[fault] if v.check == check)
        elif check == NAMES[6] and own == NAMES[1]:
            # oversubscribed ranks' CPU times decide no balance, either way: it waits for threads
            assert status == "BLOCKED", report(verdicts[fault])
        else:
            assert status == "PASS", report(verdicts[fault])


def test_a_slowdown_without_a_signature_fails_throughput_only(verdicts):
    found = statuses(verdicts["extra-work"])
    assert found[NAMES[THROUGHPUT]] == "FAIL", report(verdicts["extra-work"])
    assert [c for c, s in found.items() if s == "FAIL"] == [NAMES[THROUGHPUT]], report(verdicts["extra-work"])


def test_the_unfixed_script_passes_no_check(verdicts):
    found = statuses(verdicts["unfixed"])
    assert found[NAMES[THROUGHPUT]] == "BLOCKED"  # every signature already fails
    # rank-balance waits for threads: oversubscribed ranks get uneven CPU time whatever their work
    assert found[NAMES[6]] == "BLOCKED", report(verdicts["unfixed"])
    # accuracy waits for batch-norm: with batches too small for BatchNorm, no learning rate decides it
    assert found[NAMES[ACCURACY]] == "BLOCKED", report(verdicts["unfixed"])
    # a data share under the limit waits for batch-norm too (measured 0.17: 16 micro-batches of 2 images
    # each pay an all-reduce and an unused-parameter search); one over it fails
    assert found[NAMES[2]] in ("FAIL", "BLOCKED"), report(verdicts["unfixed"])
    waiting = (NAMES[2], NAMES[THROUGHPUT], NAMES[6], NAMES[ACCURACY])
    assert all(status == "FAIL" for check, status in found.items() if check not in waiting), report(verdicts["unfixed"])


def test_a_failed_time_out_case_says_which_rank_timed_out(verdicts):
    evidence = next(v.evidence for v in verdicts["timeout"] if v.check == NAMES[TIMEOUT])
    assert "the run failed (rank" in evidence, evidence


def test_a_failing_signature_prints_its_effect(verdicts):
    data = next(v for v in verdicts["data"] if v.check == "data-wait")
    assert "x the reference's step time" in data.evidence and "hint" in data.line()


def test_the_batch_norm_fault_prints_its_cost_in_accuracy(verdicts):
    """Its own check counts images (2 per BatchNorm batch against the solution's 16); the full training
    beside it shows what that costs: held-out accuracy far below one process's (27 points, measured)."""
    found = {v.check: v for v in verdicts["batch-norm"]}
    assert "2 images per rank" in found[NAMES[BATCH_NORM]].evidence, found[NAMES[BATCH_NORM]].line()
    drop = int(found[NAMES[BATCH_NORM]].evidence.split("held-out accuracy ")[1].split(" points")[0])
    assert drop > 100 * checker.MAX_ACCURACY_DROP, found[NAMES[BATCH_NORM]].line()
    assert "16 images per rank" in next(v.evidence for v in verdicts["solution"] if v.check == NAMES[BATCH_NORM])


def test_the_broken_script_is_the_solution_with_every_fault():
    assert faults.code_of(faults.BROKEN) == faults.with_faults(list(faults.FAULTS))


def test_the_other_faults_leave_the_save_path_alone():
    """Check 9 runs only the save path: every fault but the time-out one leaves it as the solution has it."""
    for name, (_, edits) in faults.FAULTS.items():
        if name != "timeout":
            assert not any("save" in old or "barrier" in old or "timeout" in old for old, _ in edits), name


def test_the_other_faults_keep_the_training_maths():
    """Check 8 (accuracy) is run on the solution, the learning-rate and batch-norm faults and the unfixed
    script only: no other fault changes a line that sets the learning rate, computes the loss or splits
    the batch (the others reorganise the same arithmetic: where the images are standardized, when
    gradients are all-reduced)."""

    def maths(text):
        words = ("lr", "learning_rate", "cross_entropy", "args.batch_size", "args.accum_steps")
        return sorted(line.strip() for line in text.splitlines() if any(word in line for word in words))

    for name, (_, edits) in faults.FAULTS.items():
        if name not in FULL_TRAINING:
            assert all(maths(old) == maths(new) for old, new in edits), name


def test_bad_flags_are_one_line(refused_flag_line):
    lab = import_script(faults.BROKEN, name="lab10_slow_ddp")
    assert "--slow-storage-s must be >= 0" in refused_flag_line(lab, ["--slow-storage-s", "-1"])
    assert "must be a positive integer, got 0" in refused_flag_line(lab, ["--accum-steps", "0"])


def test_the_checker_refuses_a_missing_script_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        checker.main([str(Path("no_such_lab10.py"))])
    assert stopped.value.code == 2
    assert [line for line in capsys.readouterr().err.splitlines() if "error:" in line] == [
        "lab10_check.py: error: no such script: no_such_lab10.py (give your fixed copy, e.g. my_lab10.py)"
    ]
