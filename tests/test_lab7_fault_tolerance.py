"""Lab 7: crash, restart and resume exactly; resume on another world size without losing a sample.

The sampler tests run in this process. The lab's launches are shared through module fixtures:
one uninterrupted run and three crash-and-restart runs of a model with dropout
(benchmarks/lab7_crash_trials.py's trial functions, so the test and the 10-trial benchmark judge
alike; in the last one rank 1 also plays a node with a stale view of the checkpoint directory when
it restarts), a resume in which rank 1 loads a stale copy of the newest checkpoint, one elastic
job of two agents that loses one, and a torchrun the lab refuses. The uninterrupted run, the
stale-copy resume and the first crash run are rows of one launch (SHARED_ROWS): most of a launch
is start-up, which they pay once instead of three times. The lab's other refusal, a
--crash-rank outside the job, needs the job's size but no second process: main() runs here with
the context of a rank of 2 (its one-line exit under torchrun is the refused launch's).

The `launches` fixture runs the five launches in threads: the elastic job spends most of its time waiting
(for the rendezvous's heartbeat and last-call timeouts) and the others use that time, two at a
time (LAUNCHES_AT_ONCE), so the module takes about as long as the CPU work of its launches
instead of the sum of their durations. A launch's deadline (run_torchrun's timeout_s) counts from
its own start, not from its place in the queue.
"""

import json
import re
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_course.authoring.notebooks import stored_cell
from ddp_course.cluster.multinode import Agent, agent_command
from ddp_course.distributed import DistContext
from ddp_course.launch import REPO_ROOT, free_port, import_script, port_is_open, run_torchrun, wait_until
from ddp_course.models import DigitsCNN
from ddp_course.resume import RESTART_SAFE_ENV, ResumableDistributedSampler, epoch_order, samples_consumed

LAB7 = REPO_ROOT / "labs" / "lab7_fault_tolerance.py"
rows_launch = import_script(REPO_ROOT / "tests" / "scripts" / "rows_launch.py", "rows_launch")

# --- ResumableDistributedSampler (ddp_course/resume.py) ----------------------------------------------

# (samples, world size): even shards, padded shards, more padding than a shard, more ranks than samples
SIZES = [(1438, 2), (37, 4), (10, 3), (3, 5)]


def shards(num_samples, world_size, seed, epoch, start=0):
    samplers = [ResumableDistributedSampler(num_samples, world_size, rank, seed) for rank in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch, start)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize(("num_samples", "world_size"), SIZES)
def test_from_the_start_it_is_distributed_sampler(num_samples, world_size):
    for rank, shard in enumerate(shards(num_samples, world_size, seed=7, epoch=3)):
        reference = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=7)
        reference.set_epoch(3)
        assert shard == list(reference) and len(shard) == len(reference)


@pytest.mark.parametrize(("num_samples", "world_size"), SIZES)
def test_same_world_size_continues_where_the_uninterrupted_sampler_is(num_samples, world_size):
    batch_size, batches_done = 2, 1
    start = samples_consumed(0, batches_done, batch_size, world_size, num_samples)
    whole = shards(num_samples, world_size, seed=1, epoch=2)
    resumed = shards(num_samples, world_size, seed=1, epoch=2, start=start)
    assert resumed == [shard[batches_done * batch_size :] for shard in whole]


@pytest.mark.parametrize(("num_samples", "old", "new"), [(1438, 2, 1), (50, 2, 3), (101, 3, 8), (37, 3, 2), (40, 4, 2)])
def test_another_world_size_reads_the_rest_once(num_samples, old, new):
    """Old ranks read 3 batches of 4, new ranks the rest: every sample once, plus at most new - 1 padding."""
    start = samples_consumed(0, 3, 4, old, num_samples)
    before = [i for shard in shards(num_samples, old, seed=5, epoch=4) for i in shard[:12]]
    after_shards = shards(num_samples, new, seed=5, epoch=4, start=start)
    assert len({len(shard) for shard in after_shards}) == 1  # every new rank makes the same number of steps
    # Read step by step, rank by rank, the new ranks continue one process's order for this epoch...
    interleaved = [i for step in zip(*after_shards) for i in step]
    rest, padding = interleaved[: num_samples - start], interleaved[num_samples - start :]
    assert rest == epoch_order(num_samples, 5, 4)[start:]
    # ...so the rest holds every sample the old ranks did not read, once; padding repeats fewer than `new`.
    assert sorted(before + rest) == list(range(num_samples))
    assert len(padding) == (-(num_samples - start)) % new < new


@pytest.mark.parametrize(("old", "new", "failure"), [(2, 1, "repeats"), (1, 2, "skips")])
def test_a_batch_count_is_the_wrong_position(old, new, failure):
    """What the sampler avoids: skipping 3 batches of 4 per rank on the new world size."""
    num_samples = 40
    before = [i for shard in shards(num_samples, old, seed=0, epoch=0) for i in shard[:12]]
    naive = [i for shard in shards(num_samples, new, seed=0, epoch=0) for i in shard[12:]]
    if failure == "repeats":  # 2 ranks read 24 samples; 1 rank skipping 12 reads 12 of them again
        assert len(set(before) & set(naive)) == 12 and set(before) | set(naive) == set(range(num_samples))
    else:  # 1 rank read 12; 2 ranks skipping 12 each never read 12 others
        assert not set(before) & set(naive) and len(set(before) | set(naive)) == num_samples - 12


def test_samples_consumed_stops_at_the_end_of_the_epoch():
    assert samples_consumed(0, 10, 32, 2, 1438) == 640
    assert samples_consumed(640, 12, 32, 2, 1438) == 1408
    assert samples_consumed(640, 13, 32, 2, 1438) == 1438  # the 23rd batch holds 15 per rank: the epoch is done
    assert samples_consumed(640, 3, 32, 1, 1438) == 736


def test_bad_positions_are_refused():
    sampler = ResumableDistributedSampler(10, 2, 1)
    with pytest.raises(ValueError, match="samples_consumed must be in 0..10"):
        sampler.set_epoch(0, 11)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        ResumableDistributedSampler(10, 2, 2)


# --- crash and restart: bit for bit the uninterrupted run --------------------------------------------

# (crash step, crash rank) with a checkpoint every 5 of 30 steps (23 per epoch): a crash of rank 1
# early, of rank 0 (the rank that writes checkpoints) before the end of epoch 1, of rank 1 in epoch 2.
# Every run trains the digits model with --dropout 0.1 (lab7_crash_trials.DROPOUT): the weights only
# match if the resumed run draws the same dropout masks as the uninterrupted one.
CRASHES = [(7, 1), (19, 0), (26, 1)]
# The crash whose workers run the lab through the stale-node driver (STALE_NODE, "listing"): its
# restart finds checkpoints 15, 20 and 25, and rank 1 lists 20 as the newest.
STALE_LISTING_CRASH = (26, 1)
# The crash run that is the last row of the uninterrupted run's launch (shared_launch); the others
# are launches of their own, as torchrun restarts a launch once and the lab crashes on attempt 0 only.
SHARED_CRASH = (7, 1)
# Launches running at once besides the elastic job. Each is CPU-bound on 2 cores; more at once only
# adds switching: 6 uninterrupted runs took 33.5 s two at a time, 41.5 s all at once (65 and 82
# CPU-seconds), 37.9 s one at a time.
LAUNCHES_AT_ONCE = 2


@pytest.fixture(scope="module")
def trials():
    return import_script(REPO_ROOT / "benchmarks" / "lab7_crash_trials.py")


@pytest.fixture(scope="module")
def launches(trials, tmp_path_factory):
    """{name: Future} of every launch in this module (module docstring).

    The elastic job starts first, alone: its second agent must join the rendezvous within the
    first agent's last call (RENDEZVOUS_CONF), which a machine busy starting other jobs could
    exceed. The others start once both of its workers train, LAUNCHES_AT_ONCE at a time, in the
    order submitted: the shared launch first, the longest (three rows, one after another).
    """
    crash_dir, elastic_dir = tmp_path_factory.mktemp("crash_trials"), tmp_path_factory.mktemp("elastic")
    no_variable_dir = tmp_path_factory.mktemp("no_variable")
    driver = crash_dir / "stale_node.py"  # shared_row_commands names it too
    driver.write_text(STALE_NODE)
    # One thread for the elastic job, which waits most of its time; LAUNCHES_AT_ONCE for the rest.
    with ThreadPoolExecutor(max_workers=1 + LAUNCHES_AT_ONCE, thread_name_prefix="lab7") as pool:
        futures = {"elastic": pool.submit(elastic_launch, elastic_dir)}

        def two_ranks_train():  # rank 1 writes its sample file once the rendezvous has closed
            return any((elastic_dir / "samples").glob("samples_attempt*_rank1.jsonl")) or futures["elastic"].done()

        wait_until(two_ranks_train, 300)
        futures["shared"] = pool.submit(shared_launch, crash_dir, trials)
        for crash in CRASHES:
            if crash != SHARED_CRASH:
                stale_listing = (driver, ["listing"]) if crash == STALE_LISTING_CRASH else None
                futures[crash] = pool.submit(trials.crash_run, crash_dir, *crash, driver=stale_listing)
        futures["no variable"] = pool.submit(launch_without_the_variable, no_variable_dir)
        yield {"crash_dir": crash_dir, "elastic_dir": elastic_dir, "no_variable_dir": no_variable_dir, **futures}
        # Leaving the `with` waits for every launch; each has a deadline (run_torchrun's timeout_s).


# The rows of shared_launch, in order: (name, expected exit status on every rank). The copy row
# (rank 0 copies the uninterrupted run's checkpoint 25 and progress) ends on every rank before the
# stale-file row starts; the crash row goes last, as its restart reruns only the rows not yet passed.
SHARED_ROWS = [("reference", 0), ("copy", 0), ("stale-file", 1), ("crash", 0)]


def shared_row_commands(directory, trials):
    """{row name: (script, flags)} of shared_launch's rows; the stale-node driver is directory/stale_node.py."""
    driver = directory / "stale_node.py"
    stale_flags = [*trials.lab7_flags(directory, "stale_file"), "--timeout-s", 30]  # the later --timeout-s wins
    checkpoint_25 = ["checkpoint_step00000025.pt", "progress.json"]
    return {
        "reference": (LAB7, trials.lab7_flags(directory, "straight")),
        "copy": (driver, ["copy", directory / "straight_checkpoints", directory / "stale_file_checkpoints", *checkpoint_25]),
        "stale-file": (driver, ["file", LAB7, *stale_flags]),
        "crash": (LAB7, trials.crash_flags(directory, *SHARED_CRASH)),
    }


def shared_row(directory, trials, name, launch=None):
    """The RowRun of one row of shared_launch (launch: the launch's RunResult, once it has ended)."""
    script, flags = shared_row_commands(directory, trials)[name]
    run = rows_launch.Run(2, script, [str(flag) for flag in flags], dict(SHARED_ROWS)[name])
    return rows_launch.RowRun((name,), run, directory / "shared_rows_out" / name, launch)


def shared_launch(directory, trials):
    """One launch (--max-restarts=1) of the rows SHARED_ROWS through the recorder (tests/scripts/rows_launch.py).

    Every row but the crash writes its output to files of its own (its RowRun); the crash row writes to
    the launch's streams, as its output spans both attempts (a row's files are rewritten when it runs again)."""
    rows = []
    for name, _ in SHARED_ROWS:
        row = shared_row(directory, trials, name)
        entry = rows_launch.row_entry(row.key, row.run, row.folder, row.run.flags)
        rows.append({key: value for key, value in entry.items() if not (name == "crash" and key == "out_dir")})
    rows_folder = directory / "shared_rows"
    rows_folder.mkdir()
    return rows_launch.launch_rows(rows, rows_folder, 2, timeout_s=600, env=RESTART_SAFE_ENV, torchrun_args=["--max-restarts=1"])


@pytest.fixture(scope="module")
def crash_runs(launches, trials):
    """(directory, the uninterrupted run's RowRun, {crash: RunResult of the launch that ran it})."""
    directory, shared = launches["crash_dir"], launches["shared"].result()
    reference = shared_row(directory, trials, "reference", shared)
    assert reference.ended_as_expected(), reference.describe()
    results = {crash: shared if crash == SHARED_CRASH else launches[crash].result() for crash in CRASHES}
    return directory, reference, results


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("crash", CRASHES, ids=[f"step{step}_rank{rank}" for step, rank in CRASHES])
def test_crashed_run_ends_with_the_uninterrupted_weights(crash_runs, trials, crash):
    directory, _, results = crash_runs
    result = results[crash]
    assert trials.judge(result, directory, *crash) is None, result.describe()
    # The restart really was one: torchrun saw the rank die and started both ranks again.
    assert "attempt=0 max_restarts=1" in result.stdout and "attempt=1 max_restarts=1" in result.stdout
    assert re.search(r"done: step 30, world_size=2, attempt 1 \| (\d) steps recomputed", result.stdout)


def torch_load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.timeout(1800)
def test_the_weight_comparison_can_fail(crash_runs, trials):
    """The checkpoint of step 25 differs from the final weights, so same_weights() is no rubber stamp."""
    directory, _, _ = crash_runs
    for step in (25, 30):
        state = torch_load(directory / "straight_checkpoints" / f"checkpoint_step{step:08d}.pt")
        torch.save(state["model"], directory / f"step{step}.pt")
    assert trials.same_weights(directory / "step30.pt", directory / "straight.pt")
    assert not trials.same_weights(directory / "step25.pt", directory / "straight.pt")


@pytest.mark.timeout(1800)
def test_the_runs_train_with_dropout(crash_runs, trials):
    """The runs above have a dropout layer that draws a new mask at every training forward pass."""
    _, reference, _ = crash_runs
    assert f" dropout={trials.DROPOUT} " in reference.job_stdout()
    model = DigitsCNN(dropout=trials.DROPOUT).train()
    images = torch.ones(4, 1, 8, 8)
    assert not torch.equal(model(images), model(images))  # two forward passes, two masks
    assert DigitsCNN().state_dict().keys() == model.state_dict().keys()  # checkpoints of both load alike


@pytest.mark.timeout(1800)
def test_the_uninterrupted_run_checkpoints_its_position_in_samples(crash_runs):
    directory, reference, _ = crash_runs
    stdout = reference.job_stdout()
    # It ran once, on the launch's first attempt (its launch allows the crash row's restart).
    assert "attempt=0 max_restarts=1" in stdout and "attempt=1" not in stdout, reference.describe()
    assert "done: step 30, world_size=2, attempt 0 | 0 steps recomputed in all" in stdout
    assert "step 20: checkpoint (epoch 0, 1280 of 1438 samples)" in stdout  # 20 x 32 x 2
    assert "step 25: checkpoint (epoch 1, 128 of 1438 samples)" in stdout  # 23 steps end epoch 0
    state = torch_load(directory / "straight_checkpoints" / "checkpoint_step00000030.pt")
    assert (state["global_step"], state["epoch"], state["samples_consumed"]) == (30, 1, 448)
    assert len(state["rng_states"]) == 2 and not any(name.startswith("module.") for name in state["model"])
    assert json.loads((directory / "straight_checkpoints" / "progress.json").read_text())["global_step"] == 30


# --- ranks with different views of the checkpoint directory -----------------------------------------

# Rank 1 of a real job plays a node whose view of a shared checkpoint directory is out of date:
# "listing": it lists the directory as it was before the newest save (NFS attribute caching);
# "file": the newest file's name, but an older copy's contents (its global_step is 5 lower).
# Usage: stale_node.py listing|file LAB7 LAB7_FLAGS...
# and, as the row before "file" in shared_launch: stale_node.py copy FROM TO NAME... (rank 0 copies the
# files; the next row starts when every rank has ended this one).
STALE_NODE = textwrap.dedent(
    """
    import os, shutil, sys
    import ddp_course.training as training
    from ddp_course.checkpoint import list_checkpoints
    from ddp_course.launch import import_script

    if sys.argv[1] == "copy":
        source, target, names = sys.argv[2], sys.argv[3], sys.argv[4:]
        if os.environ["RANK"] == "0":
            os.makedirs(target)
            for name in names:
                shutil.copy(os.path.join(source, name), os.path.join(target, name))
        sys.exit(0)

    stale, lab = sys.argv[1], import_script(sys.argv[2])
    sys.argv = sys.argv[2:]  # the lab's own name in its messages ("lab7_fault_tolerance.py: error: ...")
    args = lab.parse_args(sys.argv[1:])
    fresh_load = training.load_checkpoint

    def listing_before_the_newest_save(directory):
        return ([None] + list_checkpoints(directory)[:-1])[-1]

    def older_copy(*args):
        state = fresh_load(*args)
        return {**state, "global_step": state["global_step"] - 5}

    if os.environ["RANK"] == "1" and stale == "listing":
        newest = listing_before_the_newest_save(args.checkpoint_dir)
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"stale node: rank 1 lists {newest.name if newest else None} as the newest (attempt {attempt})", flush=True)
        lab.latest_checkpoint = listing_before_the_newest_save
    if os.environ["RANK"] == "1" and stale == "file":
        training.load_checkpoint = older_copy
    try:
        status = lab.main(args)
    finally:  # the later rows of a shared launch load checkpoints as they are
        training.load_checkpoint = fresh_load
    sys.exit(status)
    """
)


@pytest.mark.timeout(1800)
def test_every_rank_resumes_from_the_checkpoint_rank_0_chose(crash_runs, trials):
    """At the restart of a crash run rank 1 lists step 20 as the newest; both ranks still resume from 25,
    and the job ends bit for bit as the uninterrupted run."""
    directory, _, results = crash_runs
    result = results[STALE_LISTING_CRASH]
    assert result.ok, result.describe()
    assert "stale node: rank 1 lists checkpoint_step00000020.pt as the newest (attempt 1)" in result.stdout, result.describe()
    assert re.search(r"attempt 1: resumed from .*checkpoint_step00000025\.pt \(epoch 1, 128 samples", result.stdout)
    step, rank = STALE_LISTING_CRASH
    assert trials.same_weights(directory / f"crash{step}_rank{rank}.pt", directory / "straight.pt")


@pytest.mark.timeout(1800)
def test_ranks_that_loaded_different_steps_stop_with_one_line(launches, trials):
    """Resume to step 30 from a copy of the uninterrupted run's checkpoint 25 (and its progress), in which
    rank 1 reads an older copy (a row of shared_launch, after the copy row)."""
    directory = launches["crash_dir"]
    result = shared_row(directory, trials, "stale-file", launches["shared"].result())
    # Both ranks ended the row by themselves with status 1; the launch went on to the crash row.
    assert result.ended_as_expected() and not result.launch.timed_out, result.describe()
    errors = [line for line in result.job_stderr().splitlines() if line.startswith("lab7_fault_tolerance.py: error:")]
    assert len(errors) == 1, result.describe()
    assert re.fullmatch(
        r"lab7_fault_tolerance.py: error: the ranks resumed from different states of \S+checkpoint_step00000025\.pt: "
        r"global_step \[25, 20\] in rank order \(does every node see the same files in the checkpoint directory\?\)",
        errors[0],
    ), errors[0]
    assert not result.a_rank_printed_a_traceback(), result.describe()
    assert not (directory / "stale_file.pt").exists()


# --- elastic: two agents, one is lost, the other finishes alone ----------------------------------------


def effective_steps(sample_dir: Path) -> dict[int, list[dict]]:
    """step -> the records of the attempt whose work the final weights contain (the last to do that step)."""
    by_attempt = {}
    for path in sample_dir.glob("samples_attempt*_rank*.jsonl"):
        attempt, rank = map(int, re.fullmatch(r"samples_attempt(\d+)_rank(\d+)\.jsonl", path.name).groups())
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_attempt.setdefault(record["step"], {}).setdefault(attempt, []).append({**record, "rank": rank})
    return {step: attempts[max(attempts)] for step, attempts in sorted(by_attempt.items())}


# Most of the elastic job is the surviving agent waiting: for B's heartbeats to expire (every 5 s,
# 3 missed by default: 15 s), then a last call for more nodes (30 s by default) before it goes on
# alone. Heartbeats every 2 s and a 15 s last call halve that. The last call also bounds how long
# the first round waits for agent B once A listens: 15 s is still several times B's start-up.
RENDEZVOUS_CONF = "last_call_timeout=15,keep_alive_interval=2,keep_alive_max_attempt=3"


def elastic_launch(directory):
    """Agent A starts (and hosts the rendezvous), agent B joins; B and its worker are killed after step 10.

    --nnodes=1:2: A's worker fails, A restarts it, the new rendezvous closes with A alone, and the
    job finishes epoch 1 with world size 1 from the newest checkpoint.
    """
    port = free_port()
    flags = [
        "--checkpoint-dir", directory / "checkpoints", "--record-samples", directory / "samples", "--epochs", 1,
        "--step-delay-s", 0.2, "--timeout-s", 30, "--metrics-json", directory / "metrics.json",
    ]  # fmt: skip
    command = agent_command(LAB7, flags, nnodes="1:2", endpoint=f"127.0.0.1:{port}", rdzv_id="lab7_elastic",
                            torchrun_args=["--max-restarts=3", f"--rdzv-conf={RENDEZVOUS_CONF}"])  # fmt: skip
    first, second = Agent(command, env=RESTART_SAFE_ENV), None
    try:
        assert wait_until(lambda: port_is_open("127.0.0.1", port), 120), "agent A never hosted the rendezvous"
        second = Agent(command, env=RESTART_SAFE_ENV)
        reached = wait_until(lambda: (directory / "checkpoints" / "checkpoint_step00000010.pt").exists(), 300)
        second.lose_node()
        assert reached, f"no checkpoint at step 10\n{first.output()}\n{second.output()}"
        result = first.wait(timeout_s=400)  # kills A and its worker if they run past it
    finally:
        for agent in (first, second):
            if agent is not None and agent.process.poll() is None:
                agent.lose_node()
    return result


@pytest.fixture(scope="module")
def elastic_run(launches):
    result = launches["elastic"].result()
    assert result.ok, result.describe()
    return result, launches["elastic_dir"]


@pytest.mark.timeout(1200)
def test_elastic_job_finishes_alone_with_world_size_1(elastic_run):
    result, directory = elastic_run
    metrics = json.loads((directory / "metrics.json").read_text())
    resumed = metrics["resumed_from_step"]  # 10, unless a loaded machine let the job reach step 20 before B died
    assert metrics["world_size"] == 1 and metrics["attempt"] >= 1 and resumed in (10, 20)
    line = rf"attempt \d: resumed from .*checkpoint_step{resumed:08d}\.pt \(epoch 0, {resumed * 64} samples of it done"
    assert re.search(line, result.stdout), result.describe()


@pytest.mark.timeout(1200)
def test_elastic_job_trains_every_sample_of_the_interrupted_epoch_once(elastic_run):
    _, directory = elastic_run
    resumed = json.loads((directory / "metrics.json").read_text())["resumed_from_step"]
    steps = effective_steps(directory / "samples")
    world_sizes = {step: len(records) for step, records in steps.items()}
    assert {world_sizes[step] for step in range(1, resumed + 1)} == {2}  # before the loss: 2 ranks
    assert {world_sizes[step] for step in range(resumed + 1, max(steps) + 1)} == {1}  # after it: 1
    trained = [i for records in steps.values() for record in records for i in record["ids"]]
    assert all(record["epoch"] == 0 for records in steps.values() for record in records)
    assert sorted(trained) == list(range(1438))  # no sample skipped, none repeated
    # e.g. 10 steps x 32 x 2 ranks = 640 samples, then ceil((1438 - 640) / 32) = 25 steps on one rank
    assert max(steps) == resumed + -(-(1438 - resumed * 64) // 32)


def test_the_sample_check_sees_a_skip_and_a_repeat(tmp_path):
    """effective_steps() with a made-up history whose resume skipped one sample and repeated another."""
    (tmp_path / "samples_attempt0_rank0.jsonl").write_text('{"step": 1, "epoch": 0, "ids": [0, 1]}\n')
    (tmp_path / "samples_attempt1_rank0.jsonl").write_text('{"step": 2, "epoch": 0, "ids": [1, 3]}\n')
    trained = [i for records in effective_steps(tmp_path).values() for record in records for i in record["ids"]]
    assert sorted(trained) != list(range(4))


# --- restarts need a fresh store per attempt; bad input ----------------------------------------------


def test_a_shared_agent_store_is_refused_with_or_without_restarts(monkeypatch):
    """--max-restarts=0 is no excuse: an elastic job (--nnodes=MIN:MAX) restarts its workers when a node
    joins, and the agent does not tell the workers its --nnodes (finding 22 of the 2026-11-24 review)."""
    lab7 = import_script(LAB7)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun sets without RESTART_SAFE_ENV
    for max_restarts in ("1", "0"):
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", max_restarts)
        with pytest.raises(lab7.CourseError, match="need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"):
            lab7.check_restarts_are_safe()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what it sets with it
    lab7.check_restarts_are_safe()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # python labs/lab7_fault_tolerance.py: no torchrun
    lab7.check_restarts_are_safe()


def launch_without_the_variable(directory):
    return run_torchrun(LAB7, ["--checkpoint-dir", directory / "c", "--max-steps", 2], nproc=2, timeout_s=300)


@pytest.mark.timeout(1200)
def test_torchrun_without_the_variable_is_refused_with_one_line(launches):
    result = launches["no variable"].result()
    assert not result.ok and not result.timed_out, result.describe()
    errors = [line for line in result.stderr.splitlines() if line.startswith("lab7_fault_tolerance.py: error:")]
    assert errors == [
        "lab7_fault_tolerance.py: error: torchrun's restarts (--max-restarts, --nnodes=MIN:MAX) need "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment: put it before torchrun"
    ], result.describe()
    # A CourseError ends each worker through main()'s one line: torchrun adds its own ChildFailedError
    # traceback, but no worker may print one (the crash-rank test below runs the same path in-process).
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    assert 'lab7_fault_tolerance.py", line' not in result.stderr, result.describe()
    assert not (launches["no_variable_dir"] / "c").exists()


BAD_FLAGS = [
    ([], r"the following arguments are required: --checkpoint-dir"),
    (["--checkpoint-dir", "c", "--checkpoint-every", "0"], r"--checkpoint-every: must be a positive integer"),
    (["--checkpoint-dir", "c", "--crash-at-step", "0"], r"--crash-at-step: must be a positive integer"),
    (["--checkpoint-dir", "c", "--crash-rank", "-1"], r"--crash-rank: must be 0 or more"),
    (["--checkpoint-dir", "c", "--step-delay-s", "-1"], r"--step-delay-s: must be 0 or more"),
    (["--checkpoint-dir", "c", "--batch-size", "many"], r"--batch-size: must be an integer"),
    (["--checkpoint-dir", "c", "--dropout", "1"], r"--dropout: must be at least 0 and below 1, got 1.0"),
    (["--checkpoint-dir", "c", "--dropout", "0.1", "--dataset", "cifar10"], r"--dropout: only the digits model"),
]


@pytest.mark.parametrize(("args", "expected"), BAD_FLAGS)
def test_bad_flags_are_refused_with_one_line(args, expected, refused_flag_line):
    assert re.search(expected, refused_flag_line(import_script(LAB7), args))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_crash_rank_outside_the_job_fails_with_one_line(rank, tmp_path, monkeypatch, capsys):
    """Every rank of a 2-rank job refuses --crash-rank 2 before training, through main()'s one-line exit
    (rank 0 speaks for the job): here, main() with the context setup_distributed() gives that rank under
    torchrun, so no process group and no second process are needed."""
    lab7 = import_script(LAB7)
    context = DistContext(rank=rank, local_rank=rank, world_size=2, backend="gloo", device=torch.device("cpu"))
    monkeypatch.setattr(lab7, "setup_distributed", lambda backend, timeout_s: context)
    monkeypatch.setattr(sys, "argv", [str(LAB7)])  # log_error names the script from argv[0]
    monkeypatch.setenv("RANK", str(rank))  # log_error speaks on rank 0 only
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # as under torchrun with RESTART_SAFE_ENV
    args = lab7.parse_args(["--checkpoint-dir", str(tmp_path / "c"), "--crash-at-step", "3", "--crash-rank", "2"])
    assert lab7.main(args) == 1  # an exception escaping main() would fail the test: a traceback for a user mistake
    expected = ["lab7_fault_tolerance.py: error: --crash-rank 2 does not exist in a job of 2 ranks"] if rank == 0 else []
    assert capsys.readouterr().err.splitlines() == expected
    assert not (tmp_path / "c").exists()  # refused before any checkpoint


# --- the sheet's self-check (labs/lab7_fault_tolerance.ipynb, section 8): the steps a restart recomputes -----


def steps_recomputed(checkpoint_every, crash_after, max_steps):
    """Replay the lab's loop in step order: a checkpoint when the step is a multiple of the interval (or the
    last), then the crash on attempt 0; the restart resumes from the newest checkpoint."""
    newest = 0
    for step in range(1, max_steps + 1):
        if step % checkpoint_every == 0 or step == max_steps:
            newest = step
        if step == crash_after:
            return step - newest
    return 0


def test_the_self_check_predicts_the_steps_a_restart_recomputes():
    from ddp_course.lab_self_checks import LAB7_SELF_CHECK
    from ddp_course.self_check import verdict

    notebook = REPO_ROOT / "labs" / "lab7_fault_tolerance.ipynb"
    setup, _ = stored_cell(notebook, "jobs = {")
    max_steps, every, crash_after = (int(re.search(rf'"--{name}", (\d+)', setup).group(1))
                                     for name in ("max-steps", "checkpoint-every", "crash-at-step"))  # fmt: skip
    # The replay reproduces the sheet's stored crash run (every 5, crash after 8: 3 steps).
    _, crash_output = stored_cell(notebook, 'jobs["crash"].result()')
    recorded = re.findall(r"world_size=2, attempt 1 \| (\d+) steps recomputed in all", crash_output)
    assert recorded == [str(steps_recomputed(every, crash_after, max_steps))], crash_output
    # The question's run: a checkpoint every 4, the crash after step 10, 12 steps.
    expected = steps_recomputed(4, 10, max_steps)
    assert LAB7_SELF_CHECK.expected == expected
    assert verdict(LAB7_SELF_CHECK, expected).startswith("self-check: correct - ")
    # The stored run's count copied; the interval; back to step 4 (or to the old interval's step 5).
    for mistake in (3, 4, 6, 5):
        assert verdict(LAB7_SELF_CHECK, mistake) == f"self-check: not yet - {LAB7_SELF_CHECK.hint}"
