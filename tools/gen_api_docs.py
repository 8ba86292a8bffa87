#!/usr/bin/env python3
"""Write docs/api.md from the docstrings of xent's public Python modules.

Reads the sources with `ast` (nothing is imported, nothing needs building), so it runs on any
machine. A name is public if the module's __all__ lists it or, without __all__, if it does not
start with an underscore.

Run: python3 tools/gen_api_docs.py [OUTPUT]   (default docs/api.md)
"""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ["functional", "nn", "hf", "distributed"]


def module_all(tree):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def signature(node):
    # Unparse the arguments and return annotation as written, type hints included.
    args = ast.unparse(node.args)
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"({args}){ret}"


def doc_block(node):
    doc = ast.get_docstring(node)
    return doc.strip() if doc else "*(no docstring)*"


def render_function(name, node, level):
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return [
        f"{'#' * level} `{name}`",
        "",
        "```python",
        f"{prefix} {name}{signature(node)}",
        "```",
        "",
        doc_block(node),
        "",
    ]


def render_class(node, level):
    bases = ", ".join(ast.unparse(b) for b in node.bases)
    out = [
        f"{'#' * level} `{node.name}`",
        "",
        "```python",
        f"class {node.name}({bases})" if bases else f"class {node.name}",
        "```",
        "",
        doc_block(node),
        "",
    ]
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            not item.name.startswith("_") or item.name == "__init__"
        ):
            out += render_function(f"{node.name}.{item.name}", item, level + 1)
    return out


def render_imported(module, name, shown):
    path = os.path.join(ROOT, "python", *module.split(".")) + ".py"
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if getattr(node, "name", None) == name:
            if isinstance(node, ast.ClassDef):
                return render_class(node, 3)
            return render_function(shown, node, 3)
    return []


def render_module(name):
    path = os.path.join(ROOT, "python", "xent", f"{name}.py")
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    public = module_all(tree)
    out = [f"## `xent.{name}`", ""]
    mdoc = ast.get_docstring(tree)
    if mdoc:
        out += [mdoc.strip(), ""]
    for node in tree.body:
        # A public name imported from another module of the package is documented here too.
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("xent.")
            and public is not None
        ):
            for alias in node.names:
                if (alias.asname or alias.name) in public:
                    out += render_imported(node.module, alias.name, alias.asname or alias.name)
            continue
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if (node.name not in public) if public is not None else node.name.startswith("_"):
            continue
        if isinstance(node, ast.ClassDef):
            out += render_class(node, 3)
        else:
            out += render_function(node.name, node, 3)
    return out


def main():
    output = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "api.md")
    lines = [
        "# Python API reference",
        "",
        "Generated from the docstrings by `tools/gen_api_docs.py`; do not edit by hand.",
        "",
    ]
    for name in MODULES:
        lines += render_module(name)
    with open(output, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
    main()
