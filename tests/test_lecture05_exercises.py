"""Lecture 5a's and 5b's exercise checks accept the solutions and reject the stubs and plausible wrong answers.

Each solutions notebook's code cells run once in one namespace (module fixture, a few seconds). Each
test then swaps one function for a wrong answer a learner might write, runs the exercise's own check
cell (one call, `check_exercise_N(function)`, from ddp_course/lecture05a_checks.py or lecture05b_checks.py),
and expects "not yet"; the lecture's stub must make the check say "not solved yet". So a check that cannot
fail, or a solution that no longer passes, turns a test red. tests/test_exercises_in_step.py keeps the
exercise and check cells in step with the solutions'; the first test here keeps the solutions' copies of
the lectures' set-up cells identical. One holds lecture 5a's scaling prose (sections 2-3) against
its own model's numbers. The last two recompute each lecture's self-check answer from the lecture's own model,
show that the classic mistakes get the hint, and that the stored self-check cell is unanswered.
"""

import math

import nbformat
import pytest

from ddp_course.launch import REPO_ROOT
from ddp_course.authoring.notebooks import cells_titled, not_solved_verdicts, replaced, run_all_cells, run_source
from ddp_course.self_check import verdict

# {lecture: (notebook, solutions notebook, {exercise number: the function it asks for})}
LECTURES = {
    "5a": (REPO_ROOT / "lectures" / "05a_step_time.ipynb", REPO_ROOT / "solutions" / "05a_step_time_solutions.ipynb",
           {1: "hierarchical_phases", 2: "powersgd_elements"}),
    "5b": (REPO_ROOT / "lectures" / "05b_memory.ipynb", REPO_ROOT / "solutions" / "05b_memory_solutions.ipynb",
           {1: "largest_batch"}),
}  # fmt: skip
EXERCISES = [(lecture, number) for lecture, (_, _, functions) in LECTURES.items() for number in functions]


def check_cells(lecture):
    """{exercise number: the source of its check cell} in the lecture's solutions notebook."""
    return {int(title.split()[3]): source for title, (source, _) in cells_titled(LECTURES[lecture][1], "# Check exercise ").items()}


def check_verdict(solved_lecture, lecture, number, **replacements):
    """Run exercise number's check cell, as the learner does, with some names replaced; its last line."""
    namespace, _ = solved_lecture
    with replaced(namespace, **replacements):
        return run_source(check_cells(lecture)[number], namespace).strip().splitlines()[-1]


def stub_verdicts(solved_lecture, lecture):
    """{number: verdict} of each check after running the lecture's exercise stub (the solutions' function restored)."""
    namespace, _ = solved_lecture
    notebook, _, functions = LECTURES[lecture]
    verdicts = {}
    with replaced(namespace, **{name: namespace[name] for name in functions.values()}):
        for title, (stub, _) in cells_titled(notebook, "# Exercise ").items():
            number = int(title.split()[2].rstrip(":"))
            run_source(stub, namespace)
            verdicts[number] = check_verdict(solved_lecture, lecture, number)
    return verdicts


@pytest.fixture(scope="module")
def solved():
    """{lecture: (the solutions notebook's namespace after running every cell, each check's output)}."""
    return {lecture: run_all_cells(solutions) for lecture, (_, solutions, _) in LECTURES.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lecture", LECTURES)
def test_the_solutions_pass_their_checks(solved, lecture):
    _, outputs = solved[lecture]
    for number in LECTURES[lecture][2]:
        assert outputs[f"# Check exercise {number} (run after the cell above)"].strip().endswith(f"exercise {number}: correct")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lecture", LECTURES)
def test_the_lecture_stubs_fail_the_same_checks(solved, lecture):
    assert stub_verdicts(solved[lecture], lecture) == not_solved_verdicts(LECTURES[lecture][2])


def wrong_phases(shard=True, reduce_scatter_share=1, latency_per_bucket=True, network_link=True, all_gather=True):
    """hierarchical_phases with one mistake switched on."""

    def hierarchical_phases(n_bytes, gpus_per_node, nodes, inside, between=None, buckets=1):
        latency_count = buckets if latency_per_bucket else 1
        steps_in = gpus_per_node - 1
        half_ring = latency_count * steps_in * inside[0] + steps_in / gpus_per_node * n_bytes / inside[1]
        across = 0.0
        if nodes > 1:
            alpha, bandwidth = between if network_link else inside
            sent = n_bytes / gpus_per_node if shard else n_bytes
            across = latency_count * 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / nodes * sent / bandwidth
        return reduce_scatter_share * half_ring, across, half_ring if all_gather else 0.0

    return hierarchical_phases


def wrong_batch(adam_bytes=8, buckets=True, shard_gradients=False, rounding=math.floor):
    """largest_batch with one mistake switched on."""

    def largest_batch(memory_bytes, parameters, per_sample, optimizer="adam", bucket_view=False, zero1_ranks=1):
        state = {"sgd": 0, "momentum": 4, "adam": adam_bytes}[optimizer] * parameters / zero1_ranks
        gradients = 4 * parameters / (zero1_ranks if shard_gradients else 1)
        fixed = 4 * parameters + gradients + (0 if bucket_view or not buckets else 4 * parameters) + state
        return max(0, int(rounding((memory_bytes - fixed) / per_sample)))

    return largest_batch


def wrong_powersgd(rule):
    """powersgd_elements where rule(n, m, shape, rank, rate) -> numbers sent for one gradient."""

    def powersgd_elements(gradient_shapes, rank, min_compression_rate=2.0):
        return sum(rule(shape[0], math.prod(shape[1:]), shape, rank, min_compression_rate) for shape in gradient_shapes)

    return powersgd_elements


def compressed_or_not(n, m, rank, rate, compressed):
    r = min(n, m, rank)
    return compressed(n, m, r) if (n + m) * r * rate < n * m else n * m


WRONG_ANSWERS = {
    ("5a", 1): {"the full bytes cross the network": wrong_phases(shard=False),
        "the reduce-scatter costed as a whole all-reduce": wrong_phases(reduce_scatter_share=2),
        "the node's whole ring in the reduce-scatter, the all-gather free": wrong_phases(reduce_scatter_share=2, all_gather=False),
        "latency once, not per bucket": wrong_phases(latency_per_bucket=False),
        "the shard crosses on the fast link": wrong_phases(network_link=False)},
    ("5b", 1): {"no bucket copy": wrong_batch(buckets=False), "Adam keeps one moment": wrong_batch(adam_bytes=4),
        "ZeRO-1 shards the gradients too": wrong_batch(shard_gradients=True), "rounds up": wrong_batch(rounding=math.ceil)},
    ("5a", 2): {"everything compressed": wrong_powersgd(lambda n, m, shape, rank, rate: (n + m) * min(n, m, rank)),
        "only P counted": wrong_powersgd(lambda n, m, shape, rank, rate: compressed_or_not(n, m, rank, rate, lambda n, m, r: n * r)),
        "convolutions sent uncompressed": wrong_powersgd(
            lambda n, m, shape, rank, rate: compressed_or_not(n, m, rank, rate, lambda n, m, r: (n + m) * r) if len(shape) == 2 else n * m),
        "m = shape[1] only": wrong_powersgd(
            lambda n, m, shape, rank, rate: compressed_or_not(n, shape[1] if len(shape) > 1 else 1, rank, rate, lambda n, m, r: (n + m) * r))},
}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lecture, number", EXERCISES, ids=[f"{lecture}-exercise{number}" for lecture, number in EXERCISES])
def test_each_check_rejects_plausible_wrong_answers(solved, lecture, number):
    function = LECTURES[lecture][2][number]
    for mistake, answer in WRONG_ANSWERS[(lecture, number)].items():
        assert check_verdict(solved[lecture], lecture, number, **{function: answer}) == f"exercise {number}: not yet", mistake


@pytest.mark.timeout(120)
def test_scaling_prose_agrees_with_the_lectures_own_model(solved):
    """Strong scaling is Amdahl's curve only without overlap; weak-scaling efficiency keeps falling."""
    import matplotlib

    matplotlib.use("Agg")
    cells = nbformat.read(LECTURES["5a"][0], as_version=4).cells
    prose = " ".join(cell.source for cell in cells if cell.cell_type == "markdown")
    assert "exactly Amdahl" not in prose and "levels off" not in prose  # the refuted claims
    assert "$o = 0$" in prose and "$\\log N$ for a tree" in prose
    workloads = [cell.source for cell in cells if cell.source.startswith("# The assumptions")]
    scaling = [cell.source for cell in cells if cell.source.startswith("def gradient_allreduce_seconds")]
    assert len(workloads) == 1 and len(scaling) == 1, "section 3's workloads cell and its strong- and weak-scaling cell"
    namespace = dict(solved["5a"][0])
    run_source(workloads[0], namespace)
    run_source(scaling[0], namespace)
    counts, no_overlap, overlap = namespace["gpu_counts"], namespace["speedups"][0.0], namespace["speedups"][1.0]
    peak = overlap.index(max(overlap))
    assert counts[peak] == 16 and max(overlap) > max(no_overlap)  # above the o = 0 limit: not Amdahl's curve
    assert all(a > b for a, b in zip(overlap[peak:], overlap[peak + 1 :]))  # then it falls
    efficiency = [namespace["weak_scaling_efficiency"](namespace["gpt2"], n, namespace["network"]) for n in (16, 64, 256, 1024)]
    assert all(a > b for a, b in zip(efficiency, efficiency[1:])) and round(efficiency[-1], 2) == 0.31  # never levels off


@pytest.mark.timeout(120)
def test_exercise_1s_wrong_answers_differ_from_a_right_one_only_by_their_mistake(solved):
    assert check_verdict(solved["5a"], "5a", 1, hierarchical_phases=wrong_phases()) == "exercise 1: correct"


# --- the self-checks at the end of each Summary (ddp_course/self_check.py) ----------------------------


def stored_self_check(notebook, module):
    """The stored self-check cell of a notebook: (its source, what it printed)."""
    cells = cells_titled(notebook, f"from ddp_course.{module} import SELF_CHECK")
    assert len(cells) == 1, f"{notebook.name}: one self-check cell"
    return next(iter(cells.values()))


def assert_stored_unanswered(notebook, module, question):
    source, stdout = stored_self_check(notebook, module)
    assert "answer = None" in source and "self_check(SELF_CHECK, answer)" in source
    assert stdout.strip() == verdict(question, None)


@pytest.mark.timeout(30)
def test_lecture_5a_self_check_is_section_2s_model_and_rejects_the_classic_mistakes():
    from ddp_course.calculators import allreduce_seconds
    from ddp_course.lecture05a_checks import SELF_CHECK

    def step_ms(t1_ms, gpus, gradient_bytes, bandwidth, overlap=1.0, backward_share=2 / 3, ring=True):
        """Section 2's strong scaling: T_1 / N plus the all-reduce backward could not hide."""
        compute = t1_ms / gpus
        comm = allreduce_seconds(gradient_bytes, gpus, 1, (0.0, bandwidth)) * 1e3 if ring else 2 * gradient_bytes / bandwidth * 1e3
        return compute + max(0.0, comm - overlap * backward_share * compute)

    right = step_ms(192, 8, 1e9, 100e9)
    assert math.isclose(right, SELF_CHECK.expected)
    assert verdict(SELF_CHECK, right).startswith("self-check: correct")
    mistakes = {
        "no overlap": step_ms(192, 8, 1e9, 100e9, overlap=0),
        "all of it hidden": 192 / 8,
        "the whole computation hides it": step_ms(192, 8, 1e9, 100e9, backward_share=1),
        "2S / beta for the ring": step_ms(192, 8, 1e9, 100e9, ring=False),
    }
    for mistake, answer in mistakes.items():
        assert verdict(SELF_CHECK, answer) == f"self-check: not yet - {SELF_CHECK.hint}", mistake
    assert "section 2" in SELF_CHECK.hint
    assert_stored_unanswered(LECTURES["5a"][0], "lecture05a_checks", SELF_CHECK)


@pytest.mark.timeout(30)
def test_lecture_5b_self_check_is_section_3s_table_and_rejects_the_classic_mistakes():
    from ddp_course.calculators import memory_breakdown
    from ddp_course.lecture05b_checks import SELF_CHECK

    def rank_gb(global_batch=256, ranks=8, **options):
        """Section 3's terms on one rank: 1 B fp32 parameters, Adam, 1 GB of activations per sample."""
        return sum(memory_breakdown(1e9, global_batch // ranks, 1e9, **options).values()) / 1e9

    right = rank_gb()
    assert math.isclose(right, SELF_CHECK.expected)
    assert verdict(SELF_CHECK, right).startswith("self-check: correct")
    mistakes = {
        "no bucket copy": rank_gb(bucket_view=True),
        "the global batch on one rank": rank_gb(ranks=1),
        "the model state divided by N": 20 / 8 + 32,
        "Adam's state as 4P": rank_gb(optimizer="SGD + momentum"),
    }
    for mistake, answer in mistakes.items():
        assert verdict(SELF_CHECK, answer) == f"self-check: not yet - {SELF_CHECK.hint}", mistake
    assert "section 3" in SELF_CHECK.hint
    assert_stored_unanswered(LECTURES["5b"][0], "lecture05b_checks", SELF_CHECK)
