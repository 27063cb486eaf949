"""Research and maintenance tools for tpsample (not installed; run from the repository root
as `python -m tools.NAME`). See tools/README.md."""
