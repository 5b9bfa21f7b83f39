#!/usr/bin/env python3
"""links: every relative link of README.md and docs/*.md points to a file of
the tree, and every #anchor to a heading of its page, so a renamed file or
heading fails here instead of leaving a dead link.

Anchors are made as GitHub makes them: the heading's text without markup,
lower case, every character but letters, digits, '-', '_' and spaces
dropped, spaces turned into '-'; a repeated heading gets -1, -2, ...
Links inside code (fenced blocks, `inline`) and to other sites (scheme:)
are not checked.

    links.py SOURCE_ROOT"""

import os
import re
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
    if bad:
        print(f"links: {bad} dead link(s) of {checked}", file=sys.stderr)
        return 1
    print(f"links: {checked} relative links of {len(pages)} pages point to what exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
