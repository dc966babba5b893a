"""decode/ imports one way: every module imports only modules of lower layers (function-local imports
counted), so the package reads bottom up and no import cycle can form. The layers are those of
eaglekit/decode/__init__.py's docstring; a new module must be given one here."""
import ast
from pathlib import Path

import eaglekit.decode

DECODE = Path(eaglekit.decode.__file__).parent
LAYERS = [  # lowest first
    {"stats", "stops"},
    {"drafters"},
    {"loop"},
    {"draft_model", "mtp_walk"},
    {"lookup"},
    {"cost"},
    {"api"},
    {"cli"},
]


def decode_imports(path: Path) -> set[str]:
    """The eaglekit.decode modules ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "eaglekit.decode":
            found |= {a.name for a in node.names if (DECODE / f"{a.name}.py").exists()}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eaglekit.decode."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("eaglekit.decode.")}
    return found


def layer_of(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def test_decode_modules_import_only_lower_layers():
    modules = {p.stem for p in DECODE.glob("*.py")} - {"__init__"}
    assert modules == set().union(*LAYERS), "give every decode module a layer (and drop removed ones)"
    upward = [(m, dep) for m in sorted(modules) for dep in sorted(decode_imports(DECODE / f"{m}.py"))
              if layer_of(dep) >= layer_of(m)]
    assert upward == [], f"imports into the same or a higher layer: {upward}"


def test_decode_layer_check_sees_function_local_imports(tmp_path):
    """The check can fail: an import inside a function is found like one at the top of the file."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from eaglekit.decode.api import make_drafter\n"
                     "    from eaglekit.decode import stops\n")
    assert decode_imports(probe) == {"api", "stops"}
