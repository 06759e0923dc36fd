"""Cluster stand-ins: what lets a 2-core laptop show what a multi-node job does, and how it fails.

    multinode      several torchrun agents on one machine (a c10d rendezvous on 127.0.0.1), losing one
                   as a node is lost, and one line naming why a multi-node launch never started
                   (python -m ddp_course.cluster.multinode OUTPUT_FILES)
    netns          two hosts on one Linux machine: network namespaces with their own address, hostname,
                   /etc/hosts and firewall (root; python -m ddp_course.cluster.netns --cleanup removes
                   what a killed test left)
    slurm_cluster  a real two-node SLURM cluster on those hosts (Debian's Slurm 22.05, munge)
    cluster_runs   lab 3 across the two hosts by hand and with sbatch, the classic failures, and their
                   recorded facts (labs/slurm/recorded_runs.json)

Learners read their results in lab 7's sheet; tests/test_multinode.py runs them for real.
"""
