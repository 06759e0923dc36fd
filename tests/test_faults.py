"""ddp_course.faults: the errors torch 2.14's gloo raises, cut to one deterministic line each.

The messages below were recorded from real 2-rank gloo runs on this machine (lab 7's hang scenarios);
tests/test_lab7_hangs.py checks the same lines end to end.
"""

import pytest

from ddp_course.faults import Diagnosis, diagnose, first_line

SHAPES_RANK0 = (
    "Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0, "
    "OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), "
    "device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))), but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, "
    "TensorShape=[3], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided "
    "(default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))).Collectives differ "
    "in the following aspects:   Tensor Tensor shapes: 4vs 3"
)
BARRIER_RANK1 = (
    "Detected mismatch between collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0"
    "OpType=BARRIER), but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0OpType=GATHER).Collectives "
    "differ in the following aspects:   Op type: BARRIERvs GATHER"
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("message", "rank", "expected"),
    [
        (SHAPES_RANK0, 0, Diagnosis("mismatch", "Detected mismatch between collectives (this rank ran ALLREDUCE [4]; they differ in tensor shapes)")),
        (BARRIER_RANK1, 1, Diagnosis("mismatch", "Detected mismatch between collectives (this rank ran BARRIER; they differ in op type)")),
        (SHAPES_RANK0, None, Diagnosis("mismatch", "Detected mismatch between collectives (they differ in tensor shapes)")),
        (
            "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 3000 ms",
            0,
            Diagnosis("missing rank", "rank(s) 1 did not reach monitored_barrier within 3000 ms"),
        ),
        (
            "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 500 ms",
            0,
            Diagnosis("missing rank", "rank(s) 1, 3 did not reach monitored_barrier within 500 ms"),
        ),
        (
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete",
            1,
            Diagnosis("timeout", "no peer answered within 3000 ms (the process group's timeout)"),
        ),
        (
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
            "[127.0.0.1]:44457. This is typically caused by a remote worker crashing.",
            0,
            Diagnosis("peer gone", "the peer closed its connection (it gave up first, crashed or exited)"),
        ),
        ("[/some/file.cc:12] Something else broke\nsecond line", 0, Diagnosis("error", "Something else broke")),
        # init_process_group(env://), recorded here (timeouts 3 s and 2 s): rank 0 told WORLD_SIZE=3 and rank 1 told 2;
        # rank 1 alone, nothing on MASTER_PORT
        (
            "Timed out after 4 seconds waiting for clients. 2/3 clients joined.",
            0,
            Diagnosis("rendezvous", "only 2 of the 3 processes this rank expects (WORLD_SIZE) reached the store"),
        ),
        ("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/0", 1, Diagnosis("rendezvous", "rank 0's address never appeared in the store within 3000 ms")),
        (
            "The client socket has timed out after 2000ms while trying to connect to (127.0.0.1, 34949).",
            1,
            Diagnosis("unreachable", "no store answered at MASTER_ADDR:MASTER_PORT within 2000 ms"),
        ),
    ],
)
def test_diagnose_names_the_kind_without_ports_paths_or_timings(message, rank, expected):
    assert diagnose(RuntimeError(message), rank) == expected


@pytest.mark.timeout(30)
def test_first_line_drops_the_source_prefix_and_str_joins_kind_and_summary():
    assert first_line("[a/b.cc:3] boom\nmore") == "boom"
    assert first_line("") == ""
    assert str(Diagnosis("timeout", "x")) == "timeout: x"
