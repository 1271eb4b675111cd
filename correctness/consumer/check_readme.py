#!/usr/bin/env python3
"""The README's excerpt of correctness/consumer/trainer.cpp must be the file CI builds: every line of
the excerpt (but the `// ...` elisions) appears in trainer.cpp, in the same order.

  check_readme.py README.md correctness/consumer/trainer.cpp
"""
import sys

MARK = "<!-- excerpt of correctness/consumer/trainer.cpp -->"


def excerpt(readme):
    lines = open(readme).read().splitlines()
    start = lines.index(MARK) + 2  # past the mark and the opening fence
    end = lines.index("```", start)
    return [line for line in lines[start:end] if line.strip() != "// ..."]


def main(readme, source):
    wanted = excerpt(readme)
    have = open(source).read().splitlines()
    at = 0
    for line in wanted:
        try:
            at = have.index(line, at) + 1
        except ValueError:
            print(f"check_readme.py: the README's line is not in {source} (after line {at}):\n  {line}")
            return 1
    print(f"check_readme.py: {len(wanted)} lines of the README's excerpt found in order in {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
