"""Deploy configs (deploy/) and developer scripts, run from the repository root as `python -m ops.NAME`."""
