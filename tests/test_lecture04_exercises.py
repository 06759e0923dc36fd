"""Lecture 04's exercise checks accept the solutions and reject the stubs and plausible wrong answers.

The solutions notebook runs once in this process (module fixture; its checks run real DDP in a
one-process gloo group, a few seconds). A check is one call, `check_exercise_N(answer)`
(ddp_course/lecture04_checks.py); each test passes it a wrong answer a learner might write and
expects "not yet"; the lecture's stubs must make the checks say "not solved yet". The solutions
notebook opens with the lecture's exercise set-up cell, copied.
"""

from datetime import timedelta

import pytest

from ddp_course.launch import REPO_ROOT
from ddp_course.authoring import notebooks
from ddp_course.authoring.notebooks import check_verdict, not_solved_verdicts, run_all_cells, run_check

LECTURE = REPO_ROOT / "lectures" / "04_ddp_internals.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "04_ddp_internals_solutions.ipynb"
FUNCTIONS = {1: "launch_sequence", 2: "bf16_mean_hook", 3: "init_arguments"}


@pytest.fixture(scope="module")
def solved():
    return run_all_cells(SOLUTIONS)


def stub_verdicts(namespace):
    """{number: verdict} of each check on the lecture's untouched exercise stub."""
    return notebooks.stub_verdicts(namespace, LECTURE, FUNCTIONS)


@pytest.mark.timeout(180)
def test_the_solutions_pass(solved):
    _, printed = solved
    for number in FUNCTIONS:
        assert printed[f"# Check exercise {number} (run after the cell above)"].strip().endswith(f"exercise {number}: correct")


@pytest.mark.timeout(180)
def test_the_lecture_stubs_fail_the_same_checks(solved):
    namespace, _ = solved
    assert stub_verdicts(namespace) == not_solved_verdicts(FUNCTIONS)


@pytest.mark.timeout(180)
def test_exercise_1_rejects_launching_out_of_order_or_too_late(solved):
    namespace, _ = solved

    def launch_when_ready(buckets, ready_order):  # forgets that launches go in bucket order
        events, missing = [], [set(b) for b in buckets]
        for name in ready_order:
            events.append(("ready", name))
            for index, bucket in enumerate(missing):
                if name in bucket:
                    bucket.discard(name)
                    if not bucket:
                        events.append(("launch", index))
        return events

    def launch_after_backward(buckets, ready_order):  # no overlap at all
        return [("ready", name) for name in ready_order] + [("launch", i) for i in range(len(buckets))]

    def launch_on_first_gradient(buckets, ready_order):  # a bucket goes when its first gradient is ready
        events, launched = [], 0
        for name in ready_order:
            events.append(("ready", name))
            while launched < len(buckets) and name in buckets[launched]:
                events.append(("launch", launched))
                launched += 1
        return events + [("launch", i) for i in range(launched, len(buckets))]

    for wrong in (launch_when_ready, launch_after_backward, launch_on_first_gradient):
        assert check_verdict(namespace, 1, wrong) == "exercise 1: not yet", wrong.__name__


@pytest.mark.timeout(180)
def test_exercise_2_rejects_sums_blocking_calls_and_wrong_dtypes(solved):
    namespace, _ = solved
    torch, dist = namespace["torch"], namespace["dist"]

    def no_division(process_group, bucket):
        buffer = bucket.buffer()
        work = dist.all_reduce(buffer.to(torch.bfloat16), async_op=True)
        return work.get_future().then(lambda f: buffer.copy_(f.value()[0]))

    def blocking(process_group, bucket):
        buffer = bucket.buffer()
        compressed = (buffer / dist.get_world_size()).to(torch.bfloat16)
        dist.all_reduce(compressed)
        future = torch.futures.Future()
        future.set_result(buffer.copy_(compressed))
        return future

    def waits_inside(process_group, bucket):
        buffer = bucket.buffer()
        compressed = (buffer / dist.get_world_size()).to(torch.bfloat16)
        dist.all_reduce(compressed, async_op=True).wait()
        future = torch.futures.Future()
        future.set_result(buffer.copy_(compressed))
        return future

    def not_compressed(process_group, bucket):
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    def stays_bfloat16(process_group, bucket):
        compressed = (bucket.buffer() / dist.get_world_size()).to(torch.bfloat16)
        return dist.all_reduce(compressed, async_op=True).get_future().then(lambda f: f.value()[0])

    for wrong in (no_division, blocking, waits_inside, not_compressed, stays_bfloat16):
        assert check_verdict(namespace, 2, wrong) == "exercise 2: not yet", wrong.__name__


def hook_in(torch, dist, dtype):
    """The right hook, sending dtype: with torch.bfloat16 the solution, with torch.float16 torch's fp16_compress_hook."""

    def hook(process_group, bucket):
        buffer = bucket.buffer()
        compressed = (buffer / dist.get_world_size(process_group)).to(dtype)
        work = dist.all_reduce(compressed, group=process_group, async_op=True)
        return work.get_future().then(lambda future: buffer.copy_(future.value()[0]))

    return hook


@pytest.mark.timeout(180)
def test_exercise_2_rejects_float16_and_says_it_overflows(solved):
    """The old exercise's answer (float16) is rejected; a float16 round trip sent as bf16 is rejected by the
    gradients near 1e5, the case that shows why bf16 is chosen (checked before real DDP's small gradients)."""
    namespace, _ = solved
    torch, dist = namespace["torch"], namespace["dist"]
    assert check_verdict(namespace, 2, hook_in(torch, dist, torch.bfloat16)) == "exercise 2: correct"
    printed = run_check(namespace, 2, hook_in(torch, dist, torch.float16)).strip().splitlines()
    assert printed[-1] == "exercise 2: not yet" and "got dtypes" in printed[0]

    def float16_sent_as_bfloat16(process_group, bucket):
        buffer = bucket.buffer()
        compressed = (buffer / dist.get_world_size(process_group)).to(torch.float16).to(torch.bfloat16)
        work = dist.all_reduce(compressed, group=process_group, async_op=True)
        return work.get_future().then(lambda future: buffer.copy_(future.value()[0].to(torch.float16)))

    printed = run_check(namespace, 2, float16_sent_as_bfloat16).strip().splitlines()
    assert printed[-1] == "exercise 2: not yet" and printed[0].startswith("gradients near 1e5"), printed


@pytest.mark.timeout(180)
def test_exercise_3_rejects_rank_as_device_visible_list_index_missing_timeout_and_nccl_on_cpu(solved):
    namespace, _ = solved
    torch, solution = namespace["torch"], namespace["init_arguments"]

    def device_from_rank(env, cuda_available):  # the classic: cuda:RANK breaks on node 1 of 2 x 8
        device, arguments = solution(env, cuda_available)
        if cuda_available:
            device = torch.device("cuda", int(env["RANK"]))
            arguments = {**arguments, "device_id": device}
        return device, arguments

    def physical_index(env, cuda_available):  # cuda:<the machine's GPU number>: CUDA renumbers visible GPUs
        device, arguments = solution(env, cuda_available)
        if cuda_available and env.get("CUDA_VISIBLE_DEVICES"):
            device = torch.device("cuda", int(env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])]))
            arguments = {**arguments, "device_id": device}
        return device, arguments

    def no_timeout(env, cuda_available):
        device, arguments = solution(env, cuda_available)
        return device, {key: value for key, value in arguments.items() if key != "timeout"}

    def always_nccl(env, cuda_available):
        device, arguments = solution(env, True)
        return device, arguments

    def strings(env, cuda_available):  # rank and world size as torchrun gives them: strings
        device, arguments = solution(env, cuda_available)
        return device, {**arguments, "rank": env["RANK"], "world_size": env["WORLD_SIZE"]}

    def local_rank_as_rank(env, cuda_available):  # LOCAL_RANK passed as the job-wide rank
        device, arguments = solution(env, cuda_available)
        return device, {**arguments, "rank": int(env["LOCAL_RANK"])}

    for wrong in (device_from_rank, physical_index, no_timeout, always_nccl, strings, local_rank_as_rank):
        assert check_verdict(namespace, 3, wrong) == "exercise 3: not yet", wrong.__name__
    assert check_verdict(namespace, 3, solution) == "exercise 3: correct"
    assert isinstance(solution({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, False)[1]["timeout"], timedelta)


@pytest.mark.timeout(30)
def test_the_self_check_is_the_norm_after_clipping_in_a_hook_then_averaging():
    """Each rank clips its local gradient with torch's clip_grad_norm_ (what a hook would do), then the
    all-reduce averages the clipped gradients: the norm the optimizer sees."""
    import torch

    from ddp_course.lecture04_checks import SELF_CHECK
    from ddp_course.self_check import verdict

    local_gradients = [torch.tensor([3.0, 4.0]), torch.tensor([-3.0, 4.0])]
    clipped = []
    for gradient in local_gradients:
        parameter = torch.nn.Parameter(torch.zeros(2))
        parameter.grad = gradient.clone()
        torch.nn.utils.clip_grad_norm_([parameter], max_norm=1.0)
        clipped.append(parameter.grad)
    stepped_norm = torch.stack(clipped).mean(dim=0).norm().item()
    assert SELF_CHECK.expected == pytest.approx(stepped_norm, rel=1e-5)
    assert verdict(SELF_CHECK, stepped_norm).startswith("self-check: correct - ")
    averaged = torch.stack(local_gradients).mean(dim=0)
    clipped_after_backward = min(1.0, averaged.norm().item())  # the right place: max_norm reached
    not_clipped = averaged.norm().item()  # the averaged gradient's own norm, 4
    one_rank_unclipped = local_gradients[0].norm().item()  # 5
    for wrong in (clipped_after_backward, not_clipped, one_rank_unclipped):
        assert verdict(SELF_CHECK, wrong) == f"self-check: not yet - {SELF_CHECK.hint}", wrong
    [(source, stored)] = notebooks.cells_titled(LECTURE, "from ddp_course.lecture04_checks import SELF_CHECK").values()
    assert "self_check(SELF_CHECK, answer)" in source and "answer = None" in source
    assert stored.strip() == verdict(SELF_CHECK, None)
