#!/usr/bin/env python3
"""Checks the include graph against the layer list of docs/architecture.md ("Layers").

Every quoted include in a layer's folder (common/, transport/, cuda/, collectives/,
scheduler/) and in the public headers (include/dear/) must name a header of the same layer
or of a layer below it in the doc's list; an include of a layer above, or of a folder that is
no layer (tests/, bench/, tools/), fails the check with the file, the line and both layers.
Includes relative to the including file's folder stay in its layer. System includes (<...>)
are not checked.

  scripts/check-layers.py [--root DIR]    # exit 0: the graph agrees; 1: it does not
  scripts/check-layers.py --self-test     # the checker catches an upward include
"""
import argparse
import pathlib
import re
import sys
import tempfile

SOURCES = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def read_layers(doc):
    """The layers, lowest first, and the public-header prefixes each owns."""
    text = doc.read_text()
    start = text.find("## Layers")
    if start < 0:
        raise SystemExit(f"{doc}: no '## Layers' section")
    block = re.search(r"```\n(.*?)```", text[start:], re.S)
    if not block:
        raise SystemExit(f"{doc}: the Layers section has no fenced layer list")
    layers = []  # top first, as the doc lists them
    api = {}
    for line in block.group(1).splitlines():
        m = re.match(r"^([a-z_]+)/\s", line)
        if m:
            layers.append(m.group(1))
            continue
        m = re.match(r"^\s+api:\s*(.*)$", line)
        if m and layers:
            for prefix in m.group(1).split():
                api[prefix] = layers[-1]
    if not layers:
        raise SystemExit(f"{doc}: the layer list is empty")
    layers.reverse()
    return layers, api


def layer_of_include(name, layers, api):
    """The layer a quoted include names, or None when it names no layer."""
    if name.startswith("dear/"):
        owner = None
        for prefix, layer in api.items():
            if name == prefix or (prefix.endswith("/") and name.startswith(prefix)):
                if owner is None or len(prefix) > len(owner[0]):
                    owner = (prefix, layer)
        return owner[1] if owner else None
    head = name.split("/", 1)[0]
    return head if head in layers and "/" in name else None


def check(root):
    root = pathlib.Path(root)
    layers, api = read_layers(root / "docs" / "architecture.md")
    rank = {layer: i for i, layer in enumerate(layers)}
    files = []
    for layer in layers:
        for p in sorted((root / layer).rglob("*")):
            if p.suffix in SOURCES and p.is_file():
                files.append((p, layer))
    for p in sorted((root / "include" / "dear").rglob("*")):
        if p.suffix in SOURCES and p.is_file():
            owner = layer_of_include(str(p.relative_to(root / "include")), layers, api)
            if owner is None:
                print(f"{p.relative_to(root)}: public header that no layer owns "
                      "(add it to an 'api:' line of docs/architecture.md)")
                return 1, 0
            files.append((p, owner))
    bad = 0
    edges = 0
    for path, layer in files:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            name = m.group(1)
            if (path.parent / name).is_file():
                continue  # relative to the including file: its own folder, its own layer
            target = layer_of_include(name, layers, api)
            edges += 1
            where = f"{path.relative_to(root)}:{lineno}"
            if target is None:
                print(f'{where}: #include "{name}": not a header of any layer '
                      f"({layer} may include only {', '.join(layers[:rank[layer] + 1])})")
                bad += 1
            elif rank[target] > rank[layer]:
                print(f'{where}: #include "{name}": {layer} includes {target}, a layer above it')
                bad += 1
    return (1 if bad else 0), edges


def self_test():
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        (root / "docs").mkdir()
        (root / "docs" / "architecture.md").write_text(
            "## Layers\n\n```\nhigh/  top\n       api: dear/high.h\nlow/   bottom\n```\n")
        for folder in ("high", "low", "include/dear"):
            (root / folder).mkdir(parents=True)
        (root / "low" / "a.h").write_text('#include "dear/high.h"\n')
        (root / "high" / "b.cc").write_text('#include "low/a.h"\n#include "b.h"\n')
        (root / "high" / "b.h").write_text("\n")
        (root / "include" / "dear" / "high.h").write_text('#include "low/a.h"\n')
        status, _ = check(root)
        if status == 0:
            print("self-test: a low layer including a high layer's public header passed")
            return 1
        (root / "low" / "a.h").write_text("\n")
        status, edges = check(root)
        if status != 0 or edges != 2:
            print(f"self-test: a clean tree failed (status {status}, {edges} edges)")
            return 1
        (root / "low" / "c.cc").write_text('#include "high/b.h"\n')
        status, _ = check(root)
        if status == 0:
            print("self-test: low/ including high/ passed")
            return 1
    print("self-test: upward includes are caught, a clean tree passes")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent)
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    status, edges = check(args.root)
    if status == 0:
        if edges == 0:
            print("no includes between layers found: the check saw nothing")
            return 1
        print(f"layers: {edges} includes checked against docs/architecture.md, all point down")
    return status


if __name__ == "__main__":
    sys.exit(main())
