"""labs/lab9_fsdp_practice.py: every part PASSes on 2 and 4 gloo ranks, each claim holds in the numbers, and
the reference the lab 9 sheet shows (solutions/lab9_reference/) is what the lab measures now.

Lab 9 runs inside the launches tests/test_minddp.py, test_minifsdp.py and test_lab8_fsdp.py share (one per
world size: conftest's `sharding_checks`): its judge() - what main() runs between setting up and tearing
down the process group - on the memory, checkpoint and clip parts at 2 ranks, memory, meta, hsdp and
resume at 4. The sheet draws the reference instead of launching the lab again (a 4-rank job on 2 cores
would cost the suite what these launches already pay); so each world size's machine-independent facts -
bytes, counts, verdicts, the phases of a step - must equal the reference's, and the machine-dependent ones
(allocator peaks, float differences) must keep the reference's verdicts. One process and bad flags are
refused in this process.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from ddp_course import fsdp_practice as practice
from ddp_course import sharded_training, sharding
from ddp_course.authoring.notebooks import stored_cell
from ddp_course.cli import CourseError
from ddp_course.launch import REPO_ROOT, import_script

LAB9 = REPO_ROOT / "labs" / "lab9_fsdp_practice.py"
REFERENCE = REPO_ROOT / "solutions" / "lab9_reference"
REGENERATE = ("stale reference: torchrun --standalone --nproc_per_node={n} labs/lab9_fsdp_practice.py --parts {parts} "
              "--json solutions/lab9_reference/ranks{n}.json (solutions/lab9_reference/README.md)")  # fmt: skip


@pytest.fixture(scope="module")
def lab9():
    return import_script(LAB9, "lab9_fsdp_practice")


@pytest.fixture(scope="module")
def fresh(sharding_checks):
    """fresh(n) -> lab 9's report from the shared n-rank launch (after checking that it exited 0)."""

    def report(n):
        result, minddp_json = sharding_checks(n)
        assert not result.timed_out, result.describe()
        row = json.loads(minddp_json.with_name("lab9.json").read_text())
        assert row["status"] == 0 and row["stderr"] == "", row["stdout"] + row["stderr"]
        return row["report"]

    return report


def reference(n) -> dict:
    return json.loads((REFERENCE / f"ranks{n}.json").read_text())


def machine_independent(report: dict) -> dict:
    """What must come out the same on any machine: bytes, counts, the phases of a step, the verdicts."""
    found = {"world_size": report["world_size"]}
    if "memory" in report:
        memory = report["memory"]
        found["memory"] = {key: memory[key] for key in ("categories", "labels", "sizes", "passed")}
        kept = (
            "bytes",
            "counted_peak_bytes",
            "counted_peak_at",
            "predicted_peak_bytes",
            "activations_after_forward",
            "counted_passed",
            "measured_passed",
            "ring_model_bytes_per_step",
            "messages_per_step",
        )
        found["memory"]["impls"] = {impl: {key: facts[key] for key in kept} for impl, facts in memory["impls"].items()}
        found["memory"]["zero2_check"] = memory["zero2_check"]["passed"]
    if "meta" in report:
        found["meta"] = {key: report["meta"][key] for key in ("whole_model_bytes", "loaded_equals_saved", "passed")}
    if "checkpoint" in report:
        found["checkpoint"] = {setting: {key: report["checkpoint"][setting][key] for key in ("saved_after_forward_bytes", "all_gathers", "ring_model_bytes")}
                               for setting in ("plain", "checkpointed")} | {"passed": report["checkpoint"]["passed"]}  # fmt: skip
    if "clip" in report:
        found["clip"] = {how: {key: report["clip"][how][key] for key in ("norms_agree", "replicated_parameters_agree", "passed")}
                         for how in ("naive", "fixed", "fully_shard")}  # fmt: skip
    if "hsdp" in report:
        found["hsdp"] = {key: report["hsdp"][key] for key in ("mesh", "parameter_bytes", "ring_model_bytes_by_dimension", "calls_by_dimension", "passed")}
    if "resume" in report:
        found["resume"] = {key: report["resume"][key] for key in ("saved_on", "resumed_on", "steps", "saved_after", "passed")}
    return found


@pytest.mark.timeout(480)
@pytest.mark.parametrize("n, parts", [(2, "memory,checkpoint,clip"), (4, "memory,meta,hsdp,resume")])
def test_the_reference_the_sheet_shows_is_what_the_lab_measures(fresh, n, parts):
    report = fresh(n)
    assert sorted(part for part in report if part in ("memory", "meta", "checkpoint", "clip", "hsdp", "resume")) == sorted(parts.split(","))
    assert machine_independent(report) == machine_independent(reference(n)), REGENERATE.format(n=n, parts=parts)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("n", [2, 4])
def test_every_implementations_peak_is_the_formulas(fresh, n):
    """Counted within 5 % of the predicted peak, and measured by the allocator within [-1/4 W, +3/4 W] of it;
    the allocator never holds less than the count. DDP's counted peak at the end of forward (the activations
    and everything else still there), every FSDP's in backward's first block."""
    memory = fresh(n)["memory"]
    low, high = memory["measured_tolerance"]
    for impl, facts in memory["impls"].items():
        assert facts["passed"] and abs(facts["counted_vs_predicted"] - 1) <= memory["counted_tolerance"], (impl, facts["counted_vs_predicted"])
        assert low <= facts["measured_minus_predicted_in_w"] <= high, (impl, facts["measured_minus_predicted_in_w"])
        assert facts["measured_peak_bytes"] >= facts["counted_peak_bytes"], impl  # the counted tensors are allocated too
    peaks = {impl: facts["counted_peak_bytes"] for impl, facts in memory["impls"].items()}
    assert peaks["ddp"] > peaks["zero1"] > peaks["fully_shard_keep"] > peaks["fsdp"] and peaks["zero1"] > peaks["zero2"] > peaks["fsdp"]
    impls = memory["impls"]
    assert impls["ddp"]["counted_peak_at"] == "forward < head" and impls["fsdp"]["counted_peak_at"].startswith("backward > blocks.")
    totals = {impl: [sum(sample) for sample in facts["bytes"]] for impl, facts in impls.items()}
    start = memory["labels"].index("start")
    assert all(totals["fsdp"][start] < totals[other][start] for other in ("ddp", "zero1", "zero2"))  # between steps too
    # ZeRO-2 from scratch: DDP's payloads at ring costs per step, and one process's weights, at 2 and 4 ranks
    assert impls["zero2"]["ring_model_bytes_per_step"] == pytest.approx(impls["ddp"]["ring_model_bytes_per_step"], rel=0.01)
    assert memory["zero2_check"]["passed"] and memory["zero2_check"]["max_abs_diff_vs_single_process"] <= memory["zero2_check"]["tolerance"]


@pytest.mark.timeout(480)
def test_no_rank_builds_the_whole_model(fresh):
    """4 ranks: built on the meta device and loaded from a sharded checkpoint, no rank's allocator ever holds
    the whole model's bytes (about a quarter), built whole first it does; the loaded weights are the saved."""
    meta = fresh(4)["meta"]
    assert meta["peak_bytes"]["meta"] < meta["whole_model_bytes"] / 2 < meta["whole_model_bytes"] <= meta["peak_bytes"]["whole_then_sharded"]
    assert meta["loaded_equals_saved"] and meta["passed"]


@pytest.mark.timeout(480)
def test_activation_checkpointing_saves_memory_not_all_gathers(fresh):
    checkpoint = fresh(2)["checkpoint"]
    plain, checkpointed = checkpoint["plain"], checkpoint["checkpointed"]
    assert checkpointed["allocator_peak_bytes"] < plain["allocator_peak_bytes"]
    assert checkpointed["saved_after_forward_bytes"] < plain["saved_after_forward_bytes"] / 5
    assert checkpointed["all_gathers"] == plain["all_gathers"] == 9 and checkpointed["ring_model_bytes"] == plain["ring_model_bytes"]
    assert checkpoint["weights_equal"]


@pytest.mark.timeout(480)
def test_clipping_across_shards(fresh):
    """The naive clip: each rank another norm, the replicated parameters apart, the weights off; the fix and
    torch's clip on DTensors: every rank the one-process norm, within the derived bound of one process."""
    clip = fresh(2)["clip"]
    naive = clip["naive"]
    assert len(set(naive["first_step_norms_by_rank"])) == 2 and not naive["norms_agree"] and not naive["replicated_parameters_agree"]
    assert naive["max_abs_diff_vs_one_process"] > 100 * clip["tolerance"]
    for how in ("fixed", "fully_shard"):
        assert all(math.isclose(norm, clip["reference_norms"][0], rel_tol=1e-5) for norm in clip[how]["first_step_norms_by_rank"]), how
        assert clip[how]["max_abs_diff_vs_one_process"] <= clip["tolerance"] and clip[how]["replicated_parameters_agree"], how


@pytest.mark.timeout(480)
def test_hsdp_sends_most_bytes_within_the_pair(fresh):
    """2 x 2 mesh: all-gathers and reduce-scatters inside each pair, one all-reduce across: 3(g-1)/g S within
    (the root keeps its weights from forward to backward by default: one all-gather fewer), 2(r-1)/r S/g across."""
    hsdp = fresh(4)["hsdp"]
    assert hsdp["calls_by_dimension"] == {"shard": ["all_gather", "reduce_scatter"], "replicate": ["all_reduce"]}
    assert 0.98 <= hsdp["ratio_by_dimension"]["shard"] <= 1.0 and hsdp["ratio_by_dimension"]["replicate"] == pytest.approx(1.0, rel=0.001)  # padding
    # What gloo really wrote: its reduce-scatter within the pair is an all-reduce, 2 (g-1)/g S = S where the
    # ring model counts S/2; the all-gathers (S) and the replicate all-reduce (S/2) are as modelled: 2.5 S
    # written for the model's 2 S, 1.25x (headers and the root's kept weights move it by a few per cent).
    modelled = sum(hsdp["ring_model_bytes_by_dimension"].values())
    assert 1.15 < hsdp["written_bytes_per_step"] / modelled < 1.35
    assert hsdp["max_abs_diff_vs_one_process"] <= hsdp["tolerance"] and hsdp["passed"]


@pytest.mark.timeout(480)
def test_a_training_state_saved_on_2_ranks_resumes_on_4(fresh):
    resume = fresh(4)["resume"]
    differences = resume["max_abs_diff_vs_uninterrupted"]
    assert differences["model and optimizer"] <= resume["tolerance"] < 100 * resume["tolerance"] < differences["model only"]


@pytest.mark.timeout(600)
def test_a_world_size_that_does_not_divide_8_runs_meta_and_clip():
    """3 ranks, for real: 8 windows would split 3, 3, 2 (the mean of the ranks' means is not the batch's, and
    clipping FAILed); with windows_per_step(3) = 9 every part that runs PASSes. The split itself is proven at
    every world size up to 16 in this process (test_every_rank_gets_an_equal_share_of_whole_windows), which is
    why one odd world size is launched and not several: 5 ranks (where chunk() once made 4 pieces of 2 and rank
    4 raised IndexError in meta and clip) cost this launch's 4 processes again on 2 cores for the same split."""
    from ddp_course.launch import run_torchrun

    result = run_torchrun(LAB9, ["--parts", "meta,clip"], nproc=3, timeout_s=500)
    assert result.ok, result.describe()
    verdicts = [line for line in result.stdout.splitlines() if line.rstrip().endswith(("PASS", "FAIL"))]
    assert len(verdicts) == 4 and all(line.rstrip().endswith("PASS") for line in verdicts), result.stdout


@pytest.mark.parametrize("n", range(2, 17))
def test_every_rank_gets_an_equal_share_of_whole_windows(n):
    """local_batch() on every rank of an n-rank job (no process group: the ranks are DistContexts here): equal
    shares, and together, in rank order, exactly the global batch: no window twice, none left out."""
    from ddp_course.distributed import DistContext

    args = SimpleNamespace(seed=0)  # the one flag global_batch() reads
    tokens = torch.arange(200) % 17
    contexts = [DistContext(rank, 0, n, "gloo", torch.device("cpu")) for rank in range(n)]
    whole = practice.global_batch(args, contexts[0], tokens, step=3)
    shares = [practice.local_batch(args, ctx, tokens, step=3) for ctx in contexts]
    assert {len(inputs) for inputs, _ in shares} == {practice.windows_per_step(n) // n}
    for part, full in zip(zip(*shares), whole):
        assert torch.equal(torch.cat(part), full)


def test_the_global_batch_is_a_multiple_of_the_world_size():
    sizes = {n: practice.windows_per_step(n) for n in (2, 3, 4, 5, 6, 7, 8, 9, 10, 16)}
    assert sizes == {2: 8, 3: 9, 4: 8, 5: 10, 6: 12, 7: 14, 8: 8, 9: 9, 10: 10, 16: 16}


def test_one_process_is_refused_in_one_line(lab9, capsys):
    assert lab9.main(lab9.parse_args(["--parts", "clip"])) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.count("\n") == 1 and ": error: lab 9 needs 2 or more ranks" in printed.err, printed


def test_bad_flags_are_refused_in_one_line(lab9, refused_flag_line, tmp_path):
    assert "--parts: unknown fsdp" in refused_flag_line(lab9, ["--parts", "memory,fsdp"])
    assert "is a folder" in refused_flag_line(lab9, ["--json", str(tmp_path)])
    assert "--timeout-s" in refused_flag_line(lab9, ["--timeout-s", "0"])


def test_the_peak_formula_is_the_sheets():
    """The formula's terms, on round numbers: W = 100 bytes of weights, N = 4, A = 1000."""
    sizes = {"weights": 100, "root": 10, "block": 20, "bucket": 30}
    predicted = {impl: sharding.predicted_peak(impl, sizes, 1000, 4) for impl in sharded_training.IMPLS}
    assert predicted == {"ddp": 1400, "zero1": 1250, "zero2": 1180, "fsdp": 1105, "fully_shard": 1105, "fully_shard_keep": 1175}


# --- in this process, on a one-rank gloo group: ZeRO-2's bucket order, and what the memory verdict sees -----


@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of one rank in this process (destroyed afterwards), and its DistContext."""
    import torch
    import torch.distributed as dist

    from ddp_course.distributed import DistContext

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistContext(0, 0, 1, "gloo", torch.device("cpu"))
    dist.destroy_process_group()


def run_zero2_steps(minizero2, net, steps: int) -> tuple[list[list[int]], object]:
    """AdamW steps of ZeRO2(net), a bucket per layer; after every gradient hook, how many buckets hold a full
    gradient - a list per step - and the model."""
    import torch

    model = minizero2.ZeRO2(net, bucket_cap_mb=64 * 64 * 4 / 2**20)
    optimizer = minizero2.ShardedStep(model, torch.optim.AdamW, lr=0.01)
    live: list[list[int]] = []
    for param in net.parameters():  # registered after ZeRO2's own hooks: they run after the bucket took the gradient
        param.register_post_accumulate_grad_hook(lambda _: live[-1].append(sum(b.gradients is not None for b in model.buckets)))
    for step in range(steps):
        live.append([])
        optimizer.zero_grad()
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    return live, model


def test_zero2_keeps_two_full_gradient_buckets_when_modules_run_in_another_order(one_rank):
    """Four layers registered a, b, c, d and called d, c, b, a: backward produces a's gradient first, which is
    the last bucket's. The first step holds three buckets' full gradients at once (the bound needs bucket
    order); it then rebuilds the buckets in the order observed, and from the second step on holds at most
    two - and trains exactly as AdamW on the plain model does."""
    import torch
    from torch import nn

    minizero2 = import_script(REPO_ROOT / "labs" / "minizero2.py", "minizero2_order")

    class UsedBackwards(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(64, 64, bias=False) for _ in range(4))

        def forward(self, x):
            for layer in (self.d, self.c, self.b, self.a):
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    plain = UsedBackwards()
    net = UsedBackwards()
    net.load_state_dict(plain.state_dict())
    live, model = run_zero2_steps(minizero2, net, steps=3)
    assert max(live[0]) == 3 and model.rebuilt  # the first step: out of order, as the docstring says
    assert max(live[1]) <= 2 and max(live[2]) <= 2, live
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    for step in range(3):
        optimizer.zero_grad()
        plain(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
    for ours, theirs in zip(net.parameters(), plain.parameters()):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)


def test_zero2_in_bucket_order_is_not_rebuilt(one_rank):
    import torch
    from torch import nn

    minizero2 = import_script(REPO_ROOT / "labs" / "minizero2.py", "minizero2_order")
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    live, model = run_zero2_steps(minizero2, net, steps=2)
    assert not model.rebuilt and max(map(max, live)) == 1  # each bucket launched as soon as it is full


def weigh_one_step(ctx, impl: str, modules: dict) -> dict:
    """Lab 9's memory part for one implementation on one rank: the counted and measured peaks, judged."""
    from ddp_course.char_lm_job import new_model
    from ddp_course.data import encode_text, load_stdlib_text, text_splits

    tokens, _ = text_splits(encode_text(load_stdlib_text()))
    timeline = sharded_training.memory_timeline(impl, ctx, modules, tokens)
    sizes = sharded_training.model_sizes(new_model(sharded_training.job_args(), ctx), modules["minizero2"])
    return sharded_training.judge_peaks(impl, timeline, timeline.pop("labels"), sizes, 1)


@pytest.mark.timeout(300)
def test_the_memory_verdict_fails_an_implementation_that_keeps_one_more_full_size_buffer(one_rank, monkeypatch):
    """Two mutants that hold one more W than they should, which no count sees: ZeRO-2 keeping a copy of each
    bucket's full gradient (leaked: W in all), DDP copying its gradients out of its buckets
    (gradient_as_bucket_view=False: W more). The counted peak stays within its 5 % of the formula; the
    allocator's does not - the verdict FAILs. Unchanged, both PASS."""
    minizero2 = import_script(REPO_ROOT / "labs" / "minizero2.py", "minizero2_mutant")  # a fresh import: the mutant is patched into it
    modules = {"minizero2": minizero2}
    for impl in ("zero2", "ddp"):
        facts = weigh_one_step(one_rank, impl, modules)
        assert facts["passed"], (impl, facts["measured_minus_predicted_in_w"])
    launch = minizero2.Bucket.launch

    def launch_and_keep_a_copy(bucket):
        bucket.leaked = bucket.gradients.clone()
        launch(bucket)

    monkeypatch.setattr(minizero2.Bucket, "launch", launch_and_keep_a_copy)
    ddp = sharded_training.DDP
    monkeypatch.setattr(sharded_training, "DDP", lambda *args, **kwargs: ddp(*args, **{**kwargs, "gradient_as_bucket_view": False}))
    for impl in ("zero2", "ddp"):
        facts = weigh_one_step(one_rank, impl, modules)
        assert facts["counted_passed"] and not facts["measured_passed"] and not facts["passed"], (impl, facts["measured_minus_predicted_in_w"])
        assert facts["measured_minus_predicted_in_w"] > 0.75


def test_an_allocator_that_cannot_count_every_thread_is_refused_in_one_line(lab9, monkeypatch):
    """Without c10's flag the CPU figures would miss gloo's threads: refused with the parts to leave out."""
    import ctypes

    def no_library(*args, **kwargs):
        raise OSError("no such library")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(CourseError, match=r"cannot make the CPU allocator count every thread .* leave out the memory, meta and checkpoint"):
        sharding.track_every_thread()


# --- the sheet's self-check (labs/lab9_fsdp_practice.ipynb, section 9): fully_shard's bytes on 8 ranks -------


def test_the_self_check_predicts_fully_shards_ring_bytes_on_8_ranks():
    from ddp_course.lab_self_checks import LAB9_SELF_CHECK
    from ddp_course.self_check import verdict

    mib = 2**20
    weights = reference(4)["meta"]["whole_model_bytes"]  # S: the model's float32 weights
    # The ring costs per rank: DDP one all-reduce, 2 (N-1)/N S; fully_shard two all-gathers and a
    # reduce-scatter, 3 (N-1)/N S (padding to a multiple of N adds a few bytes). The sheet's stored table
    # shows the reference's numbers; both must follow the formulas at 2 and 4 ranks.
    _, table = stored_cell(REPO_ROOT / "labs" / "lab9_fsdp_practice.ipynb", "ring_model_MiB_per_step")
    rows = [line.split() for line in table.splitlines()[2:]]  # under the header and its rule: ranks, impl, MiB, ...
    shown = {(int(row[0]), row[1]): float(row[2]) for row in rows if len(row) == 5 and row[0].isdigit()}
    for n in (2, 4):
        impls = reference(n)["memory"]["impls"]
        for impl, collectives in (("ddp", 2), ("fully_shard", 3)):
            formula = collectives * (n - 1) / n * weights
            assert math.isclose(impls[impl]["ring_model_bytes_per_step"], formula, rel_tol=1e-3)
            assert math.isclose(shown[n, impl], formula / mib, rel_tol=1e-3)
    on_8 = 3 * (8 - 1) / 8 * weights / mib
    assert math.isclose(LAB9_SELF_CHECK.expected, on_8, rel_tol=1e-3)
    assert verdict(LAB9_SELF_CHECK, on_8).startswith("self-check: correct - ")
    # The 4-rank row copied; DDP's bytes on 8 ranks (1.5 times fewer); 3 S, as if N were infinite.
    for mistake in (shown[4, "fully_shard"], 2 * 7 / 8 * weights / mib, 3 * weights / mib):
        assert verdict(LAB9_SELF_CHECK, mistake) == f"self-check: not yet - {LAB9_SELF_CHECK.hint}"
