#!/usr/bin/env python3
"""The documentation's excerpt of correctness/consumer/trainer.cpp must be the file CI builds: every
line of the excerpt (but the `// ...` elisions) appears in trainer.cpp, in the same order.

The excerpt lives on the page about using strata from a project of one's own (docs/using-strata.md).
Given that page, it is checked there; given the README, the README must lead to it: the one page
the README links to (a relative Markdown link) that holds the excerpt's mark is checked.

  check_readme.py docs/using-strata.md correctness/consumer/trainer.cpp
  check_readme.py README.md correctness/consumer/trainer.cpp
"""
import os
import re
import sys

MARK = "<!-- excerpt of correctness/consumer/trainer.cpp -->"


def page_with_excerpt(path):
    """`path` where it holds the mark; else the one page it links to that does (None and a reason
    where there is no such page, or more than one)."""
    text = open(path).read()
    if MARK in text.splitlines():
        return path, ""
    here = os.path.dirname(os.path.abspath(path))
    linked = []
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
        page = os.path.normpath(os.path.join(here, target))
        if os.path.exists(page) and page not in linked and MARK in open(page).read().splitlines():
            linked.append(page)
    if len(linked) != 1:
        return None, (f"{path} has no excerpt ({MARK}) and links to {len(linked)} pages that have one"
                      + (f": {', '.join(linked)}" if linked else "") + ", not one")
    return linked[0], ""


def excerpt(page):
    lines = open(page).read().splitlines()
    start = lines.index(MARK) + 2  # past the mark and the opening fence
    end = lines.index("```", start)
    return [line for line in lines[start:end] if line.strip() != "// ..."]


def main(doc, source):
    page, why = page_with_excerpt(doc)
    if page is None:
        print(f"check_readme.py: {why}")
        return 1
    wanted = excerpt(page)
    have = open(source).read().splitlines()
    at = 0
    for line in wanted:
        try:
            at = have.index(line, at) + 1
        except ValueError:
            print(f"check_readme.py: {page}'s line is not in {source} (after line {at}):\n  {line}")
            return 1
    print(f"check_readme.py: {len(wanted)} lines of {os.path.relpath(page)}'s excerpt found in order in {source}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:3]))
