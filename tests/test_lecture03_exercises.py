"""Lecture 03's exercise checks accept the solutions and reject plausible wrong answers.

The solutions notebook's code cells run once in one namespace (module fixture, a few seconds). Each
test then hands a wrong answer a learner might write to the exercise's check
(ddp_course.lecture03_checks.check_exercise_N, which the notebooks call in one line) and expects
"not yet"; the lecture's stub must make the check say "not solved yet". So a check that cannot fail,
or a solution that no longer passes, turns a test red.
"""

import contextlib
import io
import math

import pytest
import torch
from torch.utils.data import DistributedSampler, Sampler

from ddp_course import lecture03_checks
from ddp_course.launch import REPO_ROOT
from ddp_course.self_check import verdict
from ddp_course.authoring.notebooks import cells_titled, not_solved_verdicts, run_all_cells, run_source

LECTURE = REPO_ROOT / "lectures" / "03_samplers.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "03_samplers_solutions.ipynb"


@pytest.fixture(scope="module")
def solved():
    """The solutions notebook's namespace after running every cell, and each check's output."""
    return run_all_cells(SOLUTIONS)


def check_verdict(number: int, answer) -> str:
    """The last line lecture03_checks.check_exercise_<number>(answer) prints."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        getattr(lecture03_checks, f"check_exercise_{number}")(answer)
    return printed.getvalue().strip().splitlines()[-1]


FUNCTIONS = {1: "rank_eval_sums", 2: "resume_shard", 3: "BlockDistributedSampler"}


@pytest.mark.timeout(120)
def test_the_solutions_pass_their_checks(solved):
    _, outputs = solved
    for number in (1, 2, 3):
        assert outputs[f"# Check exercise {number} (run after the cell above)"].strip().endswith(f"exercise {number}: correct")


@pytest.mark.timeout(120)
def test_the_lecture_stubs_fail_the_same_checks(solved):
    namespace = dict(solved[0])  # a copy: the stubs must not replace the solutions other tests use
    verdicts = {}
    for title, (stub, _) in cells_titled(LECTURE, "# Exercise ").items():
        number = int(title.split()[2].rstrip(":"))
        run_source(stub, namespace)
        verdicts[number] = check_verdict(number, namespace[FUNCTIONS[number]])
    assert verdicts == not_solved_verdicts(FUNCTIONS)


@pytest.mark.timeout(120)
def test_exercise_1_rejects_padding_and_means_of_batch_means(solved):
    namespace, _ = solved
    torch_, F, solution = namespace["torch"], namespace["F"], namespace["rank_eval_sums"]

    def counts_the_padding(model, loader, rank, world_size, n):
        sums = torch_.zeros(3, dtype=torch_.float64)
        with torch_.no_grad():
            for images, labels in loader:
                logits = model(images)
                sums += torch_.tensor(
                    [float((logits.argmax(1) == labels).sum()), len(labels), float(F.cross_entropy(logits, labels, reduction="sum"))], dtype=torch_.float64
                )
        return sums

    def averages_batch_means(model, loader, rank, world_size, n):
        sums = solution(model, loader, rank, world_size, n)  # right counts ...
        batch_means = []
        seen = 0
        with torch_.no_grad():
            for images, labels in loader:
                real = rank + world_size * torch_.arange(seen, seen + len(labels)) < n
                seen += len(labels)
                if real.any():
                    batch_means.append(float(F.cross_entropy(model(images[real]), labels[real])))
        sums[2] = sum(batch_means) / max(len(batch_means), 1) * sums[1]  # ... and the loss from batch means
        return sums

    assert check_verdict(1, counts_the_padding) == "exercise 1: not yet"
    assert check_verdict(1, averages_batch_means) == "exercise 1: not yet"


@pytest.mark.timeout(120)
def test_exercise_2_rejects_the_same_world_size_answer_and_blocks(solved):
    namespace, _ = solved
    solution = namespace["resume_shard"]

    def slice_a_new_sampler(n, seed, epoch, old_world_size, batch_size, steps_done, new_world_size, new_rank):
        sampler = DistributedSampler(range(n), num_replicas=new_world_size, rank=new_rank, seed=seed)
        sampler.set_epoch(epoch)  # right for the same world size, wrong for another
        return list(sampler)[steps_done * batch_size :]

    def contiguous_pieces(n, seed, epoch, old_world_size, batch_size, steps_done, new_world_size, new_rank):
        rest = [i for rank in range(new_world_size) for i in solution(n, seed, epoch, old_world_size, batch_size, steps_done, new_world_size, rank)]
        rest.sort(key=lambda i: i)  # the right samples, in another order
        size = math.ceil(len(rest) / new_world_size)
        return rest[new_rank * size : (new_rank + 1) * size]

    def right_samples_reversed(*args):  # balanced, nothing skipped or repeated: only the order is wrong
        return list(reversed(solution(*args)))

    assert check_verdict(2, slice_a_new_sampler) == "exercise 2: not yet"
    assert check_verdict(2, contiguous_pieces) == "exercise 2: not yet"
    assert check_verdict(2, right_samples_reversed) == "exercise 2: not yet"


@pytest.mark.timeout(120)
def test_exercise_3_rejects_scattered_reads_uneven_shards_and_global_randomness(solved):
    namespace, _ = solved

    class Strided(DistributedSampler):  # torch's sampler: opens nearly every file
        def __init__(self, n, block_size, num_replicas, rank, seed=0):
            super().__init__(range(n), num_replicas=num_replicas, rank=rank, seed=seed)

    class WholeFilesRoundRobin(Sampler):  # few files, but unequal counts per rank
        def __init__(self, n, block_size, num_replicas, rank, seed=0):
            self.n, self.block, self.replicas, self.rank, self.seed, self.epoch = n, block_size, num_replicas, rank, seed, 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            files = torch.randperm(math.ceil(self.n / self.block), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            mine = files.tolist()[self.rank :: self.replicas]
            return iter([i for f in mine for i in range(f * self.block, min((f + 1) * self.block, self.n))])

        def __len__(self):
            return len(list(iter(self)))

    solution = namespace["BlockDistributedSampler"]

    class GlobalRandomState(solution):  # shuffles with the global generator: ranks would disagree
        def __iter__(self):
            files = torch.randperm(math.ceil(self.n / self.block_size)).tolist()
            order = [i for f in files for i in range(f * self.block_size, min((f + 1) * self.block_size, self.n))]
            order += order[: len(self) * self.num_replicas - self.n]
            return iter(order[self.rank * len(self) : (self.rank + 1) * len(self)])

    for wrong in (Strided, WholeFilesRoundRobin, GlobalRandomState):
        assert check_verdict(3, wrong) == "exercise 3: not yet", wrong.__name__


@pytest.mark.timeout(30)
def test_the_self_check_is_the_share_of_samples_a_local_rank_sampler_never_reads():
    """Counted with torch's sampler: 12 processes on 3 nodes of 4, each passing its LOCAL_RANK as rank."""
    n, nodes, per_node = 1438, 3, 4
    world_size = nodes * per_node
    read = set()
    for global_rank in range(world_size):
        local_rank = global_rank % per_node
        read.update(DistributedSampler(range(n), num_replicas=world_size, rank=local_rank, shuffle=True, seed=0))
    never_read_percent = 100 * (n - len(read)) / n
    question = lecture03_checks.SELF_CHECK
    assert question.expected == pytest.approx(never_read_percent)
    assert verdict(question, never_read_percent).startswith("self-check: correct - ")
    two_nodes_of_two = 50.0  # section 4's example (half never read), not worked out for 3 nodes of 4
    counted_as_fine = 0.0  # the job raises nothing
    the_share_read = 100 - never_read_percent
    for wrong in (two_nodes_of_two, counted_as_fine, the_share_read):
        assert verdict(question, wrong) == f"self-check: not yet - {question.hint}", wrong
    [(source, stored)] = [(s, out) for title, (s, out) in cells_titled(LECTURE, "from ddp_course.lecture03_checks import SELF_CHECK").items()]
    assert "self_check(SELF_CHECK, answer)" in source and "answer = None" in source
    assert stored.strip() == verdict(question, None)
