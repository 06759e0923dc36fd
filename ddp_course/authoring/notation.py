"""One notation for the whole course: every symbol a notebook's maths uses is defined in the README.

    python -m ddp_course.authoring.notation        # each symbol the notebooks use, where, and whether the README defines it

The README's "Notation" section holds the course's tables of symbols (a symbol is the first cell of a
row, in `$...$`). This module reads the LaTeX in every notebook's markdown cells (`$...$` and
`$$...$$`, not code) and names its symbols: single letters (`N`, `S`, `k`) and Greek letters
(`\\alpha`, `\\beta`), each with its subscript when the subscript is a name in `\\text{...}` (`f_\\text{b}`
and `f_\\text{s}` are two symbols; `c_N` is the symbol `c` at index $N$; `T_\\text{comm}` and
`T_\\text{comp}` are the symbol `T` with a label, see LABELLED). Words
inside `\\text{...}` are labels, not symbols. tests/test_notation.py fails on a symbol the README
does not define. What it cannot check - that no symbol means two things - the README's table makes
visible by giving each symbol one row.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ddp_course.launch import REPO_ROOT

# LaTeX commands that are operators, functions, spacing or layout, never a symbol of ours.
NOT_SYMBOLS = {
    "frac", "tfrac", "dfrac", "times", "cdot", "le", "leq", "ge", "geq", "approx", "max", "min", "log", "ln", "exp",
    "sqrt", "sum", "prod", "lceil", "rceil", "lfloor", "rfloor", "left", "right", "bigl", "bigr", "Bigl", "Bigr",
    "qquad", "quad", "dots", "ldots", "cdots", "bmod", "pmod", "mod", "to", "in", "ll", "gg", "Longrightarrow",
    "Rightarrow", "leftarrow", "rightarrow", "underbrace", "overbrace", "hat", "bar", "tilde", "top", "lVert", "rVert",
    "mid", "div", "pm", "infty", "cap", "cup", "neq", "ne", "equiv", "sin", "cos", "text", "mathrm", "textrm",
    "texttt", "operatorname", "mathbf", "boldsymbol", "big", "Big", "nabla", "partial", "langle", "rangle", "not",
    "emptyset", "setminus", "subseteq", "mathcal", "displaystyle", "limits", "propto", "sim", "circ", "colon", "mathbb",
    "Sigma", "pi",  # a sum of durations, the number pi: operators and constants here
}  # fmt: skip
# Symbols whose subscripts are labels of one quantity, not new symbols: T_\text{comm} is a time, t_\text{data} too.
LABELLED = {"T", "t", "E"}
MATH = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$", flags=re.DOTALL)
CODE = re.compile(r"```.*?```|`[^`\n]*`", flags=re.DOTALL)
TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textrm|texttt|operatorname|mathbb)\s*\{[^{}]*\}")
TOKEN = re.compile(r"\\([A-Za-z]+)|([A-Za-z])")


def math_spans(markdown: str) -> list[str]:
    """The LaTeX of every `$...$` / `$$...$$` in a markdown text, code spans and fences skipped."""
    text = CODE.sub(" ", markdown)
    text = text.replace(r"\$", "")  # an escaped dollar is a price, not maths
    return [display or inline for display, inline in MATH.findall(text)]


def subscript_after(latex: str, end: int) -> str:
    """The subscript that follows position end, if any: `_x`, `_{...}` or `_\\text{...}` (braces kept)."""
    rest = latex[end:]
    match = re.match(r"\s*_\s*(\\(?:text|mathrm)\s*\{[^{}]*\}|\{[^{}]*\}|\\?[A-Za-z0-9]+)", rest)
    return match.group(1) if match else ""


def symbols_in(latex: str) -> set[str]:
    """The symbols of one formula: a letter or Greek letter, with its subscript (normalised) unless LABELLED."""
    found = set()
    for match in TOKEN.finditer(latex):
        command, letter = match.groups()
        if command is not None and command in NOT_SYMBOLS:
            continue
        if command is None and _inside_text(latex, match.start()):
            continue
        if command is None and _is_subscript(latex, match.start()):
            continue
        base = f"\\{command}" if command else letter
        name = "" if base in LABELLED else subscript_name(subscript_after(latex, match.end()))
        found.add(base + (f"_{name}" if name else ""))
    return found


def subscript_name(subscript: str) -> str:
    """A subscript in `\\text{...}` names a symbol of its own (`f_\\text{b}` is not `f_\\text{s}`); a bare one
    (`c_N`, `w_{t+1}`, `\\gamma_k`) is an index into the same symbol, so it is dropped."""
    named = re.match(r"^\\(?:text|mathrm)\s*\{(.*)\}$", subscript.strip())
    return named.group(1).strip() if named else ""


def _inside_text(latex: str, position: int) -> bool:
    return any(match.start() <= position < match.end() for match in TEXT_COMMAND.finditer(latex))


def _is_subscript(latex: str, position: int) -> bool:
    """True for a letter that is itself (part of) a subscript or superscript: it belongs to the symbol before it."""
    before = latex[:position].rstrip()
    if before.endswith(("_", "^")):
        return True
    depth, index = 0, len(before) - 1
    while index >= 0:  # inside `_{...}` or `^{...}`?
        char = before[index]
        if char == "}":
            depth += 1
        elif char == "{":
            if depth == 0:
                return before[:index].rstrip().endswith(("_", "^"))
            depth -= 1
        index -= 1
    return False


def notebook_symbols(path: Path) -> dict[str, list[int]]:
    """{symbol: [cell indices]} for one notebook's markdown maths."""
    cells = json.loads(path.read_text())["cells"]
    used: dict[str, list[int]] = {}
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        for latex in math_spans("".join(cell["source"])):
            for symbol in symbols_in(latex):
                cells_using = used.setdefault(symbol, [])
                if index not in cells_using:
                    cells_using.append(index)
    return used


def readme_rows(readme: str | None = None) -> list[tuple[str, set[str]]]:
    """[(row's first cell, the symbols it defines)] of the README's Notation tables. A symbol in an
    argument list, as $N$ in $E(N)$, is not defined there: it has a row of its own."""
    readme = readme if readme is not None else (REPO_ROOT / "README.md").read_text()
    section = readme.split("### Notation", 1)[1].split("\n## ", 1)[0]
    rows = []
    for first_cell in re.findall(r"^\|(.+?)\|", section, flags=re.MULTILINE):
        defined = set()
        for latex in math_spans(first_cell):
            defined |= symbols_in(re.sub(r"\([^()]*\)", "", latex))
        rows.append((first_cell.strip(), defined))
    return rows


def readme_symbols(readme: str | None = None) -> set[str]:
    """Every symbol the README's Notation section defines: the symbols of the first cell of each table row."""
    return set().union(*(defined for _, defined in readme_rows(readme)))


def notebooks() -> list[Path]:
    return sorted(path for folder in ("lectures", "labs") for path in (REPO_ROOT / folder).glob("*.ipynb"))


def undefined_symbols() -> dict[str, dict[str, list[int]]]:
    """{symbol: {notebook: [cells]}} for every symbol a notebook uses and the README does not define."""
    defined = readme_symbols()
    missing: dict[str, dict[str, list[int]]] = {}
    for path in notebooks():
        for symbol, cells in notebook_symbols(path).items():
            if symbol not in defined:
                missing.setdefault(symbol, {})[str(path.relative_to(REPO_ROOT))] = cells
    return missing


def main(argv: list[str]) -> int:
    defined = readme_symbols()
    usage: dict[str, dict[str, list[int]]] = {}
    for path in notebooks():
        for symbol, cells in notebook_symbols(path).items():
            usage.setdefault(symbol, {})[path.name] = cells
    for symbol in sorted(usage, key=str.lower):
        where = "; ".join(f"{name} cells {sorted(set(cells))}" for name, cells in sorted(usage[symbol].items()))
        print(f"{'ok  ' if symbol in defined else 'NEW '} {symbol:<16} {where}")
    return 0 if set(usage) <= defined else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
