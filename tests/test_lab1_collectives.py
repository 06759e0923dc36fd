"""labs/lab1_collectives.py launched as a learner launches it: torchrun, 2 gloo ranks on the CPU."""

import json
import math
import re

import pytest

from ddp_course.launch import REPO_ROOT, run_torchrun

LAB1 = REPO_ROOT / "labs" / "lab1_collectives.py"
COLLECTIVES = [
    "broadcast", "reduce", "all_reduce_sum", "all_reduce_max", "all_reduce_mean", "all_reduce_avg_op",
    "all_gather", "reduce_scatter", "barrier", "send_recv_ring",
]  # fmt: skip
RECORD_FIELDS = {"bytes", "time_s", "algbw_gbps", "busbw_gbps", "world_size", "backend"}


def run_lab1(*args, nproc=2, timeout_s=120):
    return run_torchrun(LAB1, args, nproc=nproc, timeout_s=timeout_s)


def verdicts(stdout: str) -> dict[str, str]:
    """{collective: PASS/FAIL/SKIP} from the lab's report lines."""
    return {name: status for status, name in re.findall(r"^(PASS|FAIL|SKIP)  (\w+)", stdout, flags=re.MULTILINE)}


def read_json(path):
    with open(path) as file:
        return json.load(file)


@pytest.mark.timeout(120)
def test_every_collective_passes_and_the_results_are_the_expected_ones(tmp_path):
    result = run_lab1("--checks-json", tmp_path / "checks.json")
    assert result.ok, result.describe()
    assert verdicts(result.stdout) == {name: "PASS" for name in COLLECTIVES}, result.describe()
    assert "10/10 collectives passed" in result.stdout

    # The lab's own verdicts, checked again from outside with numbers written out by hand:
    # rank 0 contributes [100, 101, 102, 103], rank 1 [200, 201, 202, 203].
    checks = read_json(tmp_path / "checks.json")
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


@pytest.mark.timeout(120)
def test_the_checker_can_fail_a_corrupted_rank():
    """Negative control (the lab's --corrupt-rank self-test): rank 1 contributes a wrong value."""
    result = run_lab1("--corrupt-rank", "1")
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


@pytest.mark.timeout(120)
def test_bench_writes_one_record_per_requested_size_and_a_plot(tmp_path):
    result = run_lab1(
        "--bench", "--min-bytes", "4K", "--max-bytes", "256K", "--factor", "4", "--warmup", "1", "--iters", "3",
        "--json", tmp_path / "bench.json", "--plot", tmp_path / "bench.png",
    )  # fmt: skip
    assert result.ok, result.describe()
    assert_well_formed(read_json(tmp_path / "bench.json"), [4096, 16384, 65536, 262144])
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table_rows = re.findall(r"^ +([\d,]+) +[\d.]+ +[\d.]+ +[\d.]+$", result.stdout, flags=re.MULTILINE)
    assert [int(row.replace(",", "")) for row in table_rows] == [4096, 16384, 65536, 262144], result.describe()


@pytest.mark.timeout(240)
def test_default_sweep_goes_from_4_kib_to_64_mib_well_under_a_minute(tmp_path):
    result = run_lab1("--bench", "--json", tmp_path / "bench.json", timeout_s=200)
    assert result.ok, result.describe()
    assert_well_formed(read_json(tmp_path / "bench.json"), [4096 * 2**k for k in range(15)])  # 4 KiB .. 64 MiB
    # Not a timing assertion: a bound against hangs and runaway sweeps (about 10 s on an idle 2-core CPU).
    assert result.wall_s < 120, result.describe()


@pytest.mark.timeout(60)
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
        (["--corrupt-rank", "2"], r"--corrupt-rank 2: there is no such rank \(0\.\.1\)"),
    ],
)
def test_bad_flags_fail_with_one_line(args, expected):
    result = run_lab1(*args)
    assert not result.timed_out and result.returncode != 0, result.describe()
    script_errors = [line for line in result.stderr.splitlines() if line.startswith("lab1_collectives.py: error:")]
    assert len(script_errors) == 1, result.describe()
    assert re.search(expected, script_errors[0]), result.describe()
    assert 'lab1_collectives.py", line' not in result.stderr, result.describe()  # no traceback from the script
