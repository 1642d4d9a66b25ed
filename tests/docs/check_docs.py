#!/usr/bin/env python3
"""The documentation's promises, checked (CTest `docs_examples`, `docs_links`):
- every ```c block with a main() in README.md and docs/*.md compiles as C11 against the built
  library and runs with exit status 0;
- the README's Python example runs and prints what the README's C program prints (same layer,
  same data);
- every relative Markdown link in README.md, docs/, bindings/ and perf/ resolves;
- the product speaks to its users (`docs_history`): no development-process reference (the word
  issue or step followed by a number) and no path to the shared folder beside a checkout, in
  the README, docs/, the sources, headers, tests, bindings, scripts, examples and perf/'s code.
  perf/NOTES.md and perf/history/ keep the measurement history and are not checked.
Usage: check_docs.py examples|links|history <source dir> [<build dir with src/libmoeblaze.so.0>]"""
import os
import re
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files(src):
    out = [os.path.join(src, "README.md")]
    for top in ("docs", "bindings", "perf"):
        for root, dirs, files in os.walk(os.path.join(src, top)):
            dirs[:] = [d for d in dirs if d not in ("target", "__pycache__")]
            out += [os.path.join(root, f) for f in files if f.endswith(".md")]
    return sorted(out)


def check_links(src):
    bad = []
    count = 0
    for md in markdown_files(src):
        text = open(md, encoding="utf-8").read()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            count += 1
            path = os.path.normpath(os.path.join(os.path.dirname(md), target.split("#")[0]))
            if not os.path.exists(path):
                bad.append("%s: %s" % (os.path.relpath(md, src), target))
    for b in bad:
        print("broken link:", b)
    print("docs links: %d relative links checked, %d broken" % (count, len(bad)))
    return not bad


def run_c(code, src, build, tag):
    lib = os.path.join(build, "src")
    with tempfile.TemporaryDirectory() as tmp:
        c = os.path.join(tmp, "example.c")
        exe = os.path.join(tmp, "example")
        open(c, "w").write(code)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-std=c11", "-Wall", "-Werror", c, "-I", os.path.join(src, "include"), "-L", lib,
                        "-lmoeblaze", "-Wl,-rpath," + lib, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    print("%s: %s" % (tag, out.strip()))
    return out


def check_examples(src, build):
    readme = open(os.path.join(src, "README.md"), encoding="utf-8").read()
    readme_c = None
    for md in [os.path.join(src, "README.md")] + [f for f in markdown_files(src) if "/docs/" in f]:
        for i, (lang, code) in enumerate(FENCE.findall(open(md, encoding="utf-8").read())):
            if lang == "c" and "int main" in code:
                out = run_c(code, src, build, "%s C example %d" % (os.path.relpath(md, src), i))
                if md.endswith("README.md") and readme_c is None:
                    readme_c = out
    py = [code for lang, code in FENCE.findall(readme) if lang == "python" and "import moeblaze" in code]
    if readme_c is None or not py:
        print("README: no C program or no Python example found")
        return False
    # As after `pip install .`, but on this build: the package from the source tree, the library
    # from the build directory.
    env = dict(os.environ, MOEBLAZE_LIBRARY=os.path.join(build, "src", "libmoeblaze.so.0"),
               PYTHONPATH=os.path.join(src, "bindings", "python"))
    out = subprocess.run([sys.executable, "-c", py[0]], cwd=src, env=env, check=True, capture_output=True, text=True).stdout
    print("README Python example: %s" % out.strip())
    same = out.strip() == readme_c.strip().split("; saved")[0]
    print("README examples agree: %s" % ("yes" if same else "NO"))
    return same


HISTORY = re.compile(r"(?<![-\w])(issues?|steps?) #?[0-9]+\b|\.\./shared/", re.I)
HISTORY_TOPS = ("docs", "src", "include", "tests", "bindings", "scripts", "examples", "perf")
HISTORY_EXTS = (".md", ".c", ".h", ".cpp", ".hpp", ".cu", ".cuh", ".py", ".sh", ".txt", ".rs", ".jl", ".toml", ".in")


def history_files(src):
    out = [os.path.join(src, "README.md"), os.path.join(src, "CMakeLists.txt")]
    for top in HISTORY_TOPS:
        for root, dirs, files in os.walk(os.path.join(src, top)):
            dirs[:] = [d for d in dirs if d not in ("target", "__pycache__", "results", "corpus", "history")]
            for f in files:
                rel = os.path.relpath(os.path.join(root, f), src)
                if rel == "perf/NOTES.md" or not f.endswith(HISTORY_EXTS):
                    continue
                out.append(os.path.join(root, f))
    return sorted(out)


def check_history(src):
    bad = []
    files = history_files(src)
    for path in files:
        for n, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
            m = HISTORY.search(line)
            if m:
                bad.append("%s:%d: %r" % (os.path.relpath(path, src), n, m.group(0)))
    for b in bad:
        print("development-process reference or outside path:", b)
    print("history check: %d files, %d references" % (len(files), len(bad)))
    return not bad


if __name__ == "__main__":
    what, src = sys.argv[1], os.path.abspath(sys.argv[2])
    if what == "links":
        ok = check_links(src)
    elif what == "history":
        ok = check_history(src)
    else:
        ok = check_examples(src, os.path.abspath(sys.argv[3]))
    sys.exit(0 if ok else 1)
