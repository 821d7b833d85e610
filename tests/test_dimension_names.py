"""One dimension alphabet (docs/architecture.md, "Dimension alphabet"): every shape-suffixed name in the product
folders (`logits_BxQxV`, `mask_B`, `proj_xDr`) spells its axes with the symbols of that table, and every symbol of
the table is used. Names are read with `tokenize` (identifiers only: strings, docstrings and comments are prose).

A shape suffix is what follows a name's last `_`: symbols joined by `x` (a leading `x` for any leading axes), each a
capital with lowercase letters or digits after it (`B`, `Dt`, `Rc`) or a literal size (`1`, `2`), at least one of
them a capital. The name itself starts with a lowercase letter (constants and classes are not arrays), and a suffix
that is one capitalised word of three or more letters is not a shape (`do_GET`, http.server's handler names).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("configs", "models", "serve", "train", "data", "eval", "export", "launch")
STYLE_SYMBOLS = {"B", "S", "K", "N", "D", "Dt", "F", "V", "H", "Hk", "Dh", "P", "T"}  # STYLE.md practice 4

_SYMBOL = r"[A-Z][A-Za-wyz0-9]*|[0-9]+"  # no `x` inside a symbol: `x` joins them
_SHAPED = re.compile(rf"^_*[a-z][A-Za-z0-9_]*?_(x?(?:{_SYMBOL})(?:x(?:{_SYMBOL}))*)$")


def alphabet(page: Path = ROOT / "docs" / "architecture.md") -> dict[str, str]:
    """symbol -> meaning, from the table of the page's "## Dimension alphabet" section (first cell `X`)."""
    text = page.read_text()
    start = text.index("\n## Dimension alphabet\n")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]
    rows = re.findall(r"^\| `([A-Za-z0-9]+)` \| ([^|]+?) \|", section, re.M)
    table: dict[str, str] = {}
    for symbol, meaning in rows:
        assert symbol not in table, f"docs/architecture.md gives symbol {symbol!r} two rows; give each one meaning"
        table[symbol] = meaning
    return table


def shape_symbols(name: str) -> list[str] | None:
    """The axis symbols of `name`'s shape suffix, or None when it has none."""
    m = _SHAPED.match(name)
    if m is None or not re.search("[A-Z]", m.group(1)) or re.fullmatch(r"[A-Z]{3,}", m.group(1)):
        return None
    return m.group(1).removeprefix("x").split("x")


def shaped_names(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, name, symbols) of every shape-suffixed identifier of a Python file."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME and (symbols := shape_symbols(tok.string)) is not None:
            out.append((tok.start[0], tok.string, symbols))
    return out


def violations(paths: list[Path], table: dict[str, str], root: Path = ROOT) -> list[str]:
    """`file:line name (symbol)` for every shape-suffixed name with a symbol outside `table` (digits are sizes)."""
    bad = []
    for path in paths:
        for line, name, symbols in shaped_names(path):
            unknown = [s for s in symbols if s not in table and not s.isdigit()]
            if unknown:
                bad.append(f"{path.relative_to(root)}:{line} {name} ({', '.join(unknown)})")
    return bad


def product_files() -> list[Path]:
    return sorted(p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py"))


def test_the_alphabet_keeps_style_letters_and_gives_each_symbol_one_row():
    table = alphabet()
    assert STYLE_SYMBOLS <= set(table), f"STYLE.md's letters missing from the table: {STYLE_SYMBOLS - set(table)}"
    assert len(table) >= len(STYLE_SYMBOLS) + 1
    assert "cache" in table["T"].lower() and "block" in table["K"].lower(), (table["T"], table["K"])


def test_every_shaped_name_in_the_product_folders_uses_the_alphabet():
    files = product_files()
    assert len(files) > 50, "the product folders were not found"
    bad = violations(files, alphabet())
    assert not bad, ("shape-suffixed names with a symbol not in docs/architecture.md's dimension alphabet (rename "
                     "the axis to the table's symbol for its meaning, or add a row with one new meaning):\n  "
                     + "\n  ".join(bad))


def test_every_symbol_of_the_alphabet_is_used():
    used = {s for path in product_files() for _, _, symbols in shaped_names(path) for s in symbols}
    unused = sorted(set(alphabet()) - used)
    assert not unused, f"docs/architecture.md's dimension alphabet lists symbols no name uses: {unused}"


def test_the_checker_catches_an_unknown_symbol_and_passes_the_rest(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "def f(h_BxSxD, mask_B, proj_xDr, rng_Bx2):\n"
        '    """prose like ids_UxK is not a name"""\n'
        "    ids_UxK = h_BxSxD  # a comment: x_QxU\n"
        "    do_GET = pos_00 = throughput_8k = MAX_K = Q4_1 = d_1 = None\n"
        "    return feats_BxSxFD, ids_UxK\n")
    table = {s: "" for s in ("B", "S", "D", "K", "Dr")}
    assert violations([source], table, root=tmp_path) == ["module.py:3 ids_UxK (U)", "module.py:5 feats_BxSxFD (FD)",
                                                          "module.py:5 ids_UxK (U)"]
    assert violations([source], {**table, "U": "", "FD": ""}, root=tmp_path) == []
    assert shape_symbols("logits_at_BxQo") == ["B", "Qo"] and shape_symbols("proj_xDr") == ["Dr"]
    assert shape_symbols("max") is None and shape_symbols("_Replica") is None and shape_symbols("do_PATCH") is None
