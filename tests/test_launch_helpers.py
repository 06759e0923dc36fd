"""Reading what a job printed (ddp_course.launch): lines per rank, the ranks' exceptions, DETAIL's reports,
and a probe line copied into a script. In this process, on the text torch and the labs print. Also how
import_script loads a script that imports a file beside it.
(The sheets' background jobs are ddp_course.launch.SheetJobs: tests/test_sheet_jobs.py.)
"""

import ast
import sys

import pytest

from ddp_course.launch import REPO_ROOT, copy_with_line_after, detail_mismatches, import_script, lines_by_rank, rank_errors


def test_a_script_imports_a_file_beside_it_as_when_python_runs_it(tmp_path):
    """Labs 8 and 9 `import minizero2`, the file beside them: under torchrun their folder is first on
    sys.path; import_script puts it there while the script's imports run, and takes it away after."""
    (tmp_path / "beside_the_script.py").write_text("VALUE = 7\n")
    (tmp_path / "the_script.py").write_text("import beside_the_script\n\nFOUND = beside_the_script.VALUE\n")
    try:
        assert import_script(tmp_path / "the_script.py", "the_script").FOUND == 7
        assert str(tmp_path) not in sys.path
    finally:
        for name in ("the_script", "beside_the_script"):
            sys.modules.pop(name, None)


def test_the_package_imports_no_script_but_the_learners_chosen_module():
    """The installed package must not load files outside itself (it works only while the install is
    editable, and no import graph shows the edge): the one exception is --module, the learner's own
    labs/ or solutions/ file that labs 6, 8 and 9 load by path (char_lm_job.load_learner_module)."""
    calls = []
    for path in sorted((REPO_ROOT / "ddp_course").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_script":
                calls.append(path.relative_to(REPO_ROOT).as_posix())
    assert calls == ["ddp_course/char_lm_job.py"], "the package loads a script by path: make it an import"
    assert "import_script(" in (REPO_ROOT / "ddp_course" / "char_lm_job.py").read_text().split("def load_learner_module")[1]


def test_lines_by_rank_groups_and_sorts_ranks():
    text = "config: ...\n[rank 1] b1\n[rank 0] a1\n[rank 10] k\n[rank 1] b2\nnot [rank 3] this\n"
    assert lines_by_rank(text) == {0: ["a1"], 1: ["b1", "b2"], 10: ["k"]}


def test_rank_errors_are_distinct_sorted_and_without_glooss_source_prefix():
    stderr = (
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms\n"
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert rank_errors(stderr) == ["RuntimeError: Connection closed by peer", "RuntimeError: Timed out waiting 3000ms"]


def test_detail_mismatches_reads_each_ranks_own_collective():
    # The shape of TORCH_DISTRIBUTED_DEBUG=DETAIL's reports (torch 2.14), one line per rank.
    report = (
        "[rank 1] Detected mismatch between collectives on ranks. Rank 1 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=BARRIER), but Rank 0 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[1]).\n"
        "[rank 0] Detected mismatch between collectives on ranks. Rank 0 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2OpType=ALLREDUCE, TensorShape=[2]), but Rank 1 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=GATHER).\n"
    )
    assert detail_mismatches(report) == {0: (2, "ALLREDUCE"), 1: (2, "BARRIER")}
    assert detail_mismatches("no mismatch here") == {}


def test_copy_with_line_after_inserts_once_and_refuses_a_missing_or_repeated_anchor(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("a = 1\n    x = load()\nprint(a)\n")
    probe_folder = tmp_path / "probe"
    probe_folder.mkdir()
    copy = copy_with_line_after(script, "    x = load()\n", "    log(x)", probe_folder)
    assert copy.name == "job.py" and copy.read_text() == "a = 1\n    x = load()\n    log(x)\nprint(a)\n"
    assert script.read_text() == "a = 1\n    x = load()\nprint(a)\n"  # the original is untouched
    with pytest.raises(ValueError, match="occurs 0 times"):
        copy_with_line_after(script, "y = 2", "z", tmp_path)
    script.write_text("x\nx\n")
    with pytest.raises(ValueError, match="occurs 2 times"):
        copy_with_line_after(script, "x", "z", tmp_path)
