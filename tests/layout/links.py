#!/usr/bin/env python3
"""links: every relative link of README.md and docs/*.md points to a file of
the tree, and every #anchor to a heading of its page, so a renamed file or
heading fails here instead of leaving a dead link. And every file of the tree
(sources, scripts, build files, docs) that names a markdown file names one the
tree has: a comment that sends its reader to a page kept outside the
repository sends them nowhere.

Anchors are made as GitHub makes them: the heading's text without markup,
lower case, every character but letters, digits, '-', '_' and spaces
dropped, spaces turned into '-'; a repeated heading gets -1, -2, ...
Links inside code (fenced blocks, `inline`) and to other sites (scheme:)
are not checked.

    links.py SOURCE_ROOT"""

import os
import re
import subprocess
import sys

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def strip_code(line):
    return re.sub(r"`+[^`]*`+", "", line)


def slug(text):
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # html tags
    text = text.replace("`", "").replace("*", "")
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def lines_outside_code(path):
    """(line number, line) of path outside fenced code blocks."""
    fenced = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = FENCE.match(line)
            if m:
                if fenced is None:
                    fenced = m.group(1)
                elif m.group(1) == fenced:
                    fenced = None
                continue
            if fenced is None:
                yield n, line.rstrip("\n")


_anchors = {}


def anchors(path):
    if path not in _anchors:
        seen, out = {}, set()
        for _, line in lines_outside_code(path):
            m = HEADING.match(line)
            if not m:
                continue
            s = slug(m.group(2))
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else f"{s}-{k}")
        _anchors[path] = out
    return _anchors[path]


MD_NAME = re.compile(r"[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-]\.md\b")
URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://\S+")


def tree_files():
    """The tree's files, relative to the root: git's list (tracked, and new
    files not ignored) in a checkout, else a walk that skips hidden folders
    and meson build directories."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True).stdout
        files = [f for f in out.decode().split("\0") if f and os.path.isfile(f)]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for d, dirs, names in os.walk("."):
        dirs[:] = [x for x in dirs if not x.startswith(".")
                   and not os.path.isdir(os.path.join(d, x, "meson-private"))]
        files += [os.path.relpath(os.path.join(d, n)) for n in names]
    return files


def md_references(files):
    """Every name of a .md file in files that is not a file of the tree: not
    there relative to the naming file's folder or to the root, and no .md
    file of the tree has its base name (a bare "ARCHITECTURE.md" may name
    docs/ARCHITECTURE.md). Returns the number of dead ones, printed."""
    md_base = {os.path.basename(f) for f in files if f.endswith(".md")}
    bad = 0
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                text = fh.read(1 << 20)
        except (UnicodeDecodeError, OSError):
            continue  # binary, or unreadable: names nothing
        for n, line in enumerate(text.splitlines(), 1):
            for m in MD_NAME.finditer(URL.sub("", line)):
                name = m.group(0)
                if (os.path.exists(os.path.normpath(os.path.join(os.path.dirname(f), name)))
                        or os.path.exists(os.path.normpath(name.lstrip("/")))
                        or os.path.basename(name) in md_base):
                    continue
                print(f"links: {f}:{n}: names {name}, which is not in the tree", file=sys.stderr)
                bad += 1
    return bad


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    os.chdir(root)
    pages = ["README.md"] + sorted(
        os.path.join("docs", f) for f in os.listdir("docs") if f.endswith(".md"))
    bad, checked = 0, 0
    for page in pages:
        for n, line in lines_outside_code(page):
            for m in LINK.finditer(strip_code(line)):
                target = m.group(1)
                if not target or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                    continue  # another site, mail
                checked += 1
                file, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file \
                    else page
                where = f"{page}:{n}: ({target})"
                if not os.path.exists(dest):
                    print(f"links: {where}: no file {dest}", file=sys.stderr)
                    bad += 1
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    print(f"links: {where}: {dest} has no heading with anchor #{anchor}",
                          file=sys.stderr)
                    bad += 1
    files = tree_files()
    dead_md = md_references(files)
    if bad or dead_md:
        print(f"links: {bad} dead link(s) of {checked}; {dead_md} name(s) of a .md file the "
              "tree does not have", file=sys.stderr)
        return 1
    print(f"links: {checked} relative links of {len(pages)} pages point to what exists; "
          f"every .md file {len(files)} files name is in the tree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
