"""Lab 3 conversion checker: run your DDP version of labs/train_single.py on 2 CPU ranks and judge it.

    cp labs/train_single.py labs/my_ddp.py        # then turn labs/my_ddp.py into a DDP script
    python labs/lab3_convert_check.py             # checks labs/my_ddp.py
    python labs/lab3_convert_check.py SCRIPT      # checks another file
    python labs/lab3_convert_check.py --show-output SCRIPT    # also prints what SCRIPT printed

What SCRIPT must accept and do (train_single.py already does all of it: keep it that way):
- the flags --epochs N, --seed S, --batch-size B and --save PATH. The checker passes
  --epochs 2 --seed 0 --batch-size 128 --save <a temporary folder>/model.pt. Under DDP --batch-size
  is the batch of each process: the global batch is 2 x 128.
- train ddp_course.models.DigitsCNN on ddp_course.data.load_digits(), reading the data with
  DataLoaders in the main process (num_workers=0, the default), and write the trained weights with
  torch.save(state_dict, PATH).
- print the held-out accuracy of the weights it saves in a line that contains the word "accuracy"
  followed by the number (0.9721, or 97.21%: enough digits to tell 1 image in 359); the last such
  line printed counts (rank 0 printing it is enough).

The checker never reads SCRIPT's source. It launches SCRIPT on 2 gloo ranks through lab 4's observer
(labs/lab4_observe.py), which records which samples each rank read, the weights and gradients of
every optimizer step, every collective called from Python and every torch.save. The job runs as two
one-process nodes on this machine: two torchrun agents (--nnodes=2 --nproc_per_node=1) that meet at a
c10d rendezvous on 127.0.0.1, as two machines would. So LOCAL_RANK is 0 on both ranks while RANK is
0 and 1, and a script that shards its data by LOCAL_RANK, which a one-node run cannot tell from
RANK, reads the same samples on both ranks and fails check 1. The one-process reference is computed
here, in the checker's own process: a DigitsCNN that starts from rank 0's initial weights and trains
with SCRIPT's optimizer (same class, same settings) on the global batches (each step, both ranks'
batches together), for REFERENCE_STEPS steps. Seven checks, one line each:

  1 data-split       in epoch 0 the ranks read disjoint shares that cover the training set
  2 epoch-shuffle    epoch 1 reads the samples in a new order
  3 equal-replicas   both ranks hold the same weights before every optimizer step
  4 global-gradient  the first 3 steps' gradients are the mean-loss gradients of the global batch,
                     and after them the weights equal the one-process reference's
  5 checkpoint       rank 0 alone writes --save, and a bare DigitsCNN loads it (no "module." keys)
  6 job-metrics      the printed accuracy is the saved model's on the whole held-out set
  7 clean-exit       every rank makes the same collective calls and the job exits with status 0

Each line says PASS, FAIL with the evidence and a hint, or BLOCKED with the reason the check could
not be decided (the job died first, or a failed check makes it meaningless). Exit status 0 only when
all seven pass, 1 otherwise, 2 for a bad command line. A job that hangs is killed after JOB_TIMEOUT_S
seconds.

What it cannot see:
- the GPU half of the script. The job runs on CPUs with gloo (no GPU is visible to it), so the
  device choice (cuda:LOCAL_RANK, torch.cuda.set_device, device_ids), NCCL and tensors left on the
  wrong device are never executed here: a script can pass all seven checks and still put every
  rank of a node on cuda:0. Read those lines against lecture 1's diff, then run it on a GPU machine.
- check 6 barely sees two mistakes the course warns about, because on 2 ranks they change the
  printed number by less than the tolerance of half an image in 359 (0.5/359 = 1.4e-3): a
  DistributedSampler on the held-out set pads it to 360 with one repeated image, which moves the
  accuracy by (359 - c)/(359 x 360), about 8e-5, when that image is classified correctly (about 97%
  of the time), and fails only when it is not (2.7e-3); the mean of the two ranks' accuracies
  instead of their summed counts differs from the job's by |a0 - a1|/(2 x 359), below 1.4e-3 for
  any a0, a1, so it always passes. Both are harmless to the number at 2 ranks; they are still
  wrong (more ranks, or uneven slices, make them visible), which check 6 does not claim to catch.
- check 7's clean exit: the observer imports torch.distributed.nn.functional before SCRIPT runs
  (labs/lab4_observe.py says why), so only the script's own cause of gloo's abort at exit (a DDP
  model still alive at destroy_process_group()) can fail it; the hint names both causes, as the
  script run on its own can meet either.
"""

from __future__ import annotations

import inspect
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ddp_course.cli import CourseArgumentParser
from ddp_course.launch import REPO_ROOT, import_script
from ddp_course.models import DigitsCNN

# Lab 4's checker observes and judges most of what matters here; this file reuses its functions.
lab4 = import_script(Path(__file__).resolve().parent / "lab4_check.py", name="lab4_check_for_lab3")

DEFAULT_SCRIPT = "labs/my_ddp.py"
WORLD_SIZE = lab4.WORLD_SIZE  # 2 gloo ranks
BATCH_SIZE = lab4.BATCH_SIZE  # 128 per rank: 6 steps per epoch with a correct split
SCRIPT_ARGS = ["--epochs", "2", "--seed", "0", "--batch-size", str(BATCH_SIZE)]  # + --save PATH
RECORDED_STEPS = 100  # the observer saves weights and gradients of this many steps: all of them here
REFERENCE_STEPS = 3  # steps recomputed in one process (each costs a forward and backward pass of the global batch)
JOB_TIMEOUT_S = 120
REPLICA_TOLERANCE = 1e-6  # relative; DDP keeps the replicas bit for bit equal
REPLAY_TOLERANCE = 1e-3  # relative, on the distance the weights travelled; rounding gives about 1e-6

CHECKS = {
    1: ("data-split", "give the DataLoader a DistributedSampler with the job-wide rank (RANK, or dist.get_rank()), never LOCAL_RANK, which starts at 0 again on every machine: in every epoch each rank must read its own share of the samples"),
    2: ("epoch-shuffle", "call sampler.set_epoch(epoch) before each epoch: the sampler shuffles with its seed plus the epoch number"),
    3: ("equal-replicas", "DDP broadcasts rank 0's weights when it wraps the model, then gives every rank the same averaged gradient; replicas that start apart never meet again"),
    4: ("global-gradient", "DDP's backward() already averages the gradients over ranks: back-propagate your batch's mean loss as it is, and clear the gradients every step"),
    5: ("checkpoint", "save once, on rank 0 (ranks writing the same file race), the bare model's weights: model.module.state_dict(), then a barrier"),
    6: ("job-metrics", "each rank scores only its part of the held-out set: all-reduce the counts (correct, seen) before printing the accuracy"),
    7: ("clean-exit", "every rank must make the same collective calls in the same order. A gloo job aborts at exit (terminate called without an active exception) when its process group outlives destroy_process_group(), for two causes: a DDP model still alive (DDP keeps reference cycles: return from the function that built it, or del it, then gc.collect() before destroy_process_group()), and torch.distributed.nn.functional first imported after init_process_group (DDP imports it; its group= defaults then hold the group: import it before init_process_group). Lecture 1's labs/ddp_minimal.py marks both workarounds"),
}  # fmt: skip
# The held-out accuracy the script printed: the first decimal number (or number followed by %) after "accuracy".
ACCURACY = re.compile(r"accuracy.*?(\d+\.\d+|\d+(?=\s*%))(\s*%)?", re.IGNORECASE)


@dataclass
class Verdict:
    number: int
    status: str  # PASS, FAIL or BLOCKED
    evidence: str

    def line(self) -> str:
        name, hint = CHECKS[self.number]
        text = f"{self.number} {name:<15} {self.status:<7} {self.evidence}"
        return text + (f" -- hint: {hint}" if self.status == "FAIL" else "")


def renumbered(number: int, verdict) -> Verdict:
    """A verdict of lab 4's checker, under this checker's number."""
    return Verdict(number, verdict.status, verdict.evidence)


def script_args(out_dir: Path) -> list:
    """The learner's script's flags: SCRIPT_ARGS, and its checkpoint goes into out_dir."""
    return [*SCRIPT_ARGS, "--save", out_dir / "model.pt"]


OBSERVER_ENV = {"LAB4_OBSERVE_STEPS": str(RECORDED_STEPS)}  # the observer records the first steps' gradients


NODES = 2  # two one-process nodes: LOCAL_RANK 0 on both ranks (see the docstring)


def observe(script: Path, out_dir: Path):
    return lab4.observe(script, out_dir, script_args=script_args(out_dir), env=OBSERVER_ENV, timeout_s=JOB_TIMEOUT_S, nodes=NODES)


def recorded_steps(obs) -> list[dict[int, dict]]:
    """[{rank: what the observer saved before that optimizer step}], for the steps every rank recorded."""
    steps = []
    for step in range(1, RECORDED_STEPS + 1):
        records = {rank: obs.step_record(rank, step) for rank in range(WORLD_SIZE)}
        if any(record is None for record in records.values()):
            break
        steps.append(records)
    return steps


# --- check 3: equal replicas ----------------------------------------------------------------------------
def check_equal_replicas(obs, steps) -> tuple[Verdict, bool | None]:
    """Verdict, and whether the replicas are still equal at the last recorded step (None: not observed)."""
    if not steps:
        return Verdict(3, "BLOCKED", f"no optimizer step was recorded on every rank: the job {obs.ended()}"), None
    for number, records in enumerate(steps, start=1):
        for rank in range(1, WORLD_SIZE):
            difference = lab4.relative(records[0]["params"], records[rank]["params"])
            if difference > REPLICA_TOLERANCE:
                if number == 1:
                    evidence = f"before the first optimizer step rank {rank}'s weights differ from rank 0's (relative difference {difference:.2f}): the replicas started apart"
                else:
                    evidence = f"the replicas started equal, but before optimizer step {number} rank {rank}'s weights differ from rank 0's (relative difference {difference:.1e})"
                return Verdict(3, "FAIL", evidence), lab4.relative(steps[-1][0]["params"], steps[-1][rank]["params"]) <= REPLICA_TOLERANCE
    made = [sum(event["kind"] == "step" for event in obs.events.get(rank, [])) for rank in range(WORLD_SIZE)]
    if len(set(made)) > 1:
        counts = " and ".join(f"rank {rank} {count}" for rank, count in enumerate(made))
        return Verdict(3, "FAIL", f"the ranks made different numbers of optimizer steps ({counts})"), None
    return Verdict(3, "PASS", f"both ranks held the same weights before each of their {len(steps)} optimizer steps"), True


# --- check 4: the global batch's gradient, and the one-process reference ------------------------------------------
def check_global_gradient(obs, steps, train, started_equal: bool) -> Verdict:
    steps = steps[: REFERENCE_STEPS + 1]  # the weights before step REFERENCE_STEPS + 1 end the replay
    pairs, problem = lab4.gradient_steps(obs, train, count=REFERENCE_STEPS, own_params=True)
    scale_verdict, scale = lab4.check_gradient_scale(pairs, problem, obs)
    if scale_verdict.status != "PASS":
        return renumbered(4, scale_verdict)
    fresh_verdict = lab4.check_fresh_gradients(pairs, problem, scale, obs)
    if fresh_verdict.status != "PASS":
        return renumbered(4, fresh_verdict)
    if not started_equal:  # each rank's gradient was checked at its own weights; there is no one model to follow
        return Verdict(
            4, "PASS",
            f"the gradient of each of the first {len(pairs)} steps is the mean over ranks of each rank's batch-mean gradient at its "
            f"own weights; the weights are not compared with one process, as the replicas differ (check 3)",
        )  # fmt: skip
    gradients = f"the gradient of each of the first {len(pairs)} steps is the global batch's mean-loss gradient ({WORLD_SIZE} ranks x {BATCH_SIZE} samples)"
    replay = replay_in_one_process(steps, train)
    if isinstance(replay, str):
        return Verdict(4, "PASS", f"{gradients}; {replay}")
    difference, step = replay
    if difference > REPLAY_TOLERANCE:
        return Verdict(4, "FAIL", f"{gradients}, but after {step} steps rank 0's weights are not those of one process trained from the same start with the same optimizer on the same global batches (relative difference {difference:.2f})")
    return Verdict(4, "PASS", f"{gradients}, and after {len(steps) - 1} steps the weights equal those of one process trained on the same global batches")


def replay_in_one_process(steps, train) -> tuple[float, int] | str:
    """Train one DigitsCNN on the global batches with the script's optimizer, from rank 0's first weights.

    Returns the worst relative difference between the distances rank 0's weights and the replay's
    travelled from the start, and the step after which it occurred; or why no replay was possible.
    """
    images, labels = train.tensors
    first = steps[0][0]
    settings = first.get("optimizer") or {"class": "?", "groups": []}
    optimizer_class = getattr(torch.optim, settings["class"], None)
    if not isinstance(optimizer_class, type) or len(settings["groups"]) != 1:
        return f"the weights are not compared with one process: its optimizer ({settings['class']}, {len(settings['groups'])} parameter groups) is not one torch.optim optimizer with one group"
    model = DigitsCNN()
    vector_to_parameters(first["params"].clone(), model.parameters())  # a copy: the parameters become views of it
    accepted = inspect.signature(optimizer_class).parameters
    optimizer = optimizer_class(model.parameters(), **{k: v for k, v in settings["groups"][0]["settings"].items() if k in accepted and k != "params"})
    worst = (0.0, 0)
    for number, records in enumerate(steps[:-1], start=1):
        optimizer.param_groups[0].update(records[0]["optimizer"]["groups"][0]["settings"])  # a scheduler may change lr
        optimizer.zero_grad(set_to_none=True)
        batches = [torch.tensor(records[rank]["batch"]) for rank in sorted(records)]
        # DDP's loss: the mean over ranks of each rank's batch-mean loss.
        loss = sum(F.cross_entropy(model(images[batch]), labels[batch]) for batch in batches) / len(batches)
        loss.backward()
        optimizer.step()
        travelled_ddp = steps[number][0]["params"] - first["params"]
        travelled_replay = parameters_to_vector(model.parameters()).detach() - first["params"]
        worst = max(worst, (lab4.relative(travelled_ddp, travelled_replay), number))
    return worst


# --- check 5: the checkpoint ----------------------------------------------------------------------------
def check_checkpoint(obs) -> tuple[Verdict, dict | None]:
    """Who wrote into the output folder, and lab 4's verdict on the file; plus the weights it holds."""
    out_dir = obs.out_dir.resolve()
    writers = {
        rank: [event["path"] for event in obs.events.get(rank, []) if event["kind"] == "save" and event["path"] and Path(event["path"]).parent == out_dir]
        for rank in range(WORLD_SIZE)
    }  # fmt: skip
    saved_verdict, weights = lab4.check_saved_model(obs)
    extra = [rank for rank, paths in writers.items() if rank != 0 and paths]
    if extra:
        names = ", ".join(sorted({Path(path).name for rank in extra for path in writers[rank]}))
        who = [str(rank) for rank, paths in writers.items() if paths]
        ranks = f"ranks {', '.join(who[:-1])} and {who[-1]}" if len(who) > 1 else f"rank {who[0]}"
        return Verdict(5, "FAIL", f"{ranks} each called torch.save on {names}: one file, {len(who)} writers"), weights
    if saved_verdict.status == "PASS" and writers[0]:
        return Verdict(5, "PASS", f"rank 0 alone wrote it; {saved_verdict.evidence}"), weights
    return renumbered(5, saved_verdict), weights


# --- check 6: the printed accuracy ----------------------------------------------------------------------
def printed_accuracy(stdout: str) -> float | None:
    """The accuracy in the last line of output that reports one, as a fraction."""
    value = None
    for line in stdout.splitlines():
        match = ACCURACY.search(line)
        if match:
            number = float(match.group(1))
            value = number / 100 if match.group(2) or number > 1 else number
    return value


def check_job_metrics(obs, weights, held_out, ended_equal: bool | None) -> Verdict:
    reported = printed_accuracy(obs.run.stdout)
    if reported is None:
        if obs.finished:
            return Verdict(6, "FAIL", "the job printed no line with the word accuracy and a number (as in: held-out accuracy 0.9721)")
        return Verdict(6, "BLOCKED", f"no accuracy was printed: the job {obs.ended()} before")
    if ended_equal is False:
        return Verdict(6, "BLOCKED", "the ranks ended with different weights (check 3): no one model's accuracy is the job's")
    return renumbered(6, lab4.accuracy_verdict(6, reported, obs, weights, held_out, name="accuracy"))


# --- check 7: a clean exit ------------------------------------------------------------------------------
def check_clean_exit(obs) -> Verdict:
    collectives = lab4.check_collectives(obs)
    if collectives.status == "FAIL":
        # Lab 4's scripts take --timeout-s; a script here sets its process group's timeout itself.
        evidence = collectives.evidence.replace("until --timeout-s", "until their process group's timeout")
        return Verdict(7, "FAIL", evidence)
    if not obs.finished:
        evidence = f"the job {obs.ended()}"
        if obs.run.aborted_at_exit:
            evidence += (
                ": a rank aborted at exit (terminate called without an active exception), the sign of a DDP model still alive "
                "when the process group was destroyed (the observer imported torch.distributed.nn.functional before your script, "
                "which rules out the other cause here)"
            )  # fmt: skip
        return Verdict(7, "FAIL", evidence)
    return Verdict(7, "PASS", f"{collectives.evidence} with exit status 0")


def check(script: Path, out_dir: Path):
    """Run script under observation and decide the seven checks, in order."""
    obs = observe(script, out_dir)
    return obs, judge(obs)


def judge(obs) -> list[Verdict]:
    """The seven verdicts on one observed run, in order."""
    splits = lab4.digits()  # loaded once per process
    steps = recorded_steps(obs)
    replicas, ended_equal = check_equal_replicas(obs, steps)
    started_equal = bool(steps) and all(
        lab4.relative(steps[0][0]["params"], steps[0][rank]["params"]) <= REPLICA_TOLERANCE for rank in range(WORLD_SIZE)
    )  # fmt: skip
    checkpoint, weights = check_checkpoint(obs)
    verdicts = [
        renumbered(1, lab4.check_data_split(obs, len(splits.train))),
        renumbered(2, lab4.check_epoch_shuffle(obs)),
        replicas,
        check_global_gradient(obs, steps, splits.train, started_equal),
        checkpoint,
        check_job_metrics(obs, weights, splits.test, ended_equal),
        check_clean_exit(obs),
    ]
    return verdicts


def main(argv=None) -> int:
    parser = CourseArgumentParser(
        prog="lab3_convert_check.py",
        description="Check your DDP version of labs/train_single.py by running it on 2 CPU ranks (see the docstring).",
    )
    parser.add_argument(
        "script", nargs="?", default=DEFAULT_SCRIPT,
        help=f"your DDP script (default {DEFAULT_SCRIPT}); it must accept --epochs, --seed, --batch-size (per process) and --save",
    )  # fmt: skip
    parser.add_argument("--show-output", action="store_true", help="also print the script's stdout and stderr")
    args = parser.parse_args(argv)
    script = Path(args.script)
    if not script.is_absolute() and not script.exists():
        script = REPO_ROOT / script  # so that the default works from any folder
    if not script.is_file():
        first = " (start with: cp labs/train_single.py labs/my_ddp.py, then make it a DDP script)" if args.script == DEFAULT_SCRIPT else ""
        parser.error(f"no such script: {args.script}{first}")

    shown = " ".join([*SCRIPT_ARGS, "--save", "<temporary folder>/model.pt"])
    print(f"lab 3 conversion checker: {args.script} under torchrun, {WORLD_SIZE} gloo ranks on the CPU as {NODES} one-process nodes: {shown}", flush=True)
    with tempfile.TemporaryDirectory(prefix="lab3_check_") as out_dir:
        obs, verdicts = check(script.resolve(), Path(out_dir))
    if args.show_output:
        print(f"--- the script's stdout\n{obs.run.stdout}--- its stderr\n{obs.run.stderr}--- end of the script's output")
    print(f"the job {obs.ended()}")
    for verdict in verdicts:
        print(verdict.line())
    counts = {status: sum(v.status == status for v in verdicts) for status in ("PASS", "FAIL", "BLOCKED")}
    print(f"result: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['BLOCKED']} blocked of {len(verdicts)} checks")
    return 0 if counts["PASS"] == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
