"""Helpers shared by the course's labs, lecture notebooks and tests.

Only the boring parts live here; each lab keeps inline the DDP lines it teaches.

    distributed  setup_distributed() / teardown_distributed(), DistContext, rank-aware log()
    cli          argument types that fail with one clear line, CourseError and its reporting
    seeding      seed_everything() and the RNG states a checkpoint must carry
    data         the offline digits dataset and CIFAR-10 (prepared collectively: one download per job)
    models       DigitsCNN and the CIFAR-10 resnet18
    compare      max_relative_difference() between two state_dicts
    checkpoint   atomic, rank-0 checkpoints that load with weights_only=True
    launch       run a script under torchrun in a subprocess, with a timeout, GPUs hidden unless asked;
                 import a script as a module to test its functions
    amp          which 16-bit type autocast uses on this GPU (bf16 native, else fp16 + GradScaler)
    reporting    text tables and scaling plots for the measurement labs
    notebooks    re-execute notebooks in place with stored outputs (python -m ddp_course.notebooks);
                 read and run a notebook's code cells from a test
    portability  re-run every notebook under other CPU numerics (python -m ddp_course.portability)
"""
