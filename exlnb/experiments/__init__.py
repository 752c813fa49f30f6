"""The investigations behind the notebooks, one module per field report question.

Each module exposes `run(session, ...) -> ExperimentResult` (raw measurements as tidy DataFrames, the
effects with their uncertainty, and where the numbers came from) and `plot(result) -> Figure`. The
notebooks in `notebooks/` only set parameters, call these, and save what they return; the tests call the
same functions.
"""
