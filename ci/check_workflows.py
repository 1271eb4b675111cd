#!/usr/bin/env python3
"""Parses every workflow in .github/workflows/ (yaml.safe_load) and checks what the CI depends on.

Each file: a mapping with `on` (which PyYAML reads as the key True) and `jobs`, each job with
`runs-on`, `timeout-minutes` and `steps`, each step a `run` or a `uses` pinned to a ref.
A job on a GitHub-hosted ubuntu-* runner is the README's test command: actions/checkout, and its
only `run` is exactly `bash ci/test.sh` (the command, not a copy of its contents; nothing else
installed). A job on a self-hosted runner is the GPU job: labels self-hosted and gpu,
NCCL_NVLS_ENABLE=0 (workflow, job or step env), exactly one step `bash ci/gpu.sh DIR` whose
failure is not swallowed (no continue-on-error on it or the job, no `||`, `;`, `&` or `|`, no
`if:`), then actions/upload-artifact of DIR with `if: always()` and a name that carries the run's
id. Any other runner is an error, and the folder must hold at least one job of each kind.

  ci/check_workflows.py [WORKFLOWS_DIR]     (default .github/workflows)

Exit status 0 when every check holds, 1 with one line per failure otherwise.
"""
import os
import re
import shlex
import sys

try:
    import yaml
except ImportError:
    sys.exit("check_workflows: no PyYAML for this python3 (apt: python3-yaml; ci/setup.sh installs it)")

TEST_COMMAND = "bash ci/test.sh"  # the README's test command


def steps_using(steps, action):
    return [s for s in steps if str(s.get("uses", "")).split("@")[0] == action]


def runner_labels(runs_on):
    if isinstance(runs_on, str):
        return [runs_on]
    if isinstance(runs_on, list) and all(isinstance(x, str) for x in runs_on):
        return runs_on
    return None


def check_hosted(where, job, steps, problems):
    if not steps_using(steps, "actions/checkout"):
        problems.append(f"{where}: no actions/checkout step")
    runs = [str(s["run"]).strip() for s in steps if "run" in s]
    if runs != [TEST_COMMAND]:
        problems.append(f"{where}: its run steps must be exactly [{TEST_COMMAND!r}] (the README's command), not {runs}")
    others = [s["uses"] for s in steps if "uses" in s and not str(s["uses"]).startswith("actions/checkout@")]
    if others:
        problems.append(f"{where}: installs or runs more than ci/setup.sh and ci/test.sh do: {others}")


def swallowed(command):
    """Why a `run` of ci/gpu.sh might not fail its step when gpu.sh fails, or None."""
    if "\n" in command:
        return "more than one line"
    if re.search(r"[|;&]", command):
        return "a shell operator (||, ;, & or |) that can hide gpu.sh's exit status"
    return None


def check_gpu(where, job, steps, problems, env):
    labels = runner_labels(job.get("runs-on")) or []
    if "gpu" not in labels:
        problems.append(f"{where}: runs-on {labels} has no gpu label")
    if job.get("continue-on-error"):
        problems.append(f"{where}: continue-on-error on the job swallows the gate's failure")
    gpu_steps = [(i, s) for i, s in enumerate(steps) if "ci/gpu.sh" in str(s.get("run", ""))]
    if len(gpu_steps) != 1:
        problems.append(f"{where}: {len(gpu_steps)} steps run ci/gpu.sh, not 1")
        return
    i, step = gpu_steps[0]
    if str({**env, **(step.get("env") or {})}.get("NCCL_NVLS_ENABLE", "")) != "0":
        problems.append(f"{where}: NCCL_NVLS_ENABLE is not \"0\" where ci/gpu.sh runs (multi-GPU hosts need NVLS off)")
    command = str(step["run"]).strip()
    words = [] if swallowed(command) else shlex.split(command)
    outdir = None
    if len(words) == 3 and words[:2] == ["bash", "ci/gpu.sh"]:
        outdir = os.path.normpath(words[2])
    else:
        why = swallowed(command) or "not of the form `bash ci/gpu.sh DIR`"
        problems.append(f"{where}: the ci/gpu.sh step runs {command!r}: {why}")
    if step.get("continue-on-error"):
        problems.append(f"{where}: continue-on-error on the ci/gpu.sh step swallows the gate's failure")
    if "if" in step:
        problems.append(f"{where}: the ci/gpu.sh step has an if: ({step['if']!r}); it must always run")
    uploads = [s for s in steps[i + 1:] if str(s.get("uses", "")).split("@")[0] == "actions/upload-artifact"]
    if not uploads:
        problems.append(f"{where}: no actions/upload-artifact step after ci/gpu.sh")
        return
    upload = uploads[0]
    given = upload.get("with") or {}
    if outdir is not None and os.path.normpath(str(given.get("path", ""))) != outdir:
        problems.append(f"{where}: the artifact's path is {given.get('path')!r}, not ci/gpu.sh's OUTDIR {words[2]!r}")
    if "github.run_id" not in str(given.get("name", "")):
        problems.append(f"{where}: the artifact's name {given.get('name')!r} does not carry github.run_id")
    if "always()" not in str(upload.get("if", "")):
        problems.append(f"{where}: the upload has no `if: always()`, so a failing gate would upload nothing")


def check_file(path, problems, kinds):
    name = os.path.basename(path)
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        problems.append(f"{name}: not YAML: {' '.join(str(e).split())}")
        return
    if not isinstance(doc, dict):
        problems.append(f"{name}: not a mapping")
        return
    # YAML 1.1 reads the bare key `on` as the boolean True.
    if not (doc.get("on") or doc.get(True)):
        problems.append(f"{name}: no `on` (no trigger)")
    jobs = doc.get("jobs")
    if not isinstance(jobs, dict) or not jobs:
        problems.append(f"{name}: no jobs")
        return
    for job_id, job in jobs.items():
        where = f"{name}: job {job_id}"
        if not isinstance(job, dict):
            problems.append(f"{where}: not a mapping")
            continue
        steps = job.get("steps")
        if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
            problems.append(f"{where}: no list of steps")
            continue
        for n, step in enumerate(steps):
            if ("run" in step) == ("uses" in step):
                problems.append(f"{where}: step {n + 1} has neither or both of run and uses")
            elif "uses" in step and "@" not in str(step["uses"]):
                problems.append(f"{where}: step {n + 1} uses {step['uses']!r} without a version")
        if not isinstance(job.get("timeout-minutes"), int):
            problems.append(f"{where}: no timeout-minutes")
        labels = runner_labels(job.get("runs-on"))
        if labels is None:
            problems.append(f"{where}: runs-on {job.get('runs-on')!r} is not a label or a list of labels")
        elif len(labels) == 1 and labels[0].startswith("ubuntu-"):
            kinds.add("hosted")
            check_hosted(where, job, steps, problems)
        elif "self-hosted" in labels:
            kinds.add("gpu")
            env = {**(doc.get("env") or {}), **(job.get("env") or {})}
            check_gpu(where, job, steps, problems, env)
        else:
            problems.append(f"{where}: runs-on {labels}: neither a hosted ubuntu-* runner nor a self-hosted one")


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else ".github/workflows"
    if not os.path.isdir(folder):
        sys.exit(f"check_workflows: no folder {folder}")
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder))
    problems, kinds = [], set()
    for path in files:
        if not path.endswith((".yml", ".yaml")):
            problems.append(f"{os.path.basename(path)}: not a .yml or .yaml file in a workflows folder")
            continue
        check_file(path, problems, kinds)
    for kind, what in (("hosted", "hosted ubuntu-* runner"), ("gpu", "self-hosted runner")):
        if kind not in kinds:
            problems.append(f"{folder}: no job on a {what}")
    for p in problems:
        print(f"check_workflows: FAILED: {p}")
    if problems:
        return 1
    print(f"check_workflows: ok ({len(files)} workflows: {', '.join(os.path.basename(f) for f in files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
