#!/usr/bin/env python3
"""The options page's table of strategy options must be what `strata_compare --list=markdown` prints
now: the table between the page's "generated" marks, line for line. On a difference it prints a
diff; regenerate the block with the command named in the opening mark.

  check_readme_options.py docs/options.md build/cpu/bench/strata_compare
"""
import difflib
import subprocess
import sys

OPEN = "<!-- generated: strata_compare --list=markdown"
CLOSE = "<!-- end of generated -->"


def main(page, compare):
    lines = open(page).read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(OPEN)]
    if len(starts) != 1:
        print(f"check_readme_options.py: {page} has {len(starts)} opening marks ({OPEN} ...), not one")
        return 1
    try:
        end = lines.index(CLOSE, starts[0])
    except ValueError:
        print(f"check_readme_options.py: {page} has no closing mark {CLOSE}")
        return 1
    have = lines[starts[0] + 1:end]
    want = subprocess.run([compare, "--list=markdown"], capture_output=True, text=True, check=True).stdout.splitlines()
    if have != want:
        print(f"check_readme_options.py: the table of options in {page} is not what the strategies register:")
        sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(have, want, page, "--list=markdown", lineterm=""))
        return 1
    print(f"check_readme_options.py: the {len(want)} lines of options in {page} match --list=markdown")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
