"""Lecture 06's exercise checks accept the solutions and reject the stubs and plausible wrong answers.

The solutions notebook's code cells run once in one namespace (module fixture, a few seconds). A
check is one call, `check_exercise_N(answer)` (ddp_course/lecture06_checks.py); each test passes it
a wrong answer a learner might write and expects "not yet"; the lecture's stubs must make the
checks say "not solved yet". The solutions notebook opens with the lecture's set-up cell, copied.
The last test proves the self-check's answer by resuming a sampler there (every sample trained on once).
"""

import math

import pytest

from ddp_course.launch import REPO_ROOT
from ddp_course.authoring import notebooks
from ddp_course.authoring.notebooks import check_verdict, not_solved_verdicts, run_all_cells

LECTURE = REPO_ROOT / "lectures" / "06_debugging_fault_tolerance.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "06_debugging_fault_tolerance_solutions.ipynb"
NAMES = {1: "first_disagreement", 2: "checkpoint_every_steps", 3: "replica_fingerprint"}


@pytest.fixture(scope="module")
def solved():
    return run_all_cells(SOLUTIONS)


def stub_verdicts(namespace):
    """{number: verdict} of each check on the lecture's untouched exercise stub."""
    return notebooks.stub_verdicts(namespace, LECTURE, NAMES)


@pytest.mark.timeout(120)
def test_the_solutions_pass_their_checks(solved):
    _, outputs = solved
    for number in NAMES:
        assert outputs[f"# Check exercise {number} (run after the cell above)"].strip().endswith(f"exercise {number}: correct")


@pytest.mark.timeout(120)
def test_the_lecture_stubs_fail_the_same_checks(solved):
    namespace, _ = solved
    assert stub_verdicts(namespace) == not_solved_verdicts(NAMES)


@pytest.mark.timeout(120)
def test_exercise_1_rejects_index_pairing_names_only_and_ignoring_missing_entries(solved):
    namespace, _ = solved
    solution = namespace["first_disagreement"]

    def by_index(entries_by_rank):  # pairs the i-th entries: wrong when buffers start at different numbers
        lists = list(entries_by_rank.values())
        for entries in zip(*lists):
            if len({(e["profiling_name"], repr(e["input_sizes"])) for e in entries}) > 1:
                return entries[0]["collective_seq_id"]
        return None

    def names_only(entries_by_rank):  # misses a shape mismatch
        stripped = {r: [{**e, "input_sizes": []} for e in entries] for r, entries in entries_by_rank.items()}
        return solution(stripped)

    def common_numbers_only(entries_by_rank):  # a collective one rank never ran goes unnoticed
        common = set.intersection(*({e["collective_seq_id"] for e in entries} for entries in entries_by_rank.values()))
        kept = {r: [e for e in entries if e["collective_seq_id"] in common] for r, entries in entries_by_rank.items()}
        return solution(kept)

    for wrong in (by_index, names_only, common_numbers_only):
        assert check_verdict(namespace, 1, wrong) == "exercise 1: not yet", wrong.__name__


@pytest.mark.timeout(120)
def test_exercise_2_rejects_young_rounded_node_mtbf_missing_factor_and_seconds(solved):
    namespace, _ = solved
    solution = namespace["checkpoint_every_steps"]

    def young(step_s, checkpoint_s, node_mtbf_s, nodes, restart_s):  # first order: off when C is not << M
        return max(1, round(math.sqrt(2 * checkpoint_s * node_mtbf_s / nodes) / step_s))

    def node_mtbf(step_s, checkpoint_s, node_mtbf_s, nodes, restart_s):  # one node's MTBF, not the job's
        return solution(step_s, checkpoint_s, node_mtbf_s, 1, restart_s)

    def without_factor_2(step_s, checkpoint_s, node_mtbf_s, nodes, restart_s):
        return max(1, round(math.sqrt(checkpoint_s * node_mtbf_s / nodes) / step_s))

    def seconds(step_s, checkpoint_s, node_mtbf_s, nodes, restart_s):  # the interval in seconds, not steps
        return max(1, round(solution(step_s, checkpoint_s, node_mtbf_s, nodes, restart_s) * step_s))

    for wrong in (young, node_mtbf, without_factor_2, seconds):
        assert check_verdict(namespace, 2, wrong) == "exercise 2: not yet", wrong.__name__


@pytest.mark.timeout(120)
def test_exercise_3_rejects_sums(solved):
    namespace, _ = solved
    torch = namespace["torch"]

    def total_sum(model):  # misses swaps
        return torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)

    def per_tensor_sums(model):  # misses a swap inside a tensor
        return torch.stack([p.detach().double().sum() for p in model.parameters()])

    def weighted_float32_sum(model):  # catches swaps, loses a one-step change in float32 rounding
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        return (flat * torch.arange(1, len(flat) + 1, dtype=flat.dtype)).sum().reshape(1)

    for wrong in (total_sum, per_tensor_sums, weighted_float32_sum):
        assert check_verdict(namespace, 3, wrong) == "exercise 3: not yet", wrong.__name__


# --- the self-check at the end of the Summary (ddp_course/self_check.py) -------------------------------


def trains_every_sample_once(resume_at, num_samples=1000, batch=16, old_world=4, new_world=2, checkpoint_step=6):
    """Section 4's resume: what the checkpoint's steps read on the old world, then the rest of the epoch read
    from position resume_at on the new one. True when every sample is trained on exactly once."""
    from ddp_course.resume import ResumableDistributedSampler

    def shards(world_size, start):
        samplers = [ResumableDistributedSampler(num_samples, world_size, rank, seed=0) for rank in range(world_size)]
        for sampler in samplers:
            sampler.set_epoch(0, start)
        return [list(sampler) for sampler in samplers]

    kept = [i for shard in shards(old_world, 0) for i in shard[: checkpoint_step * batch]]
    trained = kept + [i for shard in shards(new_world, resume_at) for i in shard]
    return len(trained) == num_samples and set(trained) == set(range(num_samples))


@pytest.mark.timeout(60)
def test_the_self_check_is_the_position_that_trains_every_sample_once():
    from ddp_course.lecture06_checks import SELF_CHECK
    from ddp_course.resume import ResumableDistributedSampler
    from ddp_course.self_check import verdict

    # The position is the count of distinct samples the 4-rank job read in the checkpoint's 6 steps.
    read = set()
    for rank in range(4):
        sampler = ResumableDistributedSampler(1000, 4, rank)
        sampler.set_epoch(0)
        read |= set(list(sampler)[: 6 * 16])
    assert len(read) == SELF_CHECK.expected
    assert trains_every_sample_once(SELF_CHECK.expected)
    assert verdict(SELF_CHECK, len(read)).startswith("self-check: correct")
    mistakes = {"the batch count": 6, "the new world size": 6 * 16 * 2, "the crash's step": 9 * 16 * 4, "one rank's samples": 6 * 16}
    for mistake, answer in mistakes.items():
        assert not trains_every_sample_once(answer), mistake  # each skips or repeats samples
        assert verdict(SELF_CHECK, answer) == f"self-check: not yet - {SELF_CHECK.hint}", mistake
    assert "section 4" in SELF_CHECK.hint
    cells = notebooks.cells_titled(LECTURE, "from ddp_course.lecture06_checks import SELF_CHECK")
    assert len(cells) == 1
    source, stdout = next(iter(cells.values()))
    assert "answer = None" in source and "self_check(SELF_CHECK, answer)" in source
    assert stdout.strip() == verdict(SELF_CHECK, None)
