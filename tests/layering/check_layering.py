#!/usr/bin/env python3
"""The layering rule of docs/architecture.md, checked on every `#include "..."` of the tree.

Each source file belongs to one module (by its path); an include of another module's header is an
edge, and every edge must be allowed below. Also enforced: library code never uses
std::filesystem (core/files.h says why), and no source file of ours is longer than MAX_LINES.

Run with the source root as argument; exits 1 listing every violation. `--self-test` first plants
bad files in a scratch tree and checks that each one is caught (so the checker cannot pass by
accident), then checks the real tree.
"""
import os
import re
import sys
import tempfile

# module -> modules it may include (itself always allowed)
ALLOWED = {
    "core": set(),
    "comm": {"core"},
    "attention": {"core"},
    "config": {"core"},
    "model": {"core", "attention", "config"},
    "data": {"core"},
    "optim": {"core"},
    "metrics": {"core"},
    "checkpoint": {"core", "model", "optim"},
    "eval": {"core", "attention", "config", "model", "data"},
    "roles": {"core", "comm", "attention", "config", "model", "data", "optim", "metrics",
              "checkpoint", "eval"},
    "main": {"core", "comm", "attention", "config", "model", "data", "optim", "metrics",
             "checkpoint", "eval", "roles"},
}
LIBRARY_MODULES = set(ALLOWED) - {"main"}
SOURCE_EXT = (".h", ".cpp", ".cu", ".cuh")
MAX_LINES = 650
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def module_of(rel):
    """The module of a path relative to the root, or None (tests, bench, tools: unconstrained)."""
    parts = rel.split("/")
    if parts[0] in ("core", "comm", "attention"):
        return parts[0]
    if parts[0] == "trainer":
        if len(parts) == 2:
            name = parts[1].split(".")[0]
            return "main" if name == "main" else name  # trainer/config.{h,cpp}
        return parts[1]
    return None


def check(root):
    errors = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("build",)]
        for fn in filenames:
            if not fn.endswith(SOURCE_EXT):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            mod = module_of(rel)
            if mod is None:
                continue
            if mod not in ALLOWED:
                errors.append(f"{rel}: module '{mod}' is not in the layering table")
                continue
            text = open(path, encoding="utf-8", errors="replace").read()
            for m in INCLUDE.finditer(text):
                inc = m.group(1)
                target = module_of(inc)
                if target is None or target == mod:
                    continue
                if target not in ALLOWED[mod]:
                    line = text.count("\n", 0, m.start()) + 1
                    errors.append(f"{rel}:{line}: {mod} -> {target} ('{inc}') is not an allowed edge "
                                  f"({mod} may include: {', '.join(sorted(ALLOWED[mod])) or 'nothing of ours'})")
            if mod in LIBRARY_MODULES and re.search(r"std::filesystem|<filesystem>", text):
                if mod != "core" or "files" not in fn:
                    errors.append(f"{rel}: uses std::filesystem (library code uses core/files.h)")
            n = text.count("\n")
            if n > MAX_LINES:
                errors.append(f"{rel}: {n} lines (at most {MAX_LINES})")
    return errors


def self_test():
    planted = {
        "core/bad.h": '#include "comm/communicator.h"\n',              # core -> comm
        "attention/bad.cpp": '#include "core/error.h"\n#include "comm/check.h"\n',  # attention -> comm
        "trainer/model/bad.cpp": '#include "trainer/roles/roles.h"\n',   # model -> roles
        "trainer/data/bad.cpp": '#include <filesystem>\n',               # std::filesystem
        "trainer/optim/long.cpp": "//\n" * (MAX_LINES + 1),              # too long
    }
    fine = {
        "trainer/roles/ok.cpp": '#include "comm/communicator.h"\n#include "trainer/model/target.h"\n',
        "tests/ok.cpp": '#include <filesystem>\n#include "trainer/roles/roles.h"\n',
        "core/ok.cpp": '#include "core/error.h"\n',
    }
    with tempfile.TemporaryDirectory() as d:
        for rel, text in {**planted, **fine}.items():
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            open(os.path.join(d, rel), "w").write(text)
        errs = check(d)
    for rel in planted:
        if not any(e.startswith(rel) for e in errs):
            print(f"self-test FAILED: planted violation in {rel} was not reported")
            return False
    for rel in fine:
        if any(e.startswith(rel) for e in errs):
            print(f"self-test FAILED: allowed file {rel} was reported: {errs}")
            return False
    print(f"self-test: {len(planted)} planted violations caught, {len(fine)} allowed files passed")
    return True


def main(argv):
    args = [a for a in argv[1:] if a != "--self-test"]
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "..")
    if "--self-test" in argv and not self_test():
        return 1
    errs = check(root)
    for e in errs:
        print(e)
    if errs:
        print(f"{len(errs)} layering violation(s); the allowed graph is in docs/architecture.md")
        return 1
    print("layering: every include follows the allowed graph")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
