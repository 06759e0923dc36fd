"""Lecture 06: the demo script and the NCCL names it cites hold.

nbval re-runs the lecture and compares its printed summaries. This module checks what nbval cannot
(tests/test_exercises_in_step.py keeps its exercises in step with their solutions): faults_demos.py, launched once, shows every fact the
lecture reads from it (and the flight-recorder dumps, including that torchfrtrace cannot read gloo's
dumps in torch 2.14, which the lecture says); and the environment variables the lecture names for
NCCL exist in the installed torch.
"""

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from ddp_course.launch import REPO_ROOT, run_torchrun

LECTURE = REPO_ROOT / "lectures" / "06_debugging_fault_tolerance.ipynb"
FAULTS_DEMOS = REPO_ROOT / "lectures" / "scripts" / "faults_demos.py"


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults_demos")
    result = run_torchrun(FAULTS_DEMOS, ["--json", folder / "r.json", "--trace-dir", folder / "traces", "--crash-at-exit"],
                          nproc=2, timeout_s=240)
    report = json.loads((folder / "r.json").read_text()) if (folder / "r.json").exists() else None
    return result, report, folder / "traces"


@pytest.mark.timeout(300)
def test_faults_demos_show_silent_errors_a_raise_on_every_rank_and_a_flight_recorder_dump(demos):
    result, report, _ = demos
    assert report is not None, result.describe()
    for rank_facts in report["per_rank"]:
        # Same-shaped collectives in another order: DETAIL raises nothing, every result is wrong.
        assert rank_facts["order_swap"] == {"error": None, "results_right": False}
        assert rank_facts["replicas_identical"] == {"load_after_wrap_on_rank0": False, "load_before_wrap_everywhere": True}
        assert rank_facts["unused_parameter"] == {
            "raised_at_iteration": 1, "unused_named": "head.bias, head.weight",
            "first_sentence": "Expected to have finished reduction in the prior iteration before starting a new one."}
        assert rank_facts["flight_recorder"]["kind"] in ("timeout", "peer gone")
        assert rank_facts["flight_recorder"]["entries"] == 2


@pytest.mark.timeout(300)
def test_the_flight_recorder_dumps_show_the_first_disagreement_and_torchfrtrace_cannot_read_them(demos):
    result, _, traces = demos
    assert (traces / "fr_0").exists() and (traces / "fr_1").exists(), result.describe()
    ops = {}
    for rank in (0, 1):
        dump = pickle.loads((traces / f"fr_{rank}").read_bytes())
        ops[rank] = [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"])
                     for e in dump["entries"] if e["process_group"][1] == "hang_demo"]
    assert ops[0] == [(1, "gloo:all_reduce", [[4]]), (2, "gloo:all_reduce", [[4]])]
    assert ops[1] == [(1, "gloo:all_reduce", [[4]]), (2, "gloo:barrier", [])]
    # The lecture says torchfrtrace stops on these gloo dumps in torch 2.14; if a new torch reads
    # them, this fails and the lecture's sentence (section 2) must change.
    from torch.distributed.flight_recorder.fr_trace import main as torchfrtrace

    with pytest.raises(KeyError):
        torchfrtrace([str(traces), "-p", "fr_"])


@pytest.mark.timeout(300)
def test_the_crash_at_exit_is_the_root_cause_of_torchruns_report_with_the_exception(demos):
    result, _, _ = demos
    assert not result.timed_out and result.returncode != 0, result.describe()
    root_cause = result.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause), result.describe()
    assert re.search(r"exitcode\s*: 1 ", root_cause) and "error.json" in root_cause, result.describe()
    assert "RuntimeError: CUDA out of memory (simulated by faults_demos.py --crash-at-exit)" in root_cause


LECTURE_NCCL_NAMES = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)


@pytest.mark.timeout(120)
def test_the_nccl_variables_the_lecture_names_exist_in_this_torch():
    text = "".join("".join(cell["source"]) for cell in json.loads(LECTURE.read_text())["cells"])
    assert all(name in text for name in LECTURE_NCCL_NAMES)
    libraries = [Path(torch.__file__).parent / "lib" / name for name in ("libtorch_cuda.so", "libtorch_cpu.so")]
    blob = b"".join(path.read_bytes() for path in libraries if path.exists())
    if b"ProcessGroupNCCL" not in blob:
        pytest.skip("this torch build has no NCCL (CPU-only wheel): nothing to check the names against")
    missing = [name for name in LECTURE_NCCL_NAMES if name.encode() not in blob]
    assert not missing, missing
    # torchrun gives its workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless set (the lecture says so)
    agent = Path(torch.__file__).parent / "distributed" / "elastic" / "agent" / "server" / "local_elastic_agent.py"
    assert re.search(r'"TORCH_NCCL_ASYNC_ERROR_HANDLING": os\.getenv\(\s*"TORCH_NCCL_ASYNC_ERROR_HANDLING", str\(1\)', agent.read_text())
