"""labs/lab8_fsdp.py: the check, the bytes kept and sent, the verdicts, the JSON records, the exercise's TODO
line and its per-part check, bad flags.

The lab runs inside the 2-rank launch that tests/test_minddp.py, test_minifsdp.py and test_lab9 share
(conftest's `sharding_checks`, tests/scripts/sharding_checks.py): one gloo group runs lab 8's own judge() -
what main() runs between setting up and tearing down the group - on each row of tests/scripts/lab8_mutants.py
and records its exit status, what rank 0 printed and the lab's JSON records. Rows: every implementation on
the finished code (few steps, one timing repeat); the untouched exercise (its first TODO, in one line); an
FSDP that sums the ranks' gradients instead of averaging them; one whose forward never frees the full
weights (right weights, so only the around-use check and the bytes can catch it) - each wrong one must
exit 1 with a FAIL line naming its concept; and the per-part check on the exercise as a learner has it.
main() itself runs under torchrun in the lab 8 sheet (nbval). One process is refused in this process, as
are bad flags. The 4-rank figures (model state <= 0.30x DDP's) and the step-time target are the
benchmark's (benchmarks/sharded_dp.py); 4-rank bytes of every implementation are lab 9's (its reference).
"""

import json
import types

import nbformat
import pytest

from ddp_course.launch import REPO_ROOT, import_script

LAB8 = REPO_ROOT / "labs" / "lab8_fsdp.py"
SHEET = REPO_ROOT / "labs" / "lab8_fsdp.ipynb"
IMPLS = ["ddp", "zero1", "zero2", "fsdp", "fully_shard", "fully_shard_keep"]


@pytest.fixture(scope="module")
def lab8():
    return import_script(LAB8, "lab8_fsdp")


@pytest.fixture(scope="module")
def mutants(sharding_checks):
    """{row: {"status", "stdout", "stderr", "records"}}: lab 8's rows, from the shared 2-rank launch."""
    result, minddp_json = sharding_checks(2)
    assert not result.timed_out and result.returncode in (0, 1), result.describe()  # 1: some minifsdp case failed
    path = minddp_json.with_name("lab8.json")
    assert path.exists(), result.describe()
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def job(mutants):
    """Lab 8 on every implementation: what rank 0 printed (.stdout) and {impl: record}."""
    row = mutants["all_impls"]
    assert row["status"] == 0, row["stdout"] + row["stderr"]
    return types.SimpleNamespace(stdout=row["stdout"]), {record["impl"]: record for record in row["records"]}


@pytest.mark.timeout(480)  # covers the shared launch when this test is the first to use it
def test_every_implementation_matches_one_process(job):
    result, records = job
    assert list(records) == IMPLS
    for record in records.values():
        assert record["check_passed"] and record["max_abs_diff_vs_single_process"] <= record["tolerance"], record
    assert "no sync          max|w - one process|" in result.stdout and "differs (control)" in result.stdout


@pytest.mark.timeout(480)
def test_an_fsdp_that_sums_fails_on_its_weights(mutants):
    """The negative control: the same check catches an FSDP that forgets to average, and says so."""
    row = mutants["sums"]
    assert row["status"] == 1, row
    assert "fsdp             max|w - one process|" in row["stdout"] and "verdict fsdp             FAIL" in row["stdout"]
    fails = [line for line in row["stdout"].splitlines() if line.startswith("  FAIL: ")]
    assert len(fails) == 1 and "not the average over ranks" in fails[0], fails  # one mistake, one concept
    assert row["stderr"].strip() == "lab8_fsdp.py: error: the check FAILED: see the FAIL lines above"


@pytest.mark.timeout(480)
def test_an_fsdp_that_never_frees_after_forward_fails(mutants):
    """Review finding 3: weights right (backward finds them gathered), but full weights held from forward to
    backward. Only the around-use check and the bytes per step see it; lab 8's block units. (The lab before
    this check passed it with status 0.)"""
    row = mutants["never_frees"]
    assert row["status"] == 1, row
    assert "  fsdp             max|w - one process|" in row["stdout"] and "e-07   PASS" in row["stdout"]  # the weights are right
    fails = [line for line in row["stdout"].splitlines() if line.startswith("  FAIL: ")]
    assert any("still gathered after forward" in line and "(part 2)" in line for line in fails), fails
    assert any("gathered at once" in line and "only around their use" in line for line in fails), fails
    assert any("0.669x the formula's bytes" in line for line in fails), fails  # backward gathers nothing
    assert row["stderr"].strip() == "lab8_fsdp.py: error: the check FAILED: see the FAIL lines above"


@pytest.mark.timeout(480)
def test_the_untouched_exercise_refuses_with_its_first_todo(mutants):
    row = mutants["untouched"]
    errors = row["stderr"].strip().splitlines()
    assert row["status"] == 1 and len(errors) == 1, row
    assert errors[0].startswith("lab8_fsdp.py: error: labs/minifsdp.py is not finished: TODO(lab 8, part 1): "), errors


@pytest.mark.timeout(480)
def test_model_state_per_rank_follows_the_stages(job):
    """AdamW, 2 ranks. DDP: parameters = gradients, Adam's two moments twice that (plus 4-byte step
    counters); ZeRO-1 halves the optimizer state only; ZeRO-2 the gradients too; both FSDPs halve
    everything (target <= 0.55x DDP)."""
    _, records = job
    ddp = records["ddp"]["model_state_bytes"]
    moments = ddp["optimizer_state"] - 2 * ddp["parameters"]  # what is left is the step counters
    assert ddp["gradients"] == ddp["parameters"] and 0 <= moments < 1000, ddp
    zero1 = records["zero1"]["model_state_bytes"]
    assert zero1["parameters"] == ddp["parameters"] and zero1["gradients"] == ddp["gradients"]
    assert 0.5 <= zero1["optimizer_state"] / ddp["optimizer_state"] < 0.6, zero1  # the fullest rank: uneven tensors
    zero2 = records["zero2"]["model_state_bytes"]
    assert zero2["parameters"] == ddp["parameters"] and 0.5 <= zero2["gradients"] / ddp["gradients"] < 0.501, zero2
    assert zero2["optimizer_state"] / ddp["optimizer_state"] == pytest.approx(0.5, abs=0.001), zero2  # even slices
    assert records["zero2"]["state_vs_ddp"] == pytest.approx(0.625, abs=0.001)  # (4 + 12 / 2) / 16
    for impl in ("fsdp", "fully_shard"):
        state = records[impl]["model_state_bytes"]
        assert 0.5 <= state["parameters"] / ddp["parameters"] < 0.52, (impl, state)
        assert 0.5 <= records[impl]["state_vs_ddp"] <= 0.55, (impl, records[impl]["state_vs_ddp"])


@pytest.mark.timeout(480)
def test_every_implementation_passes_and_fsdp_gathers_only_around_use(job):
    """The verdict (weights, bytes, and for our FSDP the around-use check) PASSes for each; during a step our
    FSDP holds its slices plus at most the root's and one block's full weights (exactly that bound here),
    none after forward; DDP and ZeRO-1 hold the same weights at the peak as between steps."""
    result, records = job
    for impl, record in records.items():
        assert record["passed"] and record["failures"] == [] and f"verdict {impl:<16} PASS" in result.stdout, record
    fsdp = records["fsdp"]
    assert fsdp["gathered_after_forward_bytes"] == 0 and 0 < fsdp["gathered_peak_bytes"] <= fsdp["gathered_bound_bytes"]
    assert fsdp["gathered_bound_bytes"] == 4 * 128 * (98 + 64 + 3 * 128 + 128 + 512 + 512)  # root (padded), one block
    assert fsdp["weights_peak_bytes"] == fsdp["model_state_bytes"]["parameters"] + fsdp["gathered_peak_bytes"]
    assert records["fully_shard"]["gathered_after_forward_bytes"] == 0 and records["fully_shard"]["gathered_peak_bytes"] > 0
    for impl in ("ddp", "zero1", "zero2"):
        assert records[impl]["weights_peak_bytes"] == records[impl]["model_state_bytes"]["parameters"]
        assert records[impl]["gathered_peak_bytes"] == 0
    # reshard_after_forward=False keeps every block gathered from its forward to its backward: at the peak,
    # the shards plus every full weight (the root's too); between steps, the shards only, as fully_shard
    keep, ddp_weights = records["fully_shard_keep"], records["ddp"]["model_state_bytes"]["parameters"]
    assert keep["model_state_bytes"] == records["fully_shard"]["model_state_bytes"]
    assert ddp_weights <= keep["gathered_peak_bytes"] <= ddp_weights + 512  # fully_shard pads the 97-row embedding to 98
    assert keep["weights_peak_bytes"] == keep["gathered_peak_bytes"] + keep["model_state_bytes"]["parameters"]
    assert all(record["cuda_peak_allocated_bytes"] is None for record in records.values())  # CPU: no CUDA figure


@pytest.mark.timeout(480)
def test_bytes_per_step_match_the_formula(job):
    """Measured wire bytes within 5% of the formula; ZeRO-3 sends 1.5x DDP's bytes (the replicated
    1-D parameters of the from-scratch FSDP are all-reduced, which keeps it just under 1.5x)."""
    _, records = job
    for impl, record in records.items():
        assert abs(record["bytes_vs_formula"] - 1) <= 0.05, (impl, record["bytes_vs_formula"])
    ddp = records["ddp"]["ring_model_bytes_per_step"]
    assert records["fully_shard"]["ring_model_bytes_per_step"] / ddp == pytest.approx(1.5, rel=0.01)
    assert records["fsdp"]["ring_model_bytes_per_step"] / ddp == pytest.approx(1.5, rel=0.02)
    # ZeRO-2 splits DDP's all-reduce into a reduce-scatter and an all-gather; fully_shard without resharding
    # gathers once: both send DDP's bytes (up to padding to a multiple of 2 elements)
    for impl in ("zero2", "fully_shard_keep"):
        assert records[impl]["ring_model_bytes_per_step"] / ddp == pytest.approx(1.0, rel=0.01), impl


@pytest.mark.timeout(480)
def test_each_implementation_uses_its_collectives(job):
    _, records = job
    kinds = {impl: set(record["collective_bytes_by_kind"]) for impl, record in records.items()}
    assert kinds == {"ddp": {"all_reduce"}, "zero1": {"all_reduce", "broadcast"}, "zero2": {"reduce_scatter", "all_gather"},
                     "fsdp": {"all_gather", "reduce_scatter", "all_reduce"}, "fully_shard": {"all_gather", "reduce_scatter"},
                     "fully_shard_keep": {"all_gather", "reduce_scatter"}}  # fmt: skip
    zero2 = records["zero2"]["collective_bytes_by_kind"]
    # one reduce-scatter and one all-gather per bucket of about 1 MiB (lab 8's ZERO2_BUCKET_MB): 4 buckets here
    assert zero2["reduce_scatter"] == zero2["all_gather"] and records["zero2"]["messages_per_step"] == 2 * 4
    fsdp = records["fsdp"]["collective_bytes_by_kind"]
    assert fsdp["all_gather"] == 2 * fsdp["reduce_scatter"]  # gathered before forward and again before backward
    # One message per unit (4 blocks and the root) per collective, and one all-reduce of the vectors: the
    # grouping that makes it as fast as fully_shard (which also shards the vectors: no all-reduce).
    units = 4 + 1
    assert records["fsdp"]["fsdp_units"] == "blocks" and records["fsdp"]["messages_per_step"] == 3 * units + 1
    assert records["fully_shard"]["messages_per_step"] == 3 * units
    assert records["fully_shard_keep"]["messages_per_step"] == 2 * units  # no second all-gather


@pytest.mark.timeout(480)
def test_records_and_timing_table(job):
    result, records = job
    for record in records.values():
        assert record["world_size"] == 2 and record["backend"] == "gloo" and len(record["step_times_s"]) == 1
        assert record["step_time_s"] > 0 and record["vs_fully_shard"] > 0
    assert records["fsdp"]["module"] == "solutions" and records["fully_shard"]["module"] == "torch"
    assert "step time (AdamW): median of 1 repeats" in result.stdout


def part_lines(row) -> list[str]:
    return [line for line in row["stdout"].splitlines() if line.startswith("part ")]


def todo_line(row) -> str:
    errors = row["stderr"].strip().splitlines()
    assert row["status"] == 1 and len(errors) == 1, row
    return errors[0]


@pytest.mark.timeout(480)
def test_the_per_part_check_follows_a_learner_through_the_parts(mutants):
    """--part K checks parts 1..K on the exercise as a learner has it: untouched, it names part 1's TODO; with
    part 1 solved, part 1 PASSes and part 2's TODO stops it; with parts 1 and 2 solved, --part 2 PASSes
    without running part 3 (forward under no_grad prepares no backward) and --part 3 stops at part 3's TODO."""
    assert "is not finished: TODO(lab 8, part 1): " in todo_line(mutants["part1_untouched"])
    row = mutants["part2_solved_1"]
    assert [line.split(":")[0] for line in part_lines(row)] == ["part 1  PASS  shard_rows", "part 1  PASS  gather_full_params"]
    assert "is not finished: TODO(lab 8, part 2): " in todo_line(row)
    row = mutants["part2_solved_12"]
    assert row["status"] == 0 and row["stderr"] == "", row
    assert [line.split(":")[0] for line in part_lines(row)] == ["part 1  PASS  shard_rows", "part 1  PASS  gather_full_params",
                                                                "part 2  PASS  forward", "part 2  PASS  full weights only around their use"]  # fmt: skip
    row = mutants["part3_solved_12"]
    assert len(part_lines(row)) == 4 and all("  PASS  " in line for line in part_lines(row))
    assert "is not finished: TODO(lab 8, part 3): " in todo_line(row)


@pytest.mark.timeout(480)
def test_the_part_2_check_fails_a_forward_that_never_frees(mutants):
    row = mutants["part2_never_frees"]
    assert "part 2  FAIL  full weights only around their use: after forward 3,228,672 B gathered" in row["stdout"], row
    assert todo_line(row) == "lab8_fsdp.py: error: --part 2 FAILED: see the FAIL lines above"


def test_one_process_is_refused_in_one_line(lab8, capsys):
    """Review finding 1: one rank shards nothing and sends 0 bytes (every ratio would divide by 0); the lab
    refuses in one line with status 1 (it used to print a table of meaningless ratios and exit 0).
    Plain python in this process: a group of one, as on a machine with one GPU."""
    assert lab8.main(lab8.parse_args(["--module", "solutions", "--impl", "fsdp", "--repeats", "0"])) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.count("\n") == 1, printed
    assert ": error: lab 8 needs 2 or more ranks" in printed.err and "this job has 1" in printed.err  # "pytest: error" here


def test_the_sheet_refuses_one_gpu_in_one_line(monkeypatch):
    """Review finding 1, the GPU track: with one GPU the sheet stops in its first code cell, in one line,
    before starting a job (it used to start one and divide by zero later). Run in this process, on CPU,
    with torch told that there is one GPU."""
    import torch

    import ddp_course.launch

    source = next(cell.source for cell in nbformat.read(SHEET, as_version=4).cells if "USE_GPUS = False" in cell.source)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ddp_course.launch, "SheetJobs", lambda *args, **kwargs: pytest.fail("the sheet started a job on one GPU"))
    with pytest.raises(SystemExit) as stopped:
        exec(compile(source.replace("USE_GPUS = False", "USE_GPUS = True", 1), "<lab 8 sheet>", "exec"), {})
    assert str(stopped.value).startswith("lab 8 needs 2 or more ranks; this machine has 1 GPU(s)") and "\n" not in str(stopped.value)


def test_bad_flags_are_refused_in_one_line(lab8, refused_flag_line, tmp_path):
    assert "invalid choice: 'zero3'" in refused_flag_line(lab8, ["--impl", "zero3"])
    assert "is a folder" in refused_flag_line(lab8, ["--json", str(tmp_path)])
    assert "--repeats" in refused_flag_line(lab8, ["--repeats", "-1"])


def test_zero2_counts_a_missing_gradient_as_zeros_and_a_tied_weight_once():
    """labs/minizero2.py in this process, on a group of one (the reduce-scatter and all-gather are then copies):
    a parameter backward never reached gets a zero slice, a weight used twice gets the sum of both uses,
    and one SGD step gives the weights plain SGD gives. Tiny buckets, so the model spans several."""
    import torch
    import torch.distributed as dist
    from torch import nn

    minizero2 = import_script(REPO_ROOT / "labs" / "minizero2.py", "minizero2_unit")

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.unused, self.head = nn.Embedding(5, 3), nn.Linear(3, 3), nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.embed(tokens))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain, tokens = Tied(), torch.tensor([[0, 3, 4]])
        sharded = Tied()
        sharded.load_state_dict(plain.state_dict())
        model = minizero2.ZeRO2(sharded, bucket_cap_mb=20 / 2**20)  # 20 bytes: a bucket per parameter
        optimizer = minizero2.ShardedStep(model, torch.optim.SGD, lr=0.1)
        assert len(model.buckets) == 3
        model(tokens).sum().backward()
        model.finish_gradient_synchronization()
        plain(tokens).sum().backward()
        unused = next(b for b in model.buckets if b.parameters[0] is sharded.unused.weight)
        assert not unused.shard.grad.any()  # weight and bias of the unused layer: zeros
        tied = next(b for b in model.buckets if b.parameters[0] is sharded.embed.weight)
        assert torch.equal(tied.shard.grad[: plain.embed.weight.numel()], plain.embed.weight.grad.flatten())  # both uses
        optimizer.step()
        torch.optim.SGD(plain.parameters(), lr=0.1).step()
        assert all(torch.equal(a, b) for a, b in zip(sharded.parameters(), plain.parameters()))
    finally:
        dist.destroy_process_group()
