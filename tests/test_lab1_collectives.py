"""labs/lab1_collectives.py launched as a learner launches it: torchrun, 2 gloo ranks on the CPU.

Launches are shared where the same job answers several questions: one job runs every check and
the default benchmark sweep (as the lab sheet does), read by three tests. Argument checks that
need no process group run the script's own parse_args in this process; one launch proves that
under torchrun a mistake found after the process group is set up (--corrupt-rank 2) is reported once
for the job, without a traceback. argparse's refusals take the same path through torchrun in every
lab (ddp_course.cli.CourseArgumentParser): tests/test_lab3_ddp.py launches one for real, and
tests/test_helpers.py checks that only rank 0 speaks, so lab 1's are parsed here (issue 22: one
start-up less).

The file's three launches start together in one module fixture, `jobs` (the pattern of
tests/test_lab2_join.py): the short ones spend much of their time starting up and meeting at the
rendezvous, and the 2 cores run the long one meanwhile.
"""

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ddp_course.launch import REPO_ROOT, import_script, run_torchrun

LAB1 = REPO_ROOT / "labs" / "lab1_collectives.py"
COLLECTIVES = [
    "broadcast", "reduce", "all_reduce_sum", "all_reduce_max", "all_reduce_mean", "all_reduce_avg_op",
    "all_gather", "reduce_scatter", "barrier", "send_recv_ring",
]  # fmt: skip
RECORD_FIELDS = {"bytes", "time_s", "algbw_gbps", "busbw_gbps", "world_size", "backend"}
DEFAULT_SIZES = [4096 * 2**k for k in range(15)]  # 4 KiB .. 64 MiB, doubling


def run_lab1(*args, nproc=2, timeout_s=120):
    return run_torchrun(LAB1, args, nproc=nproc, timeout_s=timeout_s)


def verdicts(stdout: str) -> dict[str, str]:
    """{collective: PASS/FAIL/SKIP} from the lab's report lines."""
    return {name: status for status, name in re.findall(r"^(PASS|FAIL|SKIP)  (\w+)", stdout, flags=re.MULTILINE)}


def read_json(path):
    with open(path) as file:
        return json.load(file)


def load_lab1():
    """The lab script as a module, to test its pure functions in this process (no torchrun)."""
    return import_script(LAB1)


# The launch that must fail: (flags, the one error line's text), refused after the process group is
# set up (it needs the job's size), on every rank, by main()'s CourseError path.
BAD_FLAGS_UNDER_TORCHRUN = [
    (["--corrupt-rank", "2"], r"--corrupt-rank 2: there is no such rank \(0\.\.1\)"),
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every launch of this file, started at once: {name: Future of RunResult}, plus the full run's folder.

    A test waits for its own job's result, so a failed job fails only its test. No relaunch.
    """
    out = tmp_path_factory.mktemp("lab1")
    with ThreadPoolExecutor(max_workers=2 + len(BAD_FLAGS_UNDER_TORCHRUN), thread_name_prefix="lab1") as pool:
        futures = {
            # One job as the lab sheet runs it: every check, then the default sweep with its JSON and plot.
            "full": pool.submit(
                run_lab1, "--checks-json", out / "checks.json", "--bench", "--json", out / "bench.json",
                "--plot", out / "bench.png", timeout_s=200,
            ),
            "corrupt": pool.submit(run_lab1, "--corrupt-rank", "1"),
        }  # fmt: skip
        for flags, _ in BAD_FLAGS_UNDER_TORCHRUN:
            futures[tuple(flags)] = pool.submit(run_lab1, *flags)
        yield futures, out  # leaving the block waits for every job, also when a test failed


@pytest.fixture(scope="module")
def full_run(jobs):
    futures, out = jobs
    return futures["full"].result(), out


@pytest.mark.timeout(240)
def test_every_collective_passes_and_the_results_are_the_expected_ones(full_run):
    result, out = full_run
    assert result.ok, result.describe()
    assert verdicts(result.stdout) == {name: "PASS" for name in COLLECTIVES}, result.describe()
    assert "10/10 collectives passed" in result.stdout

    # The lab's own verdicts, checked again from outside with numbers written out by hand:
    # rank 0 contributes [100, 101, 102, 103], rank 1 [200, 201, 202, 203].
    checks = read_json(out / "checks.json")
    assert checks["world_size"] == 2 and checks["backend"] == "gloo"
    assert checks["inputs"] == [[100, 101, 102, 103], [200, 201, 202, 203]]
    outputs = {name: record["outputs"] for name, record in checks["collectives"].items()}
    assert outputs["broadcast"] == [[100, 101, 102, 103]] * 2
    assert outputs["reduce"][0] == [300, 302, 304, 306]  # only the destination's result is defined
    assert outputs["all_reduce_sum"] == [[300, 302, 304, 306]] * 2
    assert outputs["all_reduce_max"] == [[200, 201, 202, 203]] * 2
    assert outputs["all_reduce_mean"] == [[150, 151, 152, 153]] * 2
    assert outputs["all_reduce_avg_op"] == [[150, 151, 152, 153]] * 2
    assert outputs["all_gather"] == [[100, 101, 102, 103, 200, 201, 202, 203]] * 2
    assert outputs["reduce_scatter"] == [[300, 302], [304, 306]]  # rank r holds chunk r of the sum
    assert outputs["send_recv_ring"] == [[200, 201, 202, 203], [100, 101, 102, 103]]  # from rank r-1
    assert {record["status"] for record in checks["collectives"].values()} == {"PASS"}


@pytest.mark.timeout(240)
def test_the_barrier_check_measures_each_ranks_own_wait(full_run):
    """Each rank times its wait on its own clock: rank 0 waited for the late rank 1, which did not wait."""
    result, out = full_run
    assert result.ok, result.describe()
    (rank0_wait,), (rank1_wait,) = read_json(out / "checks.json")["collectives"]["barrier"]["outputs"]
    # Rank 1 slept 0.2 s before the barrier; half of that separates "waited" from "did not".
    assert rank0_wait >= 0.1 and rank1_wait < 0.1, (rank0_wait, rank1_wait)


@pytest.mark.timeout(30)
def test_the_barrier_verdict_fails_when_an_early_rank_did_not_wait():
    """Negative controls for check_barrier's verdict: a barrier that lets ranks through must FAIL."""
    barrier_held = load_lab1().barrier_held
    assert barrier_held([0.21, 0.003], late_rank=1)
    assert barrier_held([0.20, 0.25, 0.001], late_rank=2)
    assert not barrier_held([0.002, 0.001], late_rank=1)  # nobody waited: the barrier did not hold
    assert not barrier_held([0.21, 0.002, 0.001], late_rank=2)  # rank 1 left without waiting
    assert not barrier_held([0.21, 0.20], late_rank=1)  # the late rank waited too: it was not the last


@pytest.mark.timeout(240)
def test_the_checker_can_fail_a_corrupted_rank(jobs):
    """Negative control (the lab's --corrupt-rank self-test): rank 1 contributes a wrong value."""
    result = jobs[0]["corrupt"].result()
    assert not result.timed_out and result.returncode != 0, result.describe()
    found = verdicts(result.stdout)
    # Broadcast from rank 0 and the barrier never read rank 1's data; everything else does.
    assert found == {name: "PASS" if name in ("broadcast", "barrier") else "FAIL" for name in COLLECTIVES}, result.describe()
    # The value sits in chunk 0, which only rank 0 receives from reduce-scatter and the ring.
    assert re.search(r"FAIL  reduce_scatter +wrong on rank\(s\) 0$", result.stdout, flags=re.MULTILINE)
    assert re.search(r"FAIL  all_reduce_sum +wrong on rank\(s\) 0, 1$", result.stdout, flags=re.MULTILINE)
    assert "2/10 collectives passed, 8 FAILED" in result.stdout


def assert_well_formed(records, sizes, world_size=2):
    assert [record["bytes"] for record in records] == sizes
    for record in records:
        assert set(record) == RECORD_FIELDS
        assert record["world_size"] == world_size and record["backend"] == "gloo"
        assert record["time_s"] > 0 and record["algbw_gbps"] > 0 and record["busbw_gbps"] > 0
        # nccl-tests' definitions (doc/PERFORMANCE.md): algbw = bytes / time, busbw = algbw x 2(N-1)/N.
        assert math.isclose(record["algbw_gbps"], record["bytes"] / record["time_s"] / 1e9, rel_tol=1e-9)
        assert math.isclose(record["busbw_gbps"], record["algbw_gbps"] * 2 * (world_size - 1) / world_size, rel_tol=1e-12)


@pytest.mark.timeout(240)
def test_default_sweep_goes_from_4_kib_to_64_mib_with_a_table_and_a_plot(full_run):
    result, out = full_run
    assert result.ok, result.describe()
    assert_well_formed(read_json(out / "bench.json"), DEFAULT_SIZES)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table_rows = re.findall(r"^ +([\d,]+) +[\d.]+ +[\d.]+ +[\d.]+$", result.stdout, flags=re.MULTILINE)
    assert [int(row.replace(",", "")) for row in table_rows] == DEFAULT_SIZES, result.describe()
    assert "3 warm-up + 20 timed calls per size, median of the slowest rank's times" in result.stdout
    assert "nccl-tests" not in result.stdout  # the note on host-side overhead is for NCCL runs only
    # Not a timing assertion: a bound against hangs and runaway sweeps (checks and sweep together
    # take well under half a minute on an idle 2-core CPU).
    assert result.wall_s < 150, result.describe()


@pytest.mark.timeout(30)
def test_message_sizes_follow_min_max_and_factor():
    """The sweep's sizes, in-process: --min-bytes times --factor up to --max-bytes; defaults per device."""
    lab1 = load_lab1()

    def sizes(*argv, device="cpu"):
        return lab1.message_sizes(lab1.parse_args(["--bench", *argv]), device)

    assert sizes("--min-bytes", "4K", "--max-bytes", "256K", "--factor", "4") == [4096, 16384, 65536, 262144]
    assert sizes("--min-bytes", "4K", "--max-bytes", "300K", "--factor", "4") == [4096, 16384, 65536, 262144]
    assert sizes("--min-bytes", "1M", "--max-bytes", "1M") == [2**20]
    assert sizes() == DEFAULT_SIZES  # the CPU default: up to 64 MiB
    assert sizes(device="cuda")[-1] == 2**30  # the GPU default: up to 1 GiB


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--min-bytes", "3"], r"--min-bytes: must be a multiple of 4 bytes"),
        (["--min-bytes", "lots"], r"--min-bytes: must be a multiple of 4 bytes .* got 'lots'"),
        (["--bench", "--min-bytes", "1M", "--max-bytes", "4K"], r"--max-bytes \(4096\) is smaller than --min-bytes"),
        (["--bench", "--factor", "1"], r"--factor: must be 2 or more"),
        (["--iters", "0"], r"--iters: must be a positive integer"),
        (["--json", "out.json"], r"--json and --plot record the benchmark: add --bench"),
        (["--backend", "mpi"], r"invalid choice: 'mpi'"),
    ],
)
def test_bad_flags_fail_with_one_line(args, expected, refused_flag_line):
    assert re.search(expected, refused_flag_line(load_lab1(), args))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("args", "expected"), BAD_FLAGS_UNDER_TORCHRUN)
def test_bad_flags_under_torchrun_print_one_line_for_the_job(jobs, args, expected):
    result = jobs[0][tuple(args)].result()
    assert not result.timed_out and result.returncode != 0, result.describe()
    script_errors = [line for line in result.stderr.splitlines() if line.startswith("lab1_collectives.py: error:")]
    assert len(script_errors) == 1, result.describe()
    assert re.search(expected, script_errors[0]), result.describe()
    assert 'lab1_collectives.py", line' not in result.stderr, result.describe()  # no traceback from the script


# --- the sheet's self-check ------------------------------------------------------------------------


def collective_results(contributions):
    """{collective: what each rank holds after it} for 2+ ranks' tensors, by each collective's definition
    (lecture 2 §1), in plain torch: no process group. `reduce` is defined on rank 0 only."""
    world_size = len(contributions)
    total = sum(contributions)
    return {
        "broadcast": [contributions[0]] * world_size,
        "reduce": [total],
        "all_reduce_sum": [total] * world_size,
        "all_reduce_max": [torch.stack(contributions).amax(dim=0)] * world_size,
        "all_reduce_mean": [total / world_size] * world_size,
        "all_gather": [torch.cat(contributions)] * world_size,
        "reduce_scatter": list(total.chunk(world_size)),
        "send_recv_ring": [contributions[(rank - 1) % world_size] for rank in range(world_size)],
    }


def failing_collectives(corrupt_rank, world_size=2, length=4):
    """The collectives whose result on some rank changes when corrupt_rank adds 0.5 to its first value."""
    expected = [100.0 * (rank + 1) + torch.arange(length, dtype=torch.float32) for rank in range(world_size)]
    corrupted = [tensor.clone() for tensor in expected]
    corrupted[corrupt_rank][0] += 0.5
    right, got = collective_results(expected), collective_results(corrupted)
    return {name for name in right if any(not torch.equal(a, b) for a, b in zip(right[name], got[name], strict=True))}


@pytest.mark.timeout(30)
def test_self_check_names_the_one_collective_that_rank_0s_corruption_does_not_reach():
    from ddp_course.lab_self_checks import LAB1_SELF_CHECK
    from ddp_course.self_check import verdict

    # The model agrees with the sheet's own stored run of section 3 (--corrupt-rank 1): the same FAIL lines.
    cells = json.loads((REPO_ROOT / "labs" / "lab1_collectives.ipynb").read_text())["cells"]
    [section_3_output] = ["".join(cell["outputs"][0]["text"]) for cell in cells if "corrupt_run = corrupt_job.result()" in "".join(cell["source"])]
    stored = verdicts(section_3_output)
    assert {name for name, status in stored.items() if status == "FAIL"} == failing_collectives(corrupt_rank=1)
    # Failed in section 3, passes with rank 0 corrupted: exactly one collective, the self-check's answer.
    assert failing_collectives(corrupt_rank=1) - failing_collectives(corrupt_rank=0) == {LAB1_SELF_CHECK.expected}
    assert verdict(LAB1_SELF_CHECK, " All_Reduce_Max ").startswith("self-check: correct")
    # The classic mistakes: broadcast (passed in section 3, but now its source is wrong) and the barrier (no data).
    for wrong in ("broadcast", "barrier"):
        assert verdict(LAB1_SELF_CHECK, wrong) == f"self-check: not yet - {LAB1_SELF_CHECK.hint}"
    assert "broadcast" in failing_collectives(corrupt_rank=0)
