#!/usr/bin/env python3
"""The README's tables of results must be what reports/make_report.py --readme-table makes of the
committed reports now, and every machine with a committed report must have one: each table between
a "generated: python3 reports/make_report.py --readme-table FOLDER" mark and its closing mark, line
for line, and a table for every reports/<machine>/ that holds a bench.json (a <machine>-bf16 folder
is a column of <machine>'s table where that exists). On a difference it prints a diff; regenerate
with `python3 reports/make_report.py --update-readme README.md`.

  check_readme_results.py README.md
"""
import difflib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_report  # noqa: E402


def main(readme):
    root = os.path.dirname(os.path.abspath(readme))
    make_report.readme_table.root = root
    lines = open(readme).read().splitlines()
    problems = []
    try:
        blocks = make_report.readme_blocks(lines)
    except ValueError:
        print(f"check_readme_results.py: {readme} has an opening mark without {make_report.README_CLOSE}")
        return 1
    named = set()
    for folder, start, end in blocks:
        named.add(os.path.normpath(folder))
        if not os.path.exists(os.path.join(root, folder, "bench.json")):
            problems.append(f"a table names {folder}, which holds no bench.json")
            continue
        want = make_report.readme_table(folder)
        have = lines[start:end]
        if have != want:
            problems.append(f"the table of {folder} is not what the committed JSON makes:\n" + "\n".join(
                difflib.unified_diff(have, want, "README.md", f"--readme-table {folder}", lineterm="")))
    reports = os.path.join(root, "reports")
    for name in sorted(os.listdir(reports)):
        folder = os.path.join("reports", name)
        if not os.path.exists(os.path.join(reports, name, "bench.json")) or folder in named:
            continue
        if name.endswith("-bf16") and folder[:-len("-bf16")] in named:
            continue  # the bf16 columns of its machine's table
        problems.append(f"{folder} has a committed report and the README no table for it: add the lines "
                        f"'{make_report.README_OPEN}{folder} -->' and '{make_report.README_CLOSE}'")
    if not blocks:
        problems.append(f"{readme} has no table marked {make_report.README_OPEN}FOLDER -->")
    if problems:
        print("check_readme_results.py: " + "\ncheck_readme_results.py: ".join(problems))
        print(f"regenerate: python3 reports/make_report.py --update-readme {readme}")
        return 1
    print(f"check_readme_results.py: the README's {len(blocks)} tables are the committed reports' "
          f"({', '.join(sorted(named))})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
