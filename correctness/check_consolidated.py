#!/usr/bin/env python3
"""A consolidated strata checkpoint read with PyTorch alone: its one file holds every parameter whole,
in the model's shape, equal to the run's own parameters (saved beside it), with its moments and step.

  python3 correctness/check_consolidated.py CONSOLIDATED_STEP_DIR EXPECTED_STEP_DIR
"""
import os
import sys

import torch


def main(whole_dir, expected_dir):
    state = torch.load(os.path.join(whole_dir, "state.pt"), weights_only=True)  # the default from PyTorch 2.6
    expected = torch.load(os.path.join(expected_dir, "parameters.pt"), weights_only=True)
    assert expected, "no parameters expected"
    for name, value in expected.items():
        assert name in state, f"{name} is not in the consolidated state"
        got = state[name]
        assert got.shape == value.shape, f"{name}: {tuple(got.shape)} consolidated, {tuple(value.shape)} in the run"
        assert torch.equal(got, value), f"{name}: values differ from the run's"
        assert f"{name}/exp_avg" in state and state[f"{name}/exp_avg"].shape == value.shape, f"{name}: no whole exp_avg"
        assert f"{name}/step" in state and int(state[f"{name}/step"].item()) == 2, f"{name}: no step 2"
    print(f"consolidated: {len(expected)} parameters whole and equal to the run's, with their moments")


if __name__ == "__main__":
    main(*sys.argv[1:])
