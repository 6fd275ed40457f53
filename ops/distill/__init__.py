"""Developer scripts of the shipped drafter's distillation runs, run from the repository root as
`python -m ops.distill.NAME`."""
