"""One notation (issue 31): every symbol a notebook's maths uses is defined in the README's Notation
tables, once. ddp_course.authoring.notation reads the LaTeX of every lecture's and lab sheet's markdown."""

import json

import pytest

from ddp_course.authoring import notation


@pytest.mark.timeout(60)
def test_every_symbol_the_notebooks_use_is_in_the_readmes_table():
    missing = notation.undefined_symbols()
    assert not missing, "symbols the README's Notation tables do not define:\n" + "\n".join(
        f"  {symbol}: {where}" for symbol, where in sorted(missing.items()))  # fmt: skip


def test_no_symbol_has_two_rows():
    """A symbol defined twice would mean two things: each has one row, so one meaning."""
    seen = {}
    for row, symbols in notation.readme_rows():
        for symbol in symbols:
            assert symbol not in seen, f"{symbol} has two rows: {seen[symbol]!r} and {row!r}"
            seen[symbol] = row
    assert {"N", "S", "\\beta", "u", "\\tau", "\\delta", "k", "K", "E"} <= set(seen)


@pytest.mark.parametrize(
    "latex, symbols",
    [
        (r"T = \alpha + S/\beta", {"T", "\\alpha", "S", "\\beta"}),
        (r"f_\text{b} \approx 2/3,\ f_\text{s}", {"f_b", "f_s"}),  # a named subscript: two symbols
        (r"c_N = 1 - t_\text{no\_sync}/T_\text{DDP}", {"c", "t", "T"}),  # an index, and labelled times
        (r"\gamma_{N-1}\sum_i |x_i|", {"\\gamma", "x"}),
        (r"\mathrm{speedup}(N) \le 1/f_\text{s}", {"N", "f_s"}),  # words in \mathrm are not symbols
        (r"\mathbb{E}[\text{segment}] = \exp((\tau + C)/M)", {"\\tau", "C", "M"}),
    ],
)
def test_symbols_are_read_as_the_table_names_them(latex, symbols):
    assert notation.symbols_in(latex) == symbols


def test_the_check_can_fail(tmp_path, monkeypatch):
    """A notebook that uses an undefined symbol is reported, with its cell."""
    notebook = tmp_path / "lectures" / "99_new.ipynb"
    notebook.parent.mkdir()
    cells = [{"cell_type": "markdown", "metadata": {}, "source": ["A step takes $T = \\zeta N$, a new $\\zeta$."]},
             {"cell_type": "markdown", "metadata": {}, "source": ["`$\\xi$` is code, not maths."]}]  # fmt: skip
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    monkeypatch.setattr(notation, "notebooks", lambda: [notebook])
    monkeypatch.setattr(notation, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(notation, "readme_symbols", lambda readme=None: {"T", "N"})
    assert notation.undefined_symbols() == {"\\zeta": {"lectures/99_new.ipynb": [0]}}
