"""Lecture 4's helpers: the bucket drawing, the overlap table, and the exercise checks.

A check is one call in the notebook, e.g. `check_exercise_2(bf16_mean_hook)`. Each prints what it
found and ends with one verdict line: "exercise N: correct", "exercise N: not yet" or
"exercise N: not solved yet - fill in NAME above". The checks of exercises 1 and 2 run real DDP in
this process, in a gloo group of one process (an in-memory store: no port, no other process).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from datetime import timedelta

from ddp_course.launch import free_port
from ddp_course.self_check import Question

# ----------------------------------------------------------------------------- the self-check
# Section 4.1: a parameter's hook clips each rank's local gradient, then DDP averages the clipped ones.
# Local gradients (3, 4) and (-3, 4), both of norm 5, clipped to norm 1: (0.6, 0.8) and (-0.6, 0.8),
# whose mean (0, 0.8) has norm 0.8; clipping the averaged (0, 4) after backward() would give norm 1.
SELF_CHECK = Question(
    name="self-check",
    expected=0.8,
    why="each rank's hook scales its own gradient to norm 1, (0.6, 0.8) and (-0.6, 0.8); DDP averages them to "
    "(0, 0.8): clipped by the wrong norm, and below max_norm",
    hint="reread section 4.1 (where to clip): what does a parameter's hook see, and what does DDP do with what the hook returns?",
)

# ----------------------------------------------------------------------------- the bucket drawing


def draw_buckets(ax, buckets: list[list[str]], parameter_bytes: dict[str, int], title: str) -> None:
    """DDP's buckets as boxes in launch order (bucket 0 on the left), each parameter a slice sized by its bytes."""
    kib = {name: size / 1024 for name, size in parameter_bytes.items()}
    left, gap = 0.0, 40.0
    for index, bucket in enumerate(buckets):
        width = sum(kib[name] for name in bucket)
        ax.add_patch(_box(left, 0.0, width, 1.0, fill=False, linewidth=2))
        ax.text(left + width / 2, 1.08, f"bucket {index}", ha="center", va="bottom", fontsize=8)
        x = left
        for name in bucket:
            ax.add_patch(_box(x, 0.1, kib[name], 0.8, color=_colour(name), alpha=0.6))
            if kib[name] > 100:  # room for a label; the colours (legend) name the small ones
                ax.text(x + kib[name] / 2, 0.5, name, ha="center", va="center", fontsize=7)
            x += kib[name]
        left += width + gap
    ax.set(xlim=(-gap / 2, left), ylim=(0, 1.35), yticks=[], title=title)
    ax.set_xlabel("KiB, buckets in launch order (bucket 0 first)", fontsize=8)
    layers = sorted({name.split(".")[0] for bucket in buckets for name in bucket})
    ax.legend(
        handles=[_box(0, 0, 1, 1, color=_colour(layer), alpha=0.6, label=layer) for layer in layers], fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5)
    )


def _box(x, y, width, height, **style):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, **style)


def _colour(name: str) -> str:
    layers = ("head", "embed", "hidden", "proj")
    colours = ("tab:red", "tab:blue", "tab:green", "tab:orange")
    return dict(zip(layers, colours)).get(name.split(".")[0], "tab:grey")


# ----------------------------------------------------------------------------- the overlap table


def overlap_table(rows_by_run: dict[str, list[dict]]) -> str:
    """profiling.overlap_summary() rows of several runs as one table row per run (every rank and step).

    A cell shows a number when every rank and step agree, else the list of values, so nothing is hidden.
    """
    columns = [
        ("all_reduces", "all-reduces per step"),
        ("launched_before_compute_end", "launched during backward"),
        ("started_before_backward_end", "started before backward() returned"),
        ("overlapped", "overlapped"),
    ]
    header = f"{'all-reduce':10} | " + " | ".join(title for _, title in columns)
    lines = [header, "-" * len(header)]
    for run, rows in rows_by_run.items():
        cells = []
        for key, title in columns:
            values = sorted({row[key] for row in rows})
            cells.append(f"{values[0] if len(values) == 1 else values!s:>{len(title)}}")
        lines.append(f"{run:10} | " + " | ".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one-process DDP


@contextlib.contextmanager
def quiet_stderr():
    """Hide what C++ code prints on stderr (file descriptor 2) for the block.

    find_unused_parameters=True on a model that uses every parameter makes the reducer print an
    expected performance warning, with a timestamp, which would make the check's output change.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def one_process_group():
    """A gloo group of one process in this process, for the checks: every collective is local."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # no DDP wrapper may outlive the group (CONTRIBUTING.md, "gloo teardown")
        if created:
            dist.destroy_process_group()


def real_launch_logs() -> dict:
    """{(find_unused_parameters, bucket_cap_mb): (buckets, iteration-3 log)} from real DDP (one process)."""
    import torch

    from ddp_course import lecture04_models as demos  # torch is imported when a check runs, not with the notebook

    logs = {}
    with one_process_group(), quiet_stderr():
        for find_unused in (True, False):
            for cap in (0.005, 0.6):
                torch.manual_seed(0)
                ddp = demos.DDP(demos.OutOfOrderNet(), bucket_cap_mb=cap, find_unused_parameters=find_unused)
                log = []
                demos.logging_hooks(ddp, log)
                demos.train_steps(ddp, 2, rank=0)
                log.clear()
                demos.train_steps(ddp, 1, rank=0)
                logs[find_unused, cap] = (demos.bucket_names(ddp), [tuple(event) for event in log])
                del ddp
    return logs


def _not_solved(number: int, name: str) -> None:
    print(f"exercise {number}: not solved yet - fill in {name} above")


# ----------------------------------------------------------------------------- exercise 1


def check_exercise_1(launch_sequence) -> None:
    """launch_sequence(buckets, ready_order) against worked cases and against real DDP's launch log."""
    try:
        launch_sequence([["a"]], ["a"])
    except NotImplementedError:
        return _not_solved(1, "launch_sequence")
    cases = [  # (buckets, ready order, expected): bucket 0 is ready last, so all wait for it
        ([["c"], ["b"], ["a"]], ["a", "b", "c"],
         [("ready", "a"), ("ready", "b"), ("ready", "c"), ("launch", 0), ("launch", 1), ("launch", 2)]),
        ([["a", "b"], ["c"]], ["a", "c", "b"], [("ready", "a"), ("ready", "c"), ("ready", "b"), ("launch", 0), ("launch", 1)]),
        ([["a"], ["b", "c"], ["d"]], ["a", "b", "d", "c"],
         [("ready", "a"), ("launch", 0), ("ready", "b"), ("ready", "d"), ("ready", "c"), ("launch", 1), ("launch", 2)]),
    ]  # fmt: skip
    ok = all([tuple(e) for e in launch_sequence(b, r)] == expected for b, r, expected in cases)
    for (find_unused, cap), (buckets, log) in real_launch_logs().items():
        ready = [name for kind, name in log if kind == "ready"]
        mine = [tuple(event) for event in launch_sequence(buckets, ready)]
        if mine != log:
            print(f"differs from real DDP (find_unused_parameters={find_unused}, bucket_cap_mb={cap}):\n  DDP:  {log}\n  yours: {mine}")
            ok = False
    print("exercise 1: correct" if ok else "exercise 1: not yet")


# ----------------------------------------------------------------------------- exercise 2


class FakeBucket:
    """What a communication hook reads of a bucket: its flat buffer."""

    def __init__(self, values):
        self._buffer = values

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def is_last(self):
        return True


class BlockingWait(Exception):
    """Raised when the hook waits for an all-reduce its partner has not joined yet (a real rank would block)."""


class TwoRankWorld:
    """dist.all_reduce between this process's two calls of the hook: rank 0's call, then rank 1's."""

    def __init__(self):
        self.pending, self.sent_dtypes = [], []

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.sent_dtypes.append(tensor.dtype)
        work = FakeWork(tensor, op)
        self.pending.append(work)
        if not async_op:
            work.wait()
        return work if async_op else None

    def deliver(self):
        import torch.distributed as dist

        first, second = self.pending
        total = first.tensor.double() + second.tensor.double()
        for work in (first, second):
            work.tensor.copy_(total / 2 if work.op == dist.ReduceOp.AVG else total)
            work.future.set_result([work.tensor])


class FakeWork:
    def __init__(self, tensor, op):
        import torch

        self.tensor, self.op, self.future = tensor, op, torch.futures.Future()

    def wait(self):
        if not self.future.done():
            raise BlockingWait()
        return True

    def get_future(self):
        return self.future


def two_rank_round(hook, grads):
    """Call the hook once per rank's gradients in the simulated world: (world, futures), or None if it blocked."""
    import torch.distributed as dist

    world, saved = TwoRankWorld(), (dist.all_reduce, dist.get_world_size)
    dist.all_reduce, dist.get_world_size = world.all_reduce, (lambda group=None: 2)
    try:
        futures = [hook(None, FakeBucket(grad.clone())) for grad in grads]
    except BlockingWait:
        return None
    finally:
        dist.all_reduce, dist.get_world_size = saved
    return world, futures


def mean_is_right(hook, grads) -> bool:
    """The hook's futures give the ranks' mean as float32, within bf16 rounding, on both ranks."""
    import torch

    world, futures = two_rank_round(hook, grads)
    if len(world.pending) != 2 or any(dtype != torch.bfloat16 for dtype in world.sent_dtypes):
        print(f"expected one all-reduce of a bfloat16 tensor per call, got dtypes {world.sent_dtypes}")
        return False
    world.deliver()
    results = [future.wait() for future in futures]
    mean = (grads[0] + grads[1]) / 2
    # bfloat16 keeps 8 significant bits: each half and their sum are rounded with a relative error of
    # at most 2**-8, so the error stays below 2**-7 x (|g0| + |g1|)
    bound = 2**-7 * (grads[0].abs() + grads[1].abs())
    return all(isinstance(r, torch.Tensor) and r.dtype == torch.float32 and bool(((r - mean).abs() <= bound).all()) for r in results)


def check_exercise_2(bf16_mean_hook) -> None:
    """The hook: bf16 on the wire, the mean in float32, asynchronous; then in real DDP against the built-in."""
    import torch

    try:
        bf16_mean_hook(None, FakeBucket(torch.ones(4)))
    except NotImplementedError:
        return _not_solved(2, "bf16_mean_hook")
    except Exception:
        pass  # no process group yet: the simulated world below provides one
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=generator) for _ in range(2)]
    large = [1e5 + 1e3 * torch.randn(1000, generator=generator) for _ in range(2)]  # a sum near 2e5
    if two_rank_round(bf16_mean_hook, grads) is None:
        print("your hook waits for its all-reduce inside backward: no overlap (use async_op=True and return the future)")
        print("exercise 2: not yet")
        return
    ok = mean_is_right(bf16_mean_hook, grads)
    if not ok:
        print("the future's value must be the mean of the ranks' buckets, as float32")
    if ok:
        ok = mean_is_right(bf16_mean_hook, large)
        if not ok:
            print(f"gradients near 1e5 on two ranks: not their mean (float16's largest number is {torch.finfo(torch.float16).max:.0f})")
    if ok:  # the hook in real DDP (one process): gradients within bfloat16 rounding of DDP's own
        from ddp_course import lecture04_models as demos

        with one_process_group():
            grads_hook = demos.grads_with_hook(0, bf16_mean_hook)
            grads_builtin = demos.grads_with_hook(0, None)
        ok = all(bool(((a - b).abs() <= 2**-7 * b.abs()).all()) for a, b in zip(grads_hook, grads_builtin))
        if not ok:
            print("in real DDP your hook's gradients differ from the built-in all-reduce's")
    if ok:
        print(f"  gradients near 1e5 on two ranks: your mean is finite; float16 rounds 1e5 to {float(torch.tensor(1e5).half())}")
    print("exercise 2: correct" if ok else "exercise 2: not yet")


# ----------------------------------------------------------------------------- exercise 3


def _torchrun_env(rank, local_rank, world_size, local_world_size, visible=None):
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": "node0", "MASTER_PORT": "29400",
           "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


# (what torchrun set, CUDA available?, the device, the backend, what the case teaches)
EXERCISE_3_CASES = [
    (_torchrun_env(1, 1, 2, 2), False, "cpu", "gloo", "a laptop, 2 CPU ranks"),
    (_torchrun_env(9, 1, 16, 8), True, "cuda:1", "nccl", "node 1 of 2 x 8 GPUs: RANK 9, LOCAL_RANK 1"),
    (_torchrun_env(2, 2, 4, 4, "4,5,6,7"), True, "cuda:2", "nccl", "CUDA_VISIBLE_DEVICES=4,5,6,7: GPU 6 is cuda:2 here"),
    (_torchrun_env(13, 5, 16, 8), True, "cuda:5", "nccl", "node 1 of 2 x 8 GPUs: RANK 13, LOCAL_RANK 5"),
]


def _problems(device, arguments, expected_device, expected_backend, env) -> list[str]:
    import torch

    problems = []
    if not isinstance(device, torch.device) or device != torch.device(expected_device):
        problems.append(f"device {device}, expected {expected_device}")
    if arguments.get("backend") != expected_backend:
        problems.append(f"backend {arguments.get('backend')!r}, expected {expected_backend!r}")
    if arguments.get("init_method", "env://") != "env://":
        problems.append("init_method: torchrun's rendezvous is read with env://")
    if arguments.get("rank") != int(env["RANK"]) or arguments.get("world_size") != int(env["WORLD_SIZE"]):
        problems.append(f"rank/world_size {arguments.get('rank')!r}/{arguments.get('world_size')!r}: the job-wide RANK and WORLD_SIZE, as integers")
    if not isinstance(arguments.get("timeout"), timedelta):
        problems.append("no timeout (a datetime.timedelta): a missing rank would make the others wait 10-30 min")
    if expected_backend == "nccl" and arguments.get("device_id") != torch.device(expected_device):
        problems.append(f"device_id {arguments.get('device_id')}: NCCL binds the group to this process's GPU")
    if expected_backend == "gloo" and arguments.get("device_id") is not None:
        problems.append("device_id on gloo/CPU: only an NCCL group is bound to a GPU")
    return problems


def _joins_a_real_group(init_arguments) -> bool:
    """Run the CPU answer for real: a one-process gloo job through env://, as torchrun would start it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return True  # a group already exists in this process: nothing to try
    env = _torchrun_env(0, 0, 1, 1)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        _, arguments = init_arguments(dict(env), False)
        dist.init_process_group(**arguments)
        joined = (dist.get_backend(), dist.get_rank(), dist.get_world_size()) == ("gloo", 0, 1)
        dist.destroy_process_group()
        return joined
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_exercise_3(init_arguments) -> None:
    """init_arguments(env, cuda_available) -> (device, init_process_group keywords) on four machines, then for real."""
    ok = True
    for env, cuda, expected_device, expected_backend, label in EXERCISE_3_CASES:
        try:
            device, arguments = init_arguments(dict(env), cuda)
        except NotImplementedError:
            return _not_solved(3, "init_arguments")
        problems = _problems(device, arguments, expected_device, expected_backend, env)
        print(f"  {label}: {'ok' if not problems else '; '.join(problems)}")
        ok = ok and not problems
    if ok:
        joined = _joins_a_real_group(init_arguments)
        print(f"  a real one-process gloo job joined with your arguments: {joined}")
        ok = joined
    print("exercise 3: correct" if ok else "exercise 3: not yet")
