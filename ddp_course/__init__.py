"""Helpers shared by the course's labs, lecture notebooks and tests.

Only the boring parts live here; each lab keeps inline the DDP lines it teaches.

    distributed  setup_distributed() / teardown_distributed(), DistContext, rank-aware log(),
                 training_group() (a short timeout for training only, after a slow start)
    cli          argument types that fail with one clear line, CourseError and its reporting
    seeding      seed_everything() and the RNG states a checkpoint must carry
    data         the offline digits dataset, CIFAR-10 (prepared collectively: one download per job) and
                 the standard library's source as character-level text (lab 6)
    models       DigitsCNN, the CIFAR-10 resnet18 and CharTransformer (lab 6's decoder-only transformer)
    compare      max_relative_difference() between two state_dicts
    char_lm_job  the job labs 6, 8 and 9 share: the character-level transformer, its global batch and
                 each rank's rows, job-wide maxima, eps-derived tolerances, deadlines and step timing
    sharded_training  the harness labs 8 and 9 share: DDP, ZeRO-1, ZeRO-2, an FSDP, fully_shard built,
                 stepped, checked against one process and weighed alike; lab 9's memory timeline and verdict
    fsdp_practice  what lab 9's six demos share (their batches, fully_shard on the transformer, a checkpoint
                 folder every rank agrees on, the one-process reference) and each demo's verdict line
    checkpoint   atomic, rank-0 checkpoints that load with weights_only=True
    training     what lab 3 and lab 7 share: training-state save/restore (model, optimizer, position in
                 the epoch, every rank's RNG state), job-wide evaluation, rank 0's buffers, CPU weights
    resume       ResumableDistributedSampler: start an epoch at a count of samples consumed, on any
                 world size; RESTART_SAFE_ENV for torchrun restarts
    faults       name a torch.distributed error's kind in one deterministic line (mismatch, missing
                 rank, timeout, peer gone)
    profiling    profile DDP steps per rank (chrome traces for Perfetto), read the backward span and
                 all-reduce events, an overlap summary from start/end times, a timeline plot
    launch       run a script under torchrun in a subprocess, with a timeout, GPUs hidden unless asked;
                 import a script as a module to test its functions; free ports outside the ephemeral range
    amp          which 16-bit type autocast uses on this GPU (bf16 native, else fp16 + GradScaler)
    reporting    text tables and scaling plots for the measurement labs
    self_check   a core notebook's closing question, answered in the notebook, with one line of feedback

Then what the other audiences use (the learner's runtime is above):

    lectureNN_checks, calculators, virtual_ranks, memory_peaks, sharding, timeline, links, lab_sheets
                 what the lecture notebooks and lab sheets call: their self-checks, calculators and the
                 demos behind one-line calls; lab_sheets starts a sheet's jobs and prints their command
                 lines (kept at the top: every notebook links them by these paths); lecture04_models is
                 lecture 4's model and DDP instruments, shared by its demo script, checks and figure
    grade        python -m ddp_course.grade: every exercise of the learner, one table (the learner's command)
    checking/    what judges a learner's work by running it: the lab 3, 4, 6, 8 and 10 checkers, the
                 observer labs 3 and 4 launch, one Verdict type, the one list of collectives the tools wrap, and
                 the tests' many-runs-in-one-launch runner
    cluster/     stand-ins for a cluster on one machine: several torchrun agents as nodes, network
                 namespaces as hosts, a real two-node SLURM cluster, lab 3 run across them
    authoring/   the maintainers' tools: store and re-check notebooks, generate exercises, the time
                 budget, the notation, the website
    diagrams/    every figure in assets/, drawn from a description (python -m ddp_course.diagrams)
"""
