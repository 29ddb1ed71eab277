"""Evaluation suites: loaders, graders, runners, reports (installed as cotserve.eval)."""
