"""Lab 6's from-scratch DDP (solutions/minddp.py) and its exercise (labs/minddp.py).

Two torchrun launches are shared by most tests: tests/scripts/minddp_check.py's --suite wrappers on 2
gloo ranks and --suite zero on 4 (subgroups of 1, 2 and 4 ranks), each run by tests/scripts/sharding_checks.py
in the same job as lab 8's FSDP checks (conftest.py's `sharding_checks`: one launch per world size serves
this module and tests/test_minifsdp.py). Each writes
one JSON of records, one per check and rank; the tests below assert on them. The in-process tests
check the bucket and shard assignments, the exercise generator, and that the exercise is the
solution with the marked regions replaced by TODOs that raise.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from ddp_course.authoring.exercises import exercise_header, find_regions, make_exercise
from ddp_course.launch import REPO_ROOT, import_script

SOLUTION = REPO_ROOT / "solutions" / "minddp.py"
EXERCISE = REPO_ROOT / "labs" / "minddp.py"
minddp = import_script(SOLUTION, "minddp")


def minddp_records(sharding_checks, nproc):
    """The minddp suite's JSON from the shared launch (conftest.py); it exists only if the suite finished."""
    result, path = sharding_checks(nproc)
    assert not result.timed_out and path.exists(), result.describe()
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def wrappers_run(sharding_checks):
    return minddp_records(sharding_checks, nproc=2)


@pytest.fixture(scope="module")
def zero_run(sharding_checks):
    return minddp_records(sharding_checks, nproc=4)


def records(run, check, **match):
    found = [r for r in run["records"] if r["check"] == check and all(r.get(k) == v for k, v in match.items())]
    assert found, f"no record {check} {match}"
    return found


def on_every_rank(run, check, **match):
    found = records(run, check, **match)
    assert sorted(r["rank"] for r in found) == list(range(run["world_size"])), found
    return found


# --- the wrappers on 2 ranks -----------------------------------------------------------------------------


WRAPPERS = ["naive", "overlap", "bucketed_one", "bucketed_default", "bucketed_several", "bucketed_per_param"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_matches_one_process_and_torch_ddp(wrappers_run, wrapper):
    """5 SGD steps on 2 shards = 5 steps of one process on the whole batch (frozen layer, tied weights)."""
    tolerance = wrappers_run["tolerance"]
    assert wrappers_run["world_size"] == 2
    for record in on_every_rank(wrappers_run, "matches_single", wrapper=wrapper):
        assert record["max_rel_diff"] <= tolerance, record
    for record in on_every_rank(wrappers_run, "matches_torch_ddp", wrapper=wrapper):
        assert record["max_rel_diff"] <= tolerance, record
    # torch's DDP itself passes the same comparison with one process.
    assert all(r["max_rel_diff"] <= tolerance for r in on_every_rank(wrappers_run, "torch_ddp_vs_single"))


@pytest.mark.timeout(180)
def test_bucket_sizes_give_one_several_and_one_per_parameter(wrappers_run):
    found = records(wrappers_run, "matches_single")
    buckets = {r["wrapper"]: (r["buckets"], r["trainable_parameters"]) for r in found if "buckets" in r}
    count, trainable = buckets["bucketed_one"]
    assert count == 1 and trainable == 5  # embed (tied), hidden.weight/bias, mix.weight/bias; frozen excluded
    assert buckets["bucketed_default"][0] == 1  # 25 MiB holds this tiny model
    assert 1 < buckets["bucketed_several"][0] < trainable
    assert buckets["bucketed_per_param"][0] == trainable


@pytest.mark.timeout(180)
def test_gradients_kept_as_bucket_views_across_steps(wrappers_run):
    """zero_grad(set_to_none=False) keeps each .grad a view into its bucket; the result is the same."""
    for record in on_every_rank(wrappers_run, "matches_single", wrapper="bucketed_several_set_to_none_false"):
        assert record["max_rel_diff"] <= wrappers_run["tolerance"], record


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrapper", ["naive", "overlap", "bucketed_several", "bucketed_one"])
def test_no_sync_accumulation_matches_one_process(wrappers_run, wrapper):
    """3 micro-batches per rank (2 under no_sync) x 2 ranks = one process on the 24 rows."""
    for record in on_every_rank(wrappers_run, "no_sync_matches_single", wrapper=wrapper):
        assert record["max_rel_diff"] <= wrappers_run["tolerance"], record


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrapper", ["naive", "overlap", "bucketed_one", "bucketed_per_param"])
def test_unused_parameters_finish_and_average(wrappers_run, wrapper):
    """`extra` used on rank 0 only, `never` on no rank: the job finished (the JSON exists) and matches."""
    for record in on_every_rank(wrappers_run, "unused_matches_single", wrapper=wrapper):
        assert record["max_rel_diff"] <= wrappers_run["tolerance"], record
        # The documented behaviour: a parameter no rank used ends the step with a zero .grad, not None.
        assert record["never_grad_is_none"] is False and record["never_grad_abs_max"] == 0.0
    assert all(r["max_rel_diff"] <= wrappers_run["tolerance"] for r in on_every_rank(wrappers_run, "unused_torch_ddp"))


@pytest.mark.timeout(180)
def test_rank_dependent_gradient_order_is_handled_by_bucket_order(wrappers_run):
    orders = {r["rank"]: r["order"] for r in on_every_rank(wrappers_run, "ready_order")}
    assert orders == {0: ["b", "a"], 1: ["a", "b"]}  # the graph really readies gradients in a rank-dependent order
    for wrapper in ("overlap", "bucketed_per_param"):
        for record in on_every_rank(wrappers_run, "rank_dependent_order_matches_single", wrapper=wrapper):
            assert record["max_rel_diff"] <= wrappers_run["tolerance"], record


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", ["negative_sum_not_average", "negative_ready_order"])
def test_negative_controls_are_caught(wrappers_run, check):
    """The same comparison fails wrong variants: no division by world size (E2); buckets launched in the
    order they fill, on the rank-dependent graph (E1: rank 0's bucket of b is summed with rank 1's of a)."""
    for record in on_every_rank(wrappers_run, check):
        assert record["max_rel_diff"] > 100 * wrappers_run["tolerance"], record


@pytest.mark.timeout(180)
def test_construction_broadcasts_rank0_state(wrappers_run):
    for record in on_every_rank(wrappers_run, "broadcast_at_construction"):
        assert record["differed_before"] and record["equal_after"], record


@pytest.mark.timeout(180)
def test_a_module_is_wrapped_once(wrappers_run):
    for record in on_every_rank(wrappers_run, "wrap_twice_refused"):
        assert record["message"] and "already wrapped" in record["message"], record


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrapper", ["overlap", "bucketed_several"])
def test_second_backward_without_finish_raises(wrappers_run, wrapper):
    for record in on_every_rank(wrappers_run, "second_backward_raises", wrapper=wrapper):
        assert "became ready twice before finish_gradient_synchronization()" in record["message"], record


# --- the exercise ---------------------------------------------------------------------------------------


def todo_messages(part):
    return [region.message for region in find_regions(SOLUTION.read_text().split("\n")) if region.part == part]


@pytest.mark.timeout(180)
def test_exercise_fails_with_its_hints_part_by_part(wrappers_run):
    """The committed exercise, then the exercise with parts 1..k-1 solved: each run stops at part k's TODO."""
    expected = {
        "labs/minddp.py": {"naive": 1, "overlap": 1, "bucketed": 1, "sharded": 4},
        2: {"naive": None, "overlap": 2, "bucketed": 3, "sharded": 4},
        3: {"naive": None, "overlap": None, "bucketed": 3, "sharded": 4},
        4: {"naive": None, "overlap": None, "bucketed": None, "sharded": 4},
    }
    for stage, parts in expected.items():
        for record in on_every_rank(wrappers_run, "exercise", stage=stage):
            for entry_point, part in parts.items():
                if part is None:
                    assert record[entry_point] == "ok", (stage, entry_point, record[entry_point])
                else:
                    assert record[entry_point] in todo_messages(part), (stage, entry_point, record[entry_point])


def test_committed_exercise_is_generated_from_the_solution():
    header = exercise_header("solutions/minddp.py", "labs/minddp.py")
    assert EXERCISE.read_text() == make_exercise(SOLUTION.read_text(), header), (
        "labs/minddp.py differs from what solutions/minddp.py generates: python -m ddp_course.authoring.exercises solutions/minddp.py labs/minddp.py"
    )


def definitions(path):
    """{qualified name: (signature dump, decorators dump, docstring)} of every class and function."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                if isinstance(child, ast.ClassDef):
                    signature = ast.dump(ast.Tuple(child.bases, ast.Load()))
                else:
                    signature = ast.dump(child.args) + ast.dump(child.returns or ast.Pass())
                found[name] = (signature, [ast.dump(d) for d in child.decorator_list], ast.get_docstring(child))
                visit(child, name + ".")

    visit(ast.parse(path.read_text()), "")
    return found


def test_exercise_has_the_solutions_classes_signatures_and_docstrings():
    solution, exercise = definitions(SOLUTION), definitions(EXERCISE)
    assert list(exercise) == list(solution)
    for name in solution:
        assert exercise[name] == solution[name], name
    public = ("NaiveDDP", "OverlapDDP", "BucketedDDP", "ShardedOptimizer", "assign_buckets", "optimizer_state_bytes")
    for name in public:
        assert name in solution and solution[name][2], f"{name} lacks a docstring"


def todo_raises(path):
    """(function name, message) of every `raise NotImplementedError("TODO(...)")` in a file."""
    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                call = node.exc if isinstance(node, ast.Raise) else None
                if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "NotImplementedError":
                    if call.args and isinstance(call.args[0], ast.Constant):
                        found.append((node.lineno, function.name, node.exc.args[0].value))
    return [(name, message) for _, name, message in sorted(found)]


def test_every_todo_of_the_exercise_raises_its_hint():
    regions = find_regions(SOLUTION.read_text().split("\n"))
    raises = todo_raises(EXERCISE)
    assert [message for _, message in raises] == [region.message for region in regions]
    assert sorted({region.part for region in regions}) == [1, 2, 3, 4]
    assert all(message.startswith(f"TODO(lab 6, part {r.part}): ") for (_, message), r in zip(raises, regions))
    assert todo_raises(SOLUTION) == []  # the solution raises no TODO
    # The exercise contains none of the solution's marked code.
    exercise = EXERCISE.read_text()
    assert "# END SOLUTION" not in exercise and "dist.all_reduce(param.grad)" not in exercise


def test_exercise_generator_rejects_broken_markers():
    good = "def f():\n    # BEGIN SOLUTION\n    # TODO(lab 9, part 1): do it\n    return 1\n    # END SOLUTION\n"
    assert make_exercise(good) == 'def f():\n    raise NotImplementedError("TODO(lab 9, part 1): do it")\n'
    assert make_exercise(good, parts=[2]) == good  # part 1 kept: a learner who has done it
    broken = {
        "without END": good.replace("    # END SOLUTION\n", ""),
        "without hint": good.replace("    # TODO(lab 9, part 1): do it\n", ""),
        "END alone": "x = 1\n# END SOLUTION\n",
    }
    for name, text in broken.items():
        with pytest.raises(ValueError):
            make_exercise(text)


def generator(*args, cwd=None):
    command = [sys.executable, "-m", "ddp_course.authoring.exercises", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd)


def test_exercise_generator_cli_checks_and_reports_one_line(tmp_path):
    ok = generator(SOLUTION, EXERCISE, "--check", cwd=tmp_path)  # the header names repository paths from any cwd
    assert ok.returncode == 0, ok.stderr
    stale = tmp_path / "stale.py"
    stale.write_text("# not generated\n")
    failed = generator(SOLUTION, stale, "--check")
    assert failed.returncode == 1 and len(failed.stderr.strip().splitlines()) == 1
    missing = generator(tmp_path / "none.py", stale)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    expected = f"python -m ddp_course.authoring.exercises: error: no such solution file: {tmp_path}/none.py"
    assert missing.stderr.strip().splitlines() == [expected]


# --- bucket assignment and the ZeRO partition (no processes needed) --------------------------------


def test_buckets_take_parameters_in_reverse_order_up_to_the_cap():
    sizes = [100, 10, 100, 10, 300]  # elements; float32: 4 bytes each
    parameters = [nn.Parameter(torch.zeros(n)) for n in sizes]
    cap_mb = 440 / minddp.MIB  # 110 elements
    assert minddp.assign_buckets(parameters, cap_mb) == [[4], [3, 2], [1, 0]]  # 300 > cap: alone
    assert minddp.assign_buckets(parameters, None) == [[4, 3, 2, 1, 0]]
    assert minddp.assign_buckets(parameters, 1e-9) == [[4], [3], [2], [1], [0]]
    mixed = [nn.Parameter(torch.zeros(2, dtype=dtype)) for dtype in (torch.float32, torch.float64, torch.float32)]
    assert minddp.assign_buckets(mixed, None) == [[2], [1], [0]]  # a bucket is one flat tensor of one dtype


def test_partition_is_balanced_and_deterministic():
    sizes = [5, 1, 9, 3, 3, 7]
    owners = minddp.partition_parameters(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owners) if o == rank) for rank in range(2)]
    # Largest first, each to the lighter rank (ties: rank 0): 9->0, 7->1, 5->1, 3->0, 3->0 (tie), 1->1.
    assert owners == [1, 1, 0, 0, 0, 1] and loads == [15, 13]
    assert minddp.partition_parameters(sizes, 2) == owners  # the same on every call (every rank)
    carried = [0, 0]
    minddp.partition_parameters([4], 2, carried)
    assert carried == [4, 0] and minddp.partition_parameters([4], 2, carried) == [1]  # loads carry across groups
    assert minddp.partition_parameters([1, 1], 4) == [0, 1]  # ranks 2 and 3 own nothing


def test_optimizer_state_bytes_counts_momentum_and_adam_moments():
    model = nn.Linear(8, 4)  # 36 parameters
    model(torch.ones(2, 8)).sum().backward()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(model.parameters())
    assert minddp.optimizer_state_bytes(sgd) == 0  # state appears at the first step
    sgd.step()
    adam.step()
    assert minddp.optimizer_state_bytes(sgd) == 36 * 4  # one float32 momentum per element
    step_bytes = sum(state["step"].numel() * state["step"].element_size() for state in adam.state.values())
    assert minddp.optimizer_state_bytes(adam) == 2 * 36 * 4 + step_bytes  # two moments per element


# --- ZeRO-1 on 1, 2 and 4 ranks --------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_sharded_optimizer_matches_unsharded_and_torch_zero(zero_run, optimizer):
    assert zero_run["world_size"] == 4
    for size in (1, 2, 4):
        found = records(zero_run, "zero", world_size=size, optimizer=optimizer)
        assert sorted(r["rank"] for r in found) == list(range(size))
        for record in found:
            # Same gradients, same elementwise update, a broadcast copies bits: equal, not merely close.
            assert record["sharded_vs_unsharded"] == 0.0 and record["bitwise_equal_unsharded"], record
            assert record["sharded_vs_torch_zero"] == 0.0, record


@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_optimizer_state_per_rank_falls_as_one_over_world_size(zero_run, optimizer):
    unsharded = {r["state_bytes_unsharded"] for r in records(zero_run, "zero", optimizer=optimizer)}
    assert len(unsharded) == 1
    (total,) = unsharded
    for size in (1, 2, 4):
        found = records(zero_run, "zero", world_size=size, optimizer=optimizer)
        per_rank = [r["state_bytes_sharded"] for r in found]
        assert sum(per_rank) == total  # each element's state lives on exactly one rank
        assert per_rank == [total // size] * size  # ZeroNet's eight equal layers balance exactly
        assert [r["state_bytes_torch_zero"] for r in found] == per_rank  # torch's ZeRO keeps as much


@pytest.mark.timeout(180)
def test_bucketed_ddp_with_sharded_adam_matches_one_process(zero_run):
    for record in on_every_rank(zero_run, "zero_with_bucketed_ddp"):
        assert record["max_rel_diff"] <= zero_run["tolerance"], record
    for record in on_every_rank(zero_run, "negative_zero_without_broadcast"):
        assert record["max_rel_diff"] > 100 * zero_run["tolerance"], record


@pytest.mark.timeout(180)
def test_sharded_optimizer_param_groups_follow_a_scheduler(zero_run):
    """Groups with their own lr, halved every 2 steps by StepLR: the weights equal the unsharded optimizer's."""
    for record in on_every_rank(zero_run, "zero_groups_and_scheduler"):
        assert record["max_rel_diff"] == 0.0, record
        assert record["lrs"] == [0.05 / 4, 0.1 / 4]  # the groups' own lr (0.05) and the default (0.1), halved twice
        assert record["local_lrs"] == record["lrs"]  # step() copied them to this rank's shard
