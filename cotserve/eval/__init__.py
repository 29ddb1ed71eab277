"""Evaluation suites: loaders, graders, runners, reports."""
